"""Plain decoding with each forward queued one token ahead of the host (docs/architecture.md,
"Plain steps ahead").

A request that decodes plainly from its first token to its last (mode ar, or speculation off for
the request, no context lookup), with no reference tokens, needs nothing from the host between two
forwards: the next forward's input is the token chosen from this one's logits, which the device
computes and feeds itself (sampling.next_token_tensor: an argmax, or an inverse-CDF sample whose
uniform the host draws in advance). So forward r+1 is queued with that input still on the device, and only
then does the host read token r (an event recorded after its copy: it waits for forward r, not for
r+1) and do its bookkeeping (stop checks, the stream; under a batched driver, the other sessions'
work): the device runs forward r+1 meanwhile instead of idling. Where a stop token ends the request,
the forward queued after it is wasted (one row; its K/V lands in a slot the request reserved and no
one reads); max_new_tokens is known in advance, so no forward is queued past it.

The tokens are plain decoding's: those of sampling.next_token on the same logits, with the same
draws of the request's generator. The slow twin is plain_step.plain_step_co (EngineConfig
plain_ahead=false), which reads each token before the next forward; tests compare them.
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Callable, Generator, Optional, Union

import torch

from specextend.controller import TreeController
from specextend.emit import Emitter, StepEvent
from specextend.lookup import RequestLookup
from specextend.models.transfer import record_event, to_host
from specextend.sampling import next_token_tensor
from specextend.stats import RequestStats
from specextend.target import TargetSession

if TYPE_CHECKING:
    from specextend.session_calls import Load


class _Queued:
    """A token being chosen on the device (after its forward): its host copy and the event after it."""

    __slots__ = ("device", "host", "event")

    def __init__(self, token: torch.Tensor) -> None:  # token [1] int64 on the device, being computed
        self.device = token  # the next forward's input
        self.host = to_host(token)  # [1] pinned, valid once `event` has completed
        self.event = record_event(token.device)

    def read(self) -> int:
        if self.event is not None:
            self.event.synchronize()  # the token's choice and copy, not the forward queued after it
        return int(self.host[0])


def plain_ahead_co(target: TargetSession, first: int, out: Emitter, stats: RequestStats, t1: float,
                   gen: torch.Generator, limit: Optional[int] = None,
                   more: Optional[Callable[[list[int]], int]] = None,
                   intervals: Optional[list[float]] = None) -> Generator[object, object, list[int]]:
    """Decodes from `first`, the last committed token (emitted, not yet in the cache), to the
    request's end, or `limit` tokens (a run: plain_run_co); yields each forward (ForwardCall,
    answered with its result) and each token's StepEvent; returns the tokens emitted. `t1`: when
    decoding began (perf_counter, for stats.decode_s); `gen`: the request's generator (sampling).
    `more(emitted so far)`, asked once the `limit` forwards are queued and the last one's token is
    still on the device: how many more it may take (0: the run ends there), so that the next run
    begins from that token without the host reading it first. `intervals`: appended at each read
    with the seconds since the read before, where a forward was queued between the reads (the
    first read and the run's last have none): what a plain step costs in a steady run, forward and
    host together. The cache's invariant holds at the end: every token in it but the last emitted."""
    queued: Optional[_Queued] = None  # the token whose forward is queued, not yet read
    ids: Union[int, torch.Tensor] = first  # the next forward's input: then a [1] tensor on the device
    emitted: list[int] = []
    forwards, t_step, t_read = 0, time.perf_counter(), None
    while out.finish is None:
        # tokens emitted once `queued` is read: a forward past max_new_tokens (or the run) would be wasted
        room = stats.num_generated + (queued is not None) < out.params.max_new_tokens
        if room and limit is not None and forwards >= limit and more is not None and queued is not None:
            limit += more(emitted)  # the next run, queued on the token not yet read
        if room and (limit is None or forwards < limit):
            logits = yield from target.decode_co(ids)  # [V]
            forwards += 1
            ahead: Optional[_Queued] = _Queued(next_token_tensor(logits, out.params, gen))
            ids = ahead.device
        else:
            ahead = None
        if queued is None:  # the first forward (nothing to read yet), or the run's end
            if ahead is None:
                break
            queued = ahead
            continue
        token = queued.read()
        queued = ahead
        now = time.perf_counter()
        if intervals is not None and t_read is not None and ahead is not None:  # (a forward queued between
            intervals.append(now - t_read)  # the reads: a whole step; the run's last reads lack one)
        t_read = now
        ev: StepEvent = out.emit([token])
        emitted += ev.token_ids
        stats.step_read("plain", len(ev.token_ids), t_step, now, t1)  # (from the last token read to this one)
        stats.ahead_steps += 1
        yield ev
        t_step = time.perf_counter()
    return emitted


RUN_TOKENS = 8  # a run's most tokens: a gate that learns chains pay again waits at most that


def run_length(ctl: TreeController, out: Emitter, stats: RequestStats, lookup: Optional[RequestLookup] = None,
               speculative: bool = True) -> int:
    """Tokens a run of plain steps ahead may take now, at a plain step (0: none, a step as usual):
    where the request's context `lookup` (if any) would verify no chain found in the run
    (RequestLookup.could_pay: a chain appears at any token, so "none here" is not enough), once its
    gate has measured a plain step's host work (RequestLookup.priced); up to RUN_TOKENS, never past
    the request's end, at least 2 (one token gains nothing); in a `speculative` request (its policy
    chose the plain step) never past the policy's next probe, its way back to trees."""
    if lookup is not None and (not lookup.priced or lookup.could_pay()):  # (priced: a plain step's host
        return 0  # work measured first, which a run does not teach the gate)
    return run_room(ctl, out, stats, speculative, RUN_TOKENS)


def run_room(ctl: TreeController, out: Emitter, stats: RequestStats, speculative: bool, most: int) -> int:
    """Steps a run ahead may take now, up to `most` (0: none, where fewer than 2): never past the
    request's end nor, in a `speculative` request, past the policy's next probe or a plain recheck
    (timed alone). Runs of plain steps (run_length) and lookup runs (lookup_ahead.py) alike."""
    if speculative and (ctl.probe_every <= ctl.since_probe or ctl.recheck.pending):
        return 0
    to_probe = ctl.probe_every - ctl.since_probe if speculative else most
    k = min(most, to_probe, out.params.max_new_tokens - stats.num_generated)
    return k if k >= 2 else 0


def plain_run_co(target: TargetSession, last: int, out: Emitter, stats: RequestStats, t1: float,
                 gen: torch.Generator, k: int, ctl: TreeController,
                 lookup: Optional[RequestLookup], speculative: bool = True,
                 load: Optional[Load] = None,
                 heard: Optional[Callable[[list[int]], None]] = None,
                 governed: bool = False, chains: bool = True) -> Generator[object, object, list[int]]:
    """A run of `k` plain steps ahead (run_length) from the last committed token `last`: the tokens
    emitted, each counted as a plain step by the policy (its probe schedule), the request's stats
    and the context lookup (RequestLookup.commit_run). The draft hears of them with the next tree
    step's call, as of any plain step's, or, overlapping, through `heard` once its part of the run
    is read (draft_link.RunTells). Where run_length allows another run when this one's forwards
    are queued, it follows at once, queued on the last token before the host reads it: between
    runs the device does not wait for the host (in a batched round, for the host of any one
    session at a run's end). A speculative request's policy is asked too whether a
    plain step is still its best (`plain_still_best`, with the sessions that share the forwards now,
    `load`): a run prices the plain step anew (`teach`), and a batch that grew may make trees pay.
    `governed`: a speculative request that the batch's governor may hold (governor.py): no further run
    once the hold changes (`load.held`; without that, a run begun under a plain hold, or with the
    sessions free, went on to the request's end or the policy's probe, and the governor's trees
    window found the batch decoding plainly). `chains` False (held to plain steps): the runs go on
    whatever the lookup would find (it hears their tokens still)."""
    taught, behind = 0, ctl.behind  # (the draft's tokens to catch up on before a tree: the run's too)
    hold = load.held if load is not None else None  # (the governor's, at the run's start)
    intervals: list[float] = []  # seconds between reads, of the tokens read since the last teach

    def teach(emitted: list[int]) -> None:
        """Each new token a plain step of the policy's, priced at the median interval between a read
        and the one before (a session alone: in a batch the interval is the batch's; the median,
        so that one interval that held the driver's other work, a request joining, does not price
        the run): without it a run taught nothing, and a plain price measured slow once (a cold
        first step, an open beside it) stayed while plain steps ran ahead (docs/architecture.md,
        "Plain steps ahead")."""
        nonlocal taught
        new, alone = emitted[taught:], load is None or load.sessions <= 1
        dts, intervals[:] = list(intervals), []  # (every token they time is among the new ones)
        # (the steps' whole cost, as a lookup run's: host work overlaps the forwards)
        ctl.record_plain_run(len(new), statistics.median(dts) if dts and alone else None)
        taught = len(emitted)
        stats.plain_steps += len(new)
        if heard is not None and new:
            heard(new)
        if lookup is not None and new:  # (each token teaches the gate what the chain skipped there would have given)
            lookup.commit_run(new)
            stats.lookup_skipped = lookup.skipped

    def more(emitted: list[int]) -> int:
        teach(emitted)
        if governed and load is not None and load.held != hold:
            return 0
        k = run_length(ctl, out, stats, lookup if chains else None, speculative)  # (0 at the probe or the end)
        if k and speculative:
            ctl.see_chain(lookup, behind + len(emitted))
            if not ctl.plain_still_best(load.sessions if load is not None else 1):
                return 0
        return k

    tokens = yield from plain_ahead_co(target, last, out, stats, t1, gen, limit=k, more=more, intervals=intervals)
    teach(tokens)
    return tokens
