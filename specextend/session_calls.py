"""What a session coroutine (Engine.session) and its driver say to each other, and the driver of
one session (docs/architecture.md, "Batched steps"): the session yields a `ForwardCall` (a target
forward over its own KV cache, models/batch.py), a `DraftCall` (a call to the draft backend) or a
step event; its `Load` hears what the driver knows of the forwards that carried its calls, and
`metered` times them for its adaptive policy. `drive_alone` runs one session in place; the batched
driver is scheduler.Batcher.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Generator, Iterator, Optional

from specextend.kv_pool import KVPool
from specextend.models.batch import ForwardCall
from specextend.models.decoder import Decoder
from specextend.timing import Span, Stopwatch, seconds_of


@dataclass
class DraftCall:
    """A call to the draft backend: its value (or exception) goes back into the session. Either
    `fn`, to be called, or `future`, a call already under way (the draft session's opening, its
    prefill; or another session's prefill of the same prompt chunks, target.prefill_co): rounds
    never wait for it, and it holds no thread of the batcher's pool."""

    fn: Optional[Callable[[], Any]] = None
    future: Optional[Future] = None

    def result(self) -> Any:
        return self.future.result() if self.future is not None else self.fn()


@dataclass
class Load:
    """What a driver tells a session about the target forward that carried its last call
    (docs/architecture.md, "Adaptive speculation"). Alone, nothing: the session times its own."""

    sessions: int = 1  # calls that shared the forward
    rows: int = 0  # rows of the forward, every call's
    span: Optional[Span] = None  # its duration (timing.Span); None once taken, or when the driver does not time it
    others_wait_s: float = 0.0  # rounds' waits for other sessions' draft steps since `wall` last took them
    shared_s: float = 0.0  # of its last draft wait, the part that the round's other askers' steps shared
    kv_pool: Optional[KVPool] = None  # the driver's pool of target caches (kv_pool.py; None: its own)
    held: Optional[str] = None  # the driver's governor holds the batch to "plain" steps or to "trees" now (governor.py)
    opening: Optional[Future] = None  # its draft's open, begun and not joined (the session steps plainly till then)
    max_tokens: Optional[int] = None  # set by the session: the most tokens it emits (its request's); the
    # driver's governor reads how long a batch will last from it (scheduler.Batcher.life)
    open_s: float = 0.0  # set by the session after its prefill: the expected seconds of its draft's open while
    # deferred (0: open, or none), what a trees window would cost it (Batcher.opens_s; DraftLink.open_prior)

    def take_shared(self) -> float:
        """Takes `shared_s` (Batcher._charge; `wall` drops it): a draft step's price to the policy is
        its share of the round's draft wait, as a forward's fixed cost is shared."""
        out, self.shared_s = self.shared_s, 0.0
        return out

    def wall(self, t0: float) -> float:
        """A step's wall time since perf_counter `t0`, less the waits for other sessions' draft
        steps that rounds made it share: what its own choice cost (docs/architecture.md, "Adaptive
        speculation", under load). Takes those waits."""
        out, self.others_wait_s, self.shared_s = time.perf_counter() - t0 - self.others_wait_s, 0.0, 0.0
        return max(out, 0.0)

    def forward(self, rows: int, span: Span) -> tuple[int, Span]:
        """The forward just run for this session: (rows, span) of the whole shared forward when
        the driver timed it, else the session's own `rows` and `span`."""
        if self.span is None:
            return rows, span
        out, self.span = (self.rows, self.span), None
        return out


class OwnShare:
    """A session's share of the forwards that carried its calls (`add` each): a shared forward's
    time split by rows, so that a prompt's prefill beside other sessions' chunks and steps is priced
    by its own rows, not by the wall time that the others' work stretched (DraftLink.open_prior)."""

    __slots__ = ("_parts",)

    def __init__(self) -> None:
        self._parts: list[tuple[int, int, Span]] = []  # (own rows, the forward's rows, its span)

    def add(self, own: int, rows: int, span: Span) -> None:
        self._parts.append((own, max(rows, own, 1), span))

    def seconds(self) -> float:
        """The share's seconds (on CUDA: read once the forwards are done, e.g. after the logits)."""
        return sum(seconds_of(span) * own / rows for own, rows, span in self._parts)


def metered(co: Generator, load: Load, record: Callable[[int, Span], None],
            share: Optional[OwnShare] = None) -> Generator:
    """Runs a forward coroutine (target.py's `*_co`), timing each of its forwards:
    record(rows, span), those of the whole forward when the driver shared and timed it; `share`
    adds the session's part of each. On CUDA the span is the device's time between events around
    the forward (timing.py). Its other calls (a prefill waiting for another session's: DraftCall)
    pass through untimed."""
    try:
        call = next(co)
        while True:
            if isinstance(call, DraftCall):
                call = co.send((yield call))
                continue
            watch = Stopwatch(call.ids)
            result = yield call
            own = call.ids.shape[0]
            rows, span = load.forward(own, watch.stop())
            record(rows, span)
            if share is not None:
                share.add(own, rows, span)
            call = co.send(result)
    except StopIteration as stop:
        return stop.value
    finally:
        co.close()  # (closed with its session: its own `finally`s run now, e.g. a prefill's promise)


def drive_alone(co: Generator, model: Decoder) -> Iterator[Any]:
    """Runs one session in place: its forwards one at a time, its draft calls inline. Yields its
    events; closing this iterator closes the session (its `finally` frees the draft session)."""
    send, exc = None, None
    try:
        while True:
            try:
                item = co.throw(exc) if exc is not None else co.send(send)
            except StopIteration:
                return
            send, exc = None, None
            if isinstance(item, ForwardCall):
                send = item.run(model)
            elif isinstance(item, DraftCall):
                try:
                    send = item.result()
                except Exception as e:  # noqa: BLE001 - thrown into the session, which decides
                    exc = e
            else:
                yield item
    finally:
        co.close()
