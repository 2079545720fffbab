"""Work a request should never meet: CUDA-graph plans built and Triton kernel specializations
compiled (or loaded from the disk cache) after a process's warm-up, and the interpreter's full
garbage collections (docs/architecture.md, "Execution plans"). Each one stalls every request of the
process for milliseconds (a load, a collection) to seconds (a compile, a capture of every layer), so
a serving process marks the end of its warm-up (`mark_ready`) and from then on counts them, logs
each with what it was (a graph key, a kernel's specialization) and calls `on_late` (the replica's
/metrics). Before `mark_ready` nothing is logged: warm-up is where this work belongs.

The end of warm-up also collects and then freezes what the process holds by then (`gc.freeze`:
the modules, the models, the compiled kernels and plans move out of the collector's generations),
so that a full collection during serving scans only what serving allocated; each full collection
after it is timed and counted as late work of kind "gc" (a pause of every thread of the process).

Process-wide: a process serves one target or one draft, and every graph plan and kernel of it
counts. Twin-free: it only observes.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from typing import Callable, Optional

log = logging.getLogger(__name__)

MARK = "after warm-up, on a request's path"  # in every late line (benchmarks find them in the logs)
KINDS = ("capture", "kernel", "gc")  # a graph plan built (StepGraphs, Graphed), a Triton specialization,
# a full garbage collection


class _State:
    def __init__(self) -> None:
        self.lock = threading.RLock()  # (a collection may start while it is held: the gc callback)
        self.ready = False
        self.counts = {k: [0, 0] for k in KINDS}  # kind -> [during warm-up, after it]
        self.on_late: Optional[Callable[[str], None]] = None
        self.gc_started = 0.0  # perf_counter of the collection under way


_state = _State()


def record(kind: str, what: object) -> None:
    """One unit of `kind` work (`what` describes it for the log)."""
    with _state.lock:
        late = _state.ready
        _state.counts[kind][late] += 1
        hook = _state.on_late
    if late:
        log.warning("%s %s: %s", kind, MARK, what)
        if hook is not None:
            hook(kind)


def mark_ready(on_late: Optional[Callable[[str], None]] = None) -> None:
    """The process's warm-up is over: later work is late. Also starts counting Triton's compiles and
    timing full collections, after collecting and freezing what warm-up left."""
    install_triton_hook()
    gc.collect()
    gc.freeze()
    if _gc_timed not in gc.callbacks:
        gc.callbacks.append(_gc_timed)
    with _state.lock:
        _state.ready = True
        _state.on_late = on_late


def counts(late: bool = True) -> dict[str, int]:
    """{kind: units} after warm-up (late) or during it."""
    with _state.lock:
        return {k: v[int(late)] for k, v in _state.counts.items()}


def reset() -> None:
    """Back to warm-up, counts zeroed (tests; a process re-warming)."""
    with _state.lock:
        _state.ready = False
        _state.on_late = None
        _state.counts = {k: [0, 0] for k in KINDS}
    if _gc_timed in gc.callbacks:
        gc.callbacks.remove(_gc_timed)
    gc.unfreeze()


def _gc_timed(phase: str, info: dict) -> None:
    """gc.callbacks: a full (generation 2) collection after warm-up is late work, with its pause."""
    if phase == "start":
        _state.gc_started = time.perf_counter()
    elif info.get("generation") == 2 and _state.ready:
        ms = 1e3 * (time.perf_counter() - _state.gc_started)
        record("gc", f"a full collection: {ms:.1f} ms, {info.get('collected', 0)} objects freed")


def _triton_compiled(*, repr: str, **_) -> None:  # noqa: A002 - Triton's keyword
    record("kernel", repr)


def install_triton_hook() -> bool:
    """Counts every kernel specialization Triton builds in this process (knobs.runtime's
    post-compile hook: an in-memory cache miss, compiled or loaded from the disk cache), unless
    another hook is installed; False where Triton is absent or that hook is another's."""
    try:
        from triton import knobs
    except ImportError:
        return False
    current = knobs.runtime.jit_post_compile_hook
    if current is None:
        knobs.runtime.jit_post_compile_hook = _triton_compiled
        return True
    return current is _triton_compiled
