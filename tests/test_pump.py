"""SessionPump over the Batcher: the engine steps ahead of the streaming side, sessions' steps
share rounds (one batched forward each), a lagging consumer gets steps coalesced, run-ahead is
bounded, errors and stops propagate."""

import asyncio
import time

import pytest

from specextend.engine import StepEvent
from specextend.stats import RequestStats
from specextend.models.batch import ForwardCall
from specextend.scheduler import Batcher
from specextend.serving.pump import EngineThread, SessionPump


def engine_steps(name, n, log, closed=None, fail_at=None):
    """A fake session: one forward, then one event, per step."""
    stats = RequestStats()
    try:
        for i in range(n):
            yield ForwardCall(None, None, None, "causal")
            log.append((name, i))
            if i == fail_at:
                raise ValueError("injected engine error")
            yield StepEvent([i], "length" if i == n - 1 else None, stats)
    finally:
        if closed is not None:
            closed.append(name)


def fake_forward(batches):
    def forward(model, calls):
        batches.append(len(calls))
        return [(None, None)] * len(calls)
    return forward


async def drain(pump):
    out = []
    while True:
        for ev in await pump.events():
            if ev is None:
                return out
            out.append(ev.token_ids[0])
            if ev.finish_reason:
                return out


def engine(batches, max_batch=8):
    return EngineThread(Batcher(None, max_batch, forward=fake_forward(batches)))


def slow_engine(batches, seconds):
    """An engine whose steps take a while: a consumer that holds a batch open sees them arrive."""
    def slow_forward(model, calls):
        time.sleep(seconds)
        return fake_forward(batches)(model, calls)

    return EngineThread(Batcher(None, 8, forward=slow_forward))


def test_steps_run_ahead_are_coalesced_and_sessions_share_rounds():
    async def main():
        log, batches = [], []
        loop = asyncio.get_running_loop()
        batcher = Batcher(None, 8, forward=fake_forward(batches))
        a = SessionPump(batcher, engine_steps("a", 6, log), loop)
        b = SessionPump(batcher, engine_steps("b", 6, log), loop)
        th = EngineThread(batcher)  # both sessions are there before the first round
        await asyncio.sleep(0.3)  # nobody consumes: the engine keeps stepping
        assert len(log) == 12
        assert log[:4] == [("a", 0), ("b", 0), ("a", 1), ("b", 1)]  # one step each, in turn
        assert batches[:6] == [2] * 6  # each round's two forwards ran as one
        first = await a.events()
        assert [e.token_ids[0] for e in first[:6]] == list(range(6))  # all ready steps in one chunk
        assert first[6:] == [None]  # and the session's end
        assert await drain(b) == list(range(6))
        th.shutdown()

    asyncio.run(main())


def test_batches_are_capped_at_max_batch():
    async def main():
        log, batches = [], []
        th = engine(batches, max_batch=3)
        pumps = [SessionPump(th.batcher, engine_steps(f"s{i}", 4, log), asyncio.get_running_loop())
                 for i in range(7)]
        assert [await drain(p) for p in pumps] == [list(range(4))] * 7
        assert max(batches) == 3 and sum(batches) == 28
        th.shutdown()

    asyncio.run(main())


def test_run_ahead_is_bounded_and_resumes():
    async def main():
        log, batches = [], []
        th = engine(batches)
        pump = SessionPump(th.batcher, engine_steps("a", 50, log), asyncio.get_running_loop(), max_ahead=4)
        await asyncio.sleep(0.2)
        assert len(log) == 4  # paused with 4 undelivered
        assert await drain(pump) == list(range(50))
        th.shutdown()

    asyncio.run(main())


def test_engine_errors_reach_the_consumer_and_stop_closes_the_session():
    async def main():
        log, closed, batches = [], [], []
        loop = asyncio.get_running_loop()
        th = engine(batches)
        bad = SessionPump(th.batcher, engine_steps("bad", 9, log, closed, fail_at=2), loop)
        with pytest.raises(ValueError, match="injected"):
            await drain(bad)
        slow = SessionPump(th.batcher, engine_steps("slow", 10_000, log, closed), loop, max_ahead=10_000)
        await slow.events()
        slow.stop()
        await asyncio.sleep(0.1)
        n = len(log)
        time.sleep(0.1)
        assert len(log) == n and "slow" in closed  # no step after stop; the session's finally ran
        th.shutdown()

    asyncio.run(main())


def test_a_held_batch_takes_later_steps_and_ends_at_a_finish():
    """The replica's stream interval (docs/architecture.md, "Serving surface"): a consumer that holds
    a batch open gets the steps that arrive meanwhile in it, in order; a finish closes the batch
    at once instead of waiting out the deadline."""
    async def main():
        log, batches = [], []
        loop = asyncio.get_running_loop()
        th = slow_engine(batches, 0.01)
        pump = SessionPump(th.batcher, engine_steps("a", 12, log), loop, max_ahead=100)
        got = []
        while not any(e is not None and e.finish_reason for e in got):
            got += await asyncio.wait_for(pump.events(until=loop.time() + 3600), 60)  # not an hour: the finish
        assert [e.token_ids[0] for e in got if e is not None] == list(range(12))
        th.shutdown()

    asyncio.run(main())


def test_a_hold_ends_at_its_deadline_and_when_run_ahead_is_full():
    async def main():
        log, batches = [], []
        loop = asyncio.get_running_loop()
        th = engine(batches)
        pump = SessionPump(th.batcher, engine_steps("a", 10_000, log), loop, max_ahead=5)
        full = await asyncio.wait_for(pump.events(until=loop.time() + 3600), 60)  # paused at 5: no hour's wait
        assert [e.token_ids[0] for e in full] == list(range(len(full))) and 1 <= len(full) <= 5
        held = await asyncio.wait_for(pump.events(until=loop.time() + 0.05), 60)
        assert held[0].token_ids[0] == len(full) and not held[-1].finish_reason
        pump.stop()
        th.shutdown()

    asyncio.run(main())
