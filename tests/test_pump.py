"""StepPump: the engine steps ahead of the streaming side, sessions interleave on the one engine
thread, a lagging consumer gets steps coalesced, run-ahead is bounded, errors and stops propagate."""

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from specextend.engine import RequestStats, StepEvent
from specextend.serving.pump import StepPump


def engine_steps(name, n, log, closed=None, fail_at=None):
    stats = RequestStats()
    try:
        for i in range(n):
            log.append((name, i))
            if i == fail_at:
                raise ValueError("injected engine error")
            yield StepEvent([i], "length" if i == n - 1 else None, stats)
    finally:
        if closed is not None:
            closed.append(name)


async def drain(pump):
    out = []
    while True:
        for ev in await pump.events():
            if ev is None:
                return out
            out.append(ev.token_ids[0])
            if ev.finish_reason:
                return out


def test_steps_run_ahead_are_coalesced_and_sessions_interleave():
    async def main():
        ex, log = ThreadPoolExecutor(1), []
        loop = asyncio.get_running_loop()
        gate = threading.Event()
        ex.submit(gate.wait)  # both sessions' first steps queue behind this
        a = StepPump(engine_steps("a", 6, log), ex, loop)
        b = StepPump(engine_steps("b", 6, log), ex, loop)
        gate.set()
        await asyncio.sleep(0.2)  # nobody consumes: the engine keeps stepping
        assert len(log) == 12
        assert log[:4] == [("a", 0), ("b", 0), ("a", 1), ("b", 1)]  # one step each, in turn
        first = await a.events()
        assert [e.token_ids[0] for e in first] == list(range(6))  # all ready steps in one chunk
        assert await drain(b) == list(range(6))

    asyncio.run(main())


def test_run_ahead_is_bounded_and_resumes():
    async def main():
        ex, log = ThreadPoolExecutor(1), []
        pump = StepPump(engine_steps("a", 50, log), ex, asyncio.get_running_loop(), max_ahead=4)
        await asyncio.sleep(0.2)
        assert len(log) == 4  # paused with 4 undelivered
        assert await drain(pump) == list(range(50))

    asyncio.run(main())


def test_engine_errors_reach_the_consumer_and_stop_closes_the_engine():
    async def main():
        ex, log, closed = ThreadPoolExecutor(1), [], []
        loop = asyncio.get_running_loop()
        bad = StepPump(engine_steps("bad", 9, log, closed, fail_at=2), ex, loop)
        with pytest.raises(ValueError, match="injected"):
            await drain(bad)
        slow = StepPump(engine_steps("slow", 10_000, log, closed), ex, loop, max_ahead=10_000)
        await slow.events()
        slow.stop()
        await asyncio.sleep(0.1)
        n = len(log)
        time.sleep(0.1)
        assert len(log) == n and "slow" in closed  # no step after stop; the engine's finally ran

    asyncio.run(main())
