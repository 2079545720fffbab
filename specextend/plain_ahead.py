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

import time
from typing import Generator, Optional

import torch

from specextend.attention.backends import CAUSAL
from specextend.emit import Emitter, StepEvent
from specextend.models.batch import ForwardCall
from specextend.models.transfer import record_event, to_device, to_host
from specextend.sampling import next_token_tensor
from specextend.stats import RequestStats
from specextend.target import TargetSession


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
                   gen: torch.Generator) -> Generator[object, object, None]:
    """Decodes from the emitted first token `first` to the request's end; yields each forward
    (ForwardCall, answered with its result) and each token's StepEvent. `t1`: when decoding began
    (perf_counter, for stats.decode_s); `gen`: the request's generator (sampling)."""
    dev = target.model.device
    queued: Optional[_Queued] = None  # the token whose forward is queued, not yet read
    ids = to_device([first], torch.long, dev)  # [1] the next forward's input
    t_step = time.perf_counter()
    while out.finish is None:
        # tokens emitted once `queued` is read: a forward past max_new_tokens would be wasted for sure
        if stats.num_generated + (queued is not None) < out.params.max_new_tokens:
            positions = to_device([target.cache.length], torch.long, dev)  # [1]
            logits, _ = yield ForwardCall(ids, positions, target.cache, CAUSAL)  # logits [1, V]
            target.cache.advance(1)
            ahead: Optional[_Queued] = _Queued(next_token_tensor(logits[0], out.params, gen))
            ids = ahead.device
        else:
            ahead = None
        if queued is None:  # (the first forward: nothing to read yet)
            queued = ahead
            continue
        token = queued.read()
        queued = ahead
        now = time.perf_counter()
        ev: StepEvent = out.emit([token])
        stats.clock("plain", t_step).add("step", now - t_step)  # from the last token read to this one
        stats.decode_s = time.perf_counter() - t1
        stats.step_done("plain", len(ev.token_ids), time.perf_counter() - t_step)
        yield ev
        t_step = time.perf_counter()
