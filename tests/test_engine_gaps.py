"""benchmarks/engine_gaps.py's pure parts: the target device's idle gaps in a chrome trace, and the
idle time charged to the Python functions running on the engine's thread meanwhile."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))  # as when the script runs: it imports trace_gaps beside it
spec = importlib.util.spec_from_file_location("engine_gaps", BENCHMARKS / "engine_gaps.py")
engine_gaps = importlib.util.module_from_spec(spec)
spec.loader.exec_module(engine_gaps)


def kernel(ts, dur, device=0):
    return dict(ph="X", cat="kernel", ts=ts, dur=dur, name="k", args={"device": device})


def py(ts, dur, name, pid, parent=None, tid=1):
    return dict(ph="X", cat="python_function", ts=ts, dur=dur, name=name, tid=tid,
                args={"Python id": pid, "Python parent id": parent})


def test_idle_gaps_are_the_holes_between_the_target_devices_kernels():
    events = [kernel(0, 10), kernel(5, 10), kernel(30, 10), kernel(42, 3), kernel(100, 5),
              kernel(12, 50, device=1)]  # the draft's device: not the target's
    span, busy, gaps = engine_gaps.idle_gaps(events, t_from=0)
    assert span == 105 and busy == 15 + 10 + 3 + 5
    assert gaps == [(15, 30), (45, 100)]  # the 2 us hole (40-42) is under the 5 us threshold
    _, _, late = engine_gaps.idle_gaps(events, t_from=30)  # the decode steps only
    assert late == [(45, 100)]


def test_idle_time_is_charged_to_the_functions_of_the_engine_thread_running_then():
    gaps = [(15, 30), (45, 100)]
    # the engine's thread (root 1) and another thread (root 10) with the same chrome tid, as a GPU
    # host's trace had them
    events = [py(0, 130, "bench.py(9): main", 1), py(0, 120, "engine.py(1): _session", 2, 1),
              py(20, 5, "lookup.py(2): chain", 3, 2), py(50, 60, "sampling.py(3): next_token", 4, 2),
              py(0, 200, "threading.py(5): _bootstrap", 10), py(0, 200, "jobs.py(6): _next", 11, 10)]
    ids = engine_gaps.thread_of(events)
    assert ids == {1, 2, 3, 4}
    by = engine_gaps.charge(events, gaps, ids)
    assert by["engine.py(1): _session"] == pytest.approx(15 + 55)  # inclusive: a caller gets its callees' idle
    assert by["bench.py(9): main"] == pytest.approx(15 + 55)
    assert by["lookup.py(2): chain"] == pytest.approx(5)
    assert by["sampling.py(3): next_token"] == pytest.approx(50)
    assert "threading.py(5): _bootstrap" not in by and "jobs.py(6): _next" not in by
    own = engine_gaps.charge(events, gaps, ids, exclusive=True)  # where the host itself was
    assert own["engine.py(1): _session"] == pytest.approx(70 - 5 - 50)
    assert "bench.py(9): main" not in own  # all of its idle is its callee's
    assert own["sampling.py(3): next_token"] == pytest.approx(50)
    assert engine_gaps.thread_of([py(0, 1, "x", 1)]) == set()  # no session: nothing charged


def test_trace_gaps_shares_the_sweep():
    """trace_gaps.gaps (one step's timeline) sweeps the same way: every device's events, each gap
    named by the host op around the launch of the kernel that ends it ('?' where none is traced)."""
    import trace_gaps

    events = [kernel(0, 10), kernel(5, 10), kernel(30, 10), kernel(42, 3), kernel(100, 5)]
    span, busy, gaps = trace_gaps.gaps(events)
    assert (span, busy) == (105, 33) and gaps == [(15, "?"), (55, "?")]
