"""Lookup runs ahead of the host (docs/architecture.md, "Lookup runs ahead").

A step without a draft tree that may verify a context-lookup chain needs the tokens so far to find
its chain: on the host that means reading the last step's tokens before the next forward is queued,
and the device idles meanwhile (about 0.45 ms a step on an H200 at 16K, against plain decoding's
steps queued ahead: plain_ahead.py). Here the request's tokens also live on the device
(DeviceHistory), which finds each step's chain (lookup_device.device_match, the host index's rule),
verifies it (lookup_device.accepted, on the target's argmax or sample: below) and appends what it
emits, so the next step's forward is queued before the host has read this one's tokens
(models/batch.AtDeviceLength: the committed length stays on the device). The host reads each step's
tokens one step behind, emits them and keeps its own index and the cache's length in step. Every
step verifies a path of `q` + 1 rows, chain or not (a padded chain's junk rows are never accepted):
on a GPU a row costs about 1% of the forward, less than the host's work that a step without a chain
would otherwise expose.

Where runs are forced (runs_ahead: by default greedy requests only, sampled ones having measured
slower in runs), a sampled request's run draws, at its start, one uniform for each position it
may emit from the request's generator, in order, as plain decoding would; each row's token is the
inverse-CDF sample of the target's distribution there with its position's uniform
(sampling.sample_rows), and a chain token is accepted where it is that sample, so the run emits
plain decoding's seeded tokens; at its end the generator is put where the tokens actually emitted leave it. Where the forward would
read the length back anyway (no full-step graphs: the CPU, whose twin `forward_at` synchronises),
steps take the host's way (plain_step.plain_step_co); tests force runs on the CPU to compare their
tokens with plain decoding's.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Callable, Generator, Optional

import torch

from specextend import fused_sample
from specextend.attention.backends import CAUSAL
from specextend.attention.triton_prefix import triton_available
from specextend.config import SamplingParams
from specextend.controller import TreeController
from specextend.emit import Emitter
from specextend.lookup import NGRAMS, ContextIndex, RequestLookup
from specextend.lookup_device import accepted, device_match
from specextend.models.batch import AtDeviceLength
from specextend.models.transfer import copy_from_host, record_event, to_device, to_host
from specextend.plain_ahead import plain_run_co, run_length, run_room
from specextend.sampling import rewind, sample_rows
from specextend.stats import RequestStats
from specextend.target import TargetSession
from specextend.verify import Reference

if TYPE_CHECKING:
    from specextend.session_calls import Load

log = logging.getLogger(__name__)

# a run's most steps: the policy is asked again after it, and the device idles for one host read
# between two runs (not measured apart: about a host step's work); nothing within a run waits to
# be learnt (its chains are verified whatever the gate says), and a speculative request's run ends
# at its probe
LOOKUP_RUN_STEPS = 32
RUN_DEPTH = 2  # steps queued and not yet read by the host


class DeviceHistory:
    """A request's tokens on the device: hist [capacity + q + 2] int64, the first `length` ([1] on
    the device) valid: the prompt and every emitted token, the last one (the next step's root) not
    yet in the target's cache. The host's ContextIndex holds the same tokens; `sync` copies the
    ones the device has not seen (those of steps taken the host's way) before a run. `fast`: the
    step's lookup and verdict as three Triton kernels (_triton_lookup.py; default: on CUDA with
    Triton) instead of their twins' torch ops (lookup_device.device_match, accepted)."""

    def __init__(self, capacity: int, q: int, device: torch.device, fast: Optional[bool] = None) -> None:
        device = torch.device(device)
        self.q = q
        self.hist = torch.zeros(capacity + q + 2, dtype=torch.long, device=device)  # [C]
        self.length = torch.zeros(1, dtype=torch.long, device=device)  # [1]
        self.rows = torch.arange(q + 1, device=device)  # [q + 1]
        self.synced = 0  # tokens of the host's index known to be in hist
        self.fast = fast if fast is not None else device.type == "cuda" and triton_available()
        self.ids = torch.zeros(q + 1, dtype=torch.long, device=device)  # [q + 1] the step's input: root, chain
        self.count = torch.zeros(1, dtype=torch.long, device=device)  # [1] the chain's real tokens
        self.best = torch.full((3,), -1, dtype=torch.int32, device=device)  # [3] latest start per order (fast)
        self.packed = torch.zeros(q + 3, dtype=torch.long, device=device)  # [q + 3] n, count, y (fast)
        self.params: Optional[SamplingParams] = None  # a sampled run's (begin); None: greedy
        self.uniforms: Optional[torch.Tensor] = None  # [R] float64: the run's draws, one per position
        self.drawn = torch.zeros(1, dtype=torch.long, device=device)  # [1] of them used (tokens emitted)
        self._state: Optional[torch.Tensor] = None  # the generator's state before the run's draws
        self.ref: Optional[Reference] = None  # benchmarks: a greedy run's reference tokens (begin)
        self.ref_ids: Optional[torch.Tensor] = None  # [len + q + 2] int64 its tokens, -1 past their end
        self._ref_of: Optional[Reference] = None  # the reference ref_ids holds
        self.base = 0  # output position of the run's first token (the reference's index)
        self.noted: Optional[torch.Tensor] = None  # [q + 1, 3] float32 the last verdict's own tokens and logits

    def sync(self, index: ContextIndex) -> None:
        n = index.length
        if n > self.synced:
            self.hist[self.synced:n].copy_(to_device(index.ids[self.synced:n], torch.long, self.hist.device))
        copy_from_host(self.length, [n])
        self.synced = n

    def begin(self, params: SamplingParams, gen: torch.Generator, tokens: int, ref: Optional[Reference] = None,
              emitted: int = 0) -> None:
        """A run that emits at most `tokens`: a sampled request's uniforms for those positions, drawn
        from its generator now (one per position, in order, as plain decoding draws them); `end`
        puts the generator where the tokens actually emitted leave it. `ref` (benchmarks, greedy):
        the request's reference tokens, `emitted` the output position the run starts at."""
        self.params = None if params.greedy else params
        self.drawn.zero_()
        self.ref, self.base = ref, emitted
        if ref is not None and self._ref_of is not ref:  # (uploaded once per reference)
            ids = torch.tensor(list(ref.tokens) + [-1] * (self.q + 2), dtype=torch.long)
            self.ref_ids, self._ref_of = to_device(ids, torch.long, self.hist.device), ref
        if self.params is None:
            return
        self._state = gen.get_state()
        draws = torch.rand((max(tokens, 1),), generator=gen, dtype=torch.float64)
        self.uniforms = to_device(draws, torch.float64, self.hist.device)  # [R]

    def end(self, gen: torch.Generator, emitted: int) -> None:
        """The run emitted `emitted` tokens: the generator as if it had drawn exactly that many."""
        if self.params is not None and self._state is not None:
            rewind(gen, self._state, emitted)
        self.params = self._state = None

    def match(self) -> None:
        """The step's input (ids: the root, then the chain found from the tokens so far) and the
        chain's count, on the device."""
        if self.fast:
            k = _kernels()
            c = self.hist.shape[0]
            k.match_orders[(-(-c // MATCH_BLOCK),)](self.hist, self.length, self.best, c, BLOCK=MATCH_BLOCK)
            k.chain_ids[(1,)](self.hist, self.length, self.best, self.ids, self.count, c, Q=self.q, QP=self._qp)
            return
        chain, count = device_match(self.hist, self.length, self.q)  # [q], [1]
        self.ids.copy_(torch.cat([self.hist[self.length - 1], chain]))
        self.count.copy_(count)

    def verdict(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [q + 1, V] of the step's forward -> [n, count, y...] (n the chain tokens accepted, y
        the target's token after each row); the history advanced by the n + 1 emitted tokens."""
        self.noted = None
        if self.params is None:
            y = logits.argmax(-1)  # [q + 1]
            if self.ref is not None:
                y = self._reference(logits, y)
        else:  # row r stands for the run's position drawn + r
            u = self.uniforms[(self.drawn + self.rows).clamp_(max=self.uniforms.shape[0] - 1)]  # [q + 1]
            y = sample_rows(logits, self.params, u)
        if self.fast:
            _kernels().chain_verdict[(1,)](y, self.ids, self.count, self.hist, self.length, self.packed,
                                           Q=self.q, QP=self._qp)
            packed = self.packed
        else:
            n = accepted(y, self.ids[1:], self.count)  # [1]
            self.hist.index_copy_(0, self.length + self.rows, y)  # y[:n + 1] count; the rest is overwritten later
            self.length.add_(n + 1)
            packed = torch.cat([n, self.count, y])
        if self.params is not None or self.ref is not None:
            self.drawn.add_(packed[:1] + 1)
        return packed

    def _reference(self, logits: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
        """Benchmarks (verify.Reference.pick, on the device): each row's token where the reference
        has one is the reference's; `noted` keeps each row's own token and the two logits for the
        host, which records the rows emitted where they differ. -> y [q + 1]."""
        at = (self.drawn + self.rows + self.base).clamp_(max=self.ref_ids.shape[0] - 1)  # [q + 1]
        want = self.ref_ids[at]  # [q + 1], -1 past the reference's end
        vals = logits.gather(1, torch.stack([own, want.clamp(min=0)], 1)).float()  # [q + 1, 2]
        self.noted = torch.cat([own.unsqueeze(1).float(), vals], 1)  # [q + 1, 3]
        return torch.where(want >= 0, want, own)

    @property
    def _qp(self) -> int:
        return 1 << self.q.bit_length()  # a power of two above q

    def step_co(self, target: TargetSession) -> Generator[AtDeviceLength, object, tuple]:
        """Queues one step: the chain found from the tokens on the device, the forward over [root] +
        chain at the cache's length (length - 1), its verdict, and the emitted tokens appended.
        -> (host copy of [n, count, y...], of `noted` or None (both valid once `event` has passed), event)."""
        self.match()
        logits, _ = yield AtDeviceLength(self.ids, self.length - 1, target.cache, CAUSAL)
        packed = self.verdict(logits)
        noted = to_host(self.noted) if self.noted is not None else None
        return to_host(packed), noted, record_event(packed.device)


MATCH_BLOCK = 1024  # history tokens per program of match_orders


def _kernels():
    from specextend import _triton_lookup

    return _triton_lookup


def lookup_run_co(target: TargetSession, hist: DeviceHistory, out: Emitter, stats: RequestStats, t1: float,
                  gen: torch.Generator, steps: int, ctl: TreeController, lookup: RequestLookup,
                  speculative: bool = True, heard: Optional[Callable[[list[int]], None]] = None,
                  ref: Optional[Reference] = None) -> Generator[object, object, list[int]]:
    """A run of up to `steps` lookup steps queued ahead of the host from the request's last emitted
    token; each counts as a plain step to the policy (its probe schedule) with the chain tokens it
    accepted, and its cost: the time between two reads of the run (where it spans one step: below) is what a
    step costs with the host's work hidden, the device's step, which the policy records as the
    forward of the path's rows with no host work beyond it (so it prices steps without a tree at
    what a run makes them cost, not at a host step's). Yields each step's forward (AtDeviceLength)
    and StepEvent; returns the tokens emitted.
    `heard(tokens)`: each step's tokens once read (an overlapping draft's tells: draft_link.RunTells).
    `ref` (benchmarks, greedy): the reference tokens emitted where the target's differ (verify.Reference).
    At its end the cache's length and the host index hold exactly the emitted tokens (the request's
    end may leave a queued step unread: nothing follows it)."""
    hist.sync(lookup.index)
    hist.begin(out.params, gen, min(steps * (hist.q + 1), out.params.max_new_tokens - stats.num_generated), ref,
               stats.num_generated)
    inflight: deque = deque()
    queued, emitted = 0, []
    t_step, t_read = time.perf_counter(), None
    fresh = waited = False  # a forward queued since the last read; the last read waited for the device
    while out.finish is None:
        room = stats.num_generated + len(inflight) < out.params.max_new_tokens  # (each step emits one at least)
        if room and queued < steps and len(inflight) < RUN_DEPTH:
            inflight.append((yield from hist.step_co(target)))
            queued += 1
            fresh = True
            continue
        if not inflight:
            break
        host, noted, event = inflight.popleft()
        waited_before, waited = waited, event is not None and not event.query()  # (still running: a wait)
        if event is not None:
            event.synchronize()  # this step's verdict, not the step queued after it
        t_prev, t_read = t_read, time.perf_counter()
        # the interval is one step's only where both reads waited for the device (a read of a step
        # done while the host was late is at once); on the CPU, where a forward runs as it is queued,
        # where one was queued between the reads (the run's last read follows the one before at once)
        timed = t_prev is not None and ((waited and waited_before) if event is not None else fresh)
        fresh = False
        n, count = int(host[0]), int(host[1])
        at = stats.num_generated
        ev = out.emit(host[2:3 + n].tolist())
        for r in range(len(ev.token_ids) if noted is not None else 0):  # (the reference's overrides)
            if int(noted[r, 0]) != ev.token_ids[r]:
                ref.note(float(noted[r, 1]), float(noted[r, 2]), at + r, int(noted[r, 0]), target.model.dtype)
        emitted += ev.token_ids
        lookup.commit_ahead(ev.token_ids)
        if heard is not None:
            heard(ev.token_ids)
        stats.lookup_steps += count > 0
        stats.lookup_nodes += count
        stats.lookup_accepted += n
        stats.plain_steps += speculative
        stats.ahead_steps += 1
        if timed:  # (the device's step: its forward, no host work beyond it)
            ctl.record_forward(hist.q + 1, t_read - t_prev)
        ctl.record_plain(step_s=t_read - t_prev if timed else None, lookup=n)
        stats.step_read("lookup" if count else "plain", len(ev.token_ids), t_step, t_read, t1)
        yield ev
        t_step = time.perf_counter()
    target.cache.length = lookup.index.length - 1  # the host's copy, in step again
    hist.synced = lookup.index.length
    hist.end(gen, len(emitted))
    return emitted


def in_step(target: TargetSession, lookup: RequestLookup) -> bool:
    """Whether the host index holds the cache's tokens and the root (what a run's history starts
    from); never seen otherwise, but a run would then decode from the wrong tokens: the host's way."""
    if lookup.index.length == target.cache.length + 1:
        return True
    log.warning("lookup index (%d tokens) and cache (%d) out of step: no lookup run", lookup.index.length,
                target.cache.length)
    return False


def run_ahead(target: TargetSession, last: int, out: Emitter, stats: RequestStats, t1: float, gen: torch.Generator,
              ctl: TreeController, lookup: Optional[RequestLookup], speculative: bool, load: Optional["Load"],
              forced: Optional[bool] = None, heard: Optional[Callable[[list[int]], None]] = None,
              ref: Optional[Reference] = None, governed: bool = False,
              chains: bool = True) -> Optional[Generator[object, object, list[int]]]:
    """The run a step without a tree begins now from the last emitted token `last`, if any: a lookup
    run where `runs_ahead`, else a run of plain steps ahead where plain_ahead.run_length allows one
    (none: the step goes the host's way, plain_step.plain_step_co). `heard`: told the run's tokens
    as the host reads them (an overlapping draft's tells, draft_link.RunTells). `ref` (benchmarks): a
    greedy request's reference tokens, which lookup runs take (runs of plain steps do not: None).
    `governed`: a request that the batch's governor may hold (governor.py): its run of plain steps ends
    when the hold changes. `chains` False (held to plain steps): a run of plain steps whatever the
    lookup would find, as mode `ar`'s (the lookup still hears the run's tokens)."""
    if chains and runs_ahead(target.model, out.params, lookup, load, forced) and in_step(target, lookup) and (
            ref is None or out.params.greedy):
        k = run_room(ctl, out, stats, speculative, LOOKUP_RUN_STEPS)
        if not k:
            return None
        if target.history is None:
            target.history = DeviceHistory(target.cache.capacity, lookup.max_tokens, target.model.device)
        return lookup_run_co(target, target.history, out, stats, t1, gen, k, ctl, lookup, speculative, heard, ref)
    if ref is not None:
        return None
    k = run_length(ctl, out, stats, lookup if chains else None, speculative)
    return (plain_run_co(target, last, out, stats, t1, gen, k, ctl, lookup, speculative, load, heard, governed, chains)
            if k else None)


def runs_ahead(model, params, lookup: Optional[RequestLookup], load: Optional["Load"], forced: Optional[bool]) -> bool:
    """Whether this step may begin a lookup run: a request with a context lookup, alone on its
    forwards, where the forward keeps the length on the device, greedy or sampled by fused_sample's
    kernels (`forced` True or False overrides: tests, A/Bs; forced runs take any request). A run
    samples every row of its path: with top-p (PyTorch's sort) that cost ~1.1 ms a step and sampled
    lookup ran at 0.94x `ar` with runs against 1.24x without (H200, 2026-11-30, 16K, top_p 0.95),
    so those take the host's steps; with the kernels (temperature alone) runs 1.06x, the host's
    steps 0.96x (H200, 2026-11-30, temperature 0.8; docs/architecture.md, "Lookup runs ahead")."""
    if (lookup is None or (load is not None and load.sessions > 1)
            or tuple(lookup.index.ns) != NGRAMS):  # (the kernels' orders)
        return False
    if forced is not None:
        return forced
    return ((params.greedy or fused_sample.runs_cheaply(params)) and model.graphs is not None
            and model.graphs.takes_device_length(lookup.max_tokens + 1))
