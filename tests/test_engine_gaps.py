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


def py(ts, dur, name, tid=1):
    return dict(ph="X", cat="python_function", ts=ts, dur=dur, name=name, tid=tid)


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
    events = [py(0, 120, "engine.py(1): _session"), py(20, 5, "lookup.py(2): chain"),
              py(50, 60, "sampling.py(3): next_token"), py(0, 200, "other thread", tid=2)]
    by = engine_gaps.charge(events, gaps, tid=1)
    assert by["engine.py(1): _session"] == pytest.approx(15 + 55)  # inclusive: a caller gets its callees' idle
    assert by["lookup.py(2): chain"] == pytest.approx(5)
    assert by["sampling.py(3): next_token"] == pytest.approx(50)
    assert "other thread" not in by


def test_trace_gaps_shares_the_sweep():
    """trace_gaps.gaps (one step's timeline) sweeps the same way: every device's events, each gap
    named by the host op around the launch of the kernel that ends it ('?' where none is traced)."""
    import trace_gaps

    events = [kernel(0, 10), kernel(5, 10), kernel(30, 10), kernel(42, 3), kernel(100, 5)]
    span, busy, gaps = trace_gaps.gaps(events)
    assert (span, busy) == (105, 33) and gaps == [(15, "?"), (55, "?")]
