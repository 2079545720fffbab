"""What a batcher's round tells its sessions' Loads (session_calls.Load; docs/architecture.md,
"Batched steps"): the round's wait for its draft steps, each asker charged its share and every
other session the whole wait as others' wait; a chunk-first round's hold on draft steps that ended
during its first forward; and the forwards that carried their calls (how many shared them, their
rows and time). The sessions are scheduler.Batcher's entries (their `load`, `future`, `call`)."""

from __future__ import annotations

import time

from specextend.timing import Span


def charge(sessions: list, askers: list, seconds: float) -> None:
    """The round waited `seconds` for `askers`' draft steps (batched on the draft worker, or one
    after another there): every other session's step shared that wait, which its own choice did
    not cause (Load.wall), and each asker is charged its share, the rest counted as others' wait
    (Load.take_shared)."""
    mine = {id(e) for e in askers}
    rest = seconds * (len(askers) - 1) / len(askers)
    for e in sessions:
        if e.load is not None and id(e) in mine:
            e.load.shared_s, e.load.others_wait_s = rest, e.load.others_wait_s + rest
        elif e.load is not None:
            e.load.others_wait_s += seconds


def charge_held(issued: list, t0: float) -> list:
    """A chunk-first round's draft steps that ended while its first forward (from perf_counter
    `t0`) was still being issued waited for that forward, not for the draft: that part of each
    one's wait is kept out of its draft's price and its step's wall, as others' waits are.
    Returns those sessions (the ones with a Load). A step's end is its future's `done_at`
    (Batcher._notify)."""
    now, out = time.perf_counter(), []
    for e in issued:
        done_at = getattr(e.future, "done_at", None)
        if done_at is not None and e.load is not None:
            held = max(0.0, now - max(done_at, t0))
            e.load.shared_s += held
            e.load.others_wait_s += held
            out.append(e)
    return out


def tell_loads(group: list, span: Span) -> None:
    """The sessions that listen (a Load) hear how many shared the forward, its rows and time."""
    loads = [e.load for e in group if e.load is not None]
    if loads:
        rows = sum(e.call.ids.shape[0] for e in group)
        for load in loads:
            load.sessions, load.rows, load.span = len(group), rows, span
