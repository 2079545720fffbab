"""Several draft sessions' steps driven together (docs/architecture.md, "Draft side").

Each session's step is a coroutine (DraftSession.step_co) that yields the forwards it needs: its
accepted tokens' forward, then one forward per tree level. `drive_batch` advances every step to its
next forward and runs those forwards as one `models/batch.forward_batch` (the draft's weights read
once for all of them; each call attends over its own session's cache), round after round, until
every step has its tree. Steps that need fewer forwards (a ready tree from the overlap pool needs
none, a shallower bound fewer levels) leave the rounds early.

A failure is its own step's: an exception raised inside one coroutine ends that step only; a
batched forward that raises is run again call by call (each call only stages K/V in its own cache,
so a rerun overwrites the same slots), and the calls that still fail fail their own steps.
A step may yield its whole tree expansion as one request (draft/tree_graph.TreeCall: one CUDA
graph for every level). By default each such expansion runs whole, one after the other, while the
steps' other forwards (their accepted tokens') still batch: on an H200 (2026-12-01, 8 sessions of
the 68M draft beside the 8B target at 4K, benchmarks/batching.py) that drafted faster than batching
the sessions' levels (1279 against 982-994 decode tokens/s with adaptive trees, 1483 against
1095-1298 with fixed ones): a launch-bound small model gains little from reading its weights once
for eight sessions, and a level at a time puts the host back between levels. `batch_levels=True`
(with at least models/batch.GRAPHS_BATCH_MIN steps) batches the levels like any forward
(`flatten`), the path for a draft large enough that its weights, not its launches, set the pace.

`drive_each` is the slow twin: the steps one after another, each forward alone (run_alone).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Generator, Union

from specextend.draft.tree_graph import key_of
from specextend.models.batch import GRAPHS_BATCH_MIN, ForwardCall, Result, forward_batch, run_alone
from specextend.models.decoder import Decoder

log = logging.getLogger(__name__)

Step = Generator[ForwardCall, Result, Any]
Outcome = Union[Any, BaseException]  # what a step returned, or the exception that ended it


@dataclass
class BatchCounts:
    """The forwards a batch of steps ran: `forwards` batched forwards carrying `calls` calls."""

    forwards: int = 0
    calls: int = 0
    per_forward: list[int] = field(default_factory=list)  # calls of each forward, in order


def drive_each(model: Decoder, steps: list[Step]) -> list[Outcome]:
    """The slow twin: each step alone, one after another."""
    out: list[Outcome] = []
    for co in steps:
        try:
            out.append(run_alone(co, model))
        except Exception as exc:  # noqa: BLE001 - a step's failure is its result
            out.append(exc)
    return out


def drive_batch(model: Decoder, steps: list[Step], counts: BatchCounts | None = None,
                batch_levels: bool = False, batch_trees: bool = False) -> list[Outcome]:
    """Runs the steps' forwards in batched rounds; returns each step's outcome, in order.
    `batch_levels`: whole tree expansions are split into levels batched across the steps (from
    GRAPHS_BATCH_MIN steps on); otherwise each runs whole: with `batch_trees`, those of one shape
    that meet in a round as one graph (draft/tree_batch.py), else one after another."""
    out: list[Outcome] = [None] * len(steps)
    if batch_levels and len(steps) >= GRAPHS_BATCH_MIN:
        steps = [flatten(co) for co in steps]
    waiting: dict[int, ForwardCall] = {}  # step index -> the forward it waits on

    def advance(i: int, result: Result | None) -> None:
        co = steps[i]
        try:
            waiting[i] = next(co) if result is None else co.send(result)
        except StopIteration as stop:
            out[i] = stop.value
        except Exception as exc:  # noqa: BLE001 - ends this step only
            out[i] = exc

    for i in range(len(steps)):
        advance(i, None)
    while waiting:
        order = list(waiting)
        calls = [waiting.pop(i) for i in order]
        results = _forward(model, calls, batch_trees)
        if counts is not None:
            counts.forwards += 1
            counts.calls += len(calls)
            counts.per_forward.append(len(calls))
        for i, result in zip(order, results):
            if isinstance(result, BaseException):
                steps[i].close()
                out[i] = result
            else:
                advance(i, result)
    return out


def flatten(co: Step) -> Step:
    """The step with each whole-expansion request (TreeCall) replaced by its per-level forwards."""
    try:
        request = next(co)
        while True:
            if isinstance(request, ForwardCall):
                result = yield request
            else:
                result = yield from request.levels()
            request = co.send(result)
    except StopIteration as stop:
        return stop.value


def _expansions(model: Decoder, calls: list, batch_trees: bool) -> list:
    """Whole tree expansions' pools (or exceptions): with batch_trees, the calls of one shape (two
    or more, as many as a batched forward takes) as one graph (TreeBatches.expand), the others, and
    any whose batch failed, one by one."""
    out: list = [None] * len(calls)
    if batch_trees and len(calls) > 1:
        groups: dict = {}
        for i, c in enumerate(calls):
            groups.setdefault((id(c.graphs), key_of(c)), []).append(i)
        for (_, key), idx in groups.items():
            batches, k = calls[idx[0]].graphs.batches, key.topk
            while len(idx) > 1 and batches.takes(2, k):
                n = len(idx)
                while not batches.takes(n, k):
                    n -= 1
                part, idx = idx[:n], idx[n:]
                try:
                    for i, pool in zip(part, batches.expand([calls[i] for i in part], key)):
                        out[i] = pool
                except Exception:  # noqa: BLE001 - each of them alone below (a rerun restages their keys)
                    log.exception("a batched tree expansion failed; its sessions expand alone")
    return [r if r is not None else _run_one(model, c) for r, c in zip(out, calls)]


def _run_one(model: Decoder, call) -> Union[Result, BaseException]:
    try:
        return call.run(model)
    except Exception as exc:  # noqa: BLE001 - this call's step fails
        return exc


def _forward(model: Decoder, calls: list, batch_trees: bool = False) -> list[Union[Result, BaseException]]:
    """The calls' results, or for each call that failed its exception. Whole expansions (TreeCall)
    run alone, or with `batch_trees` those of one shape together (`_expansions`); forwards are batched."""
    if any(not isinstance(c, ForwardCall) for c in calls):
        results: list = [None] * len(calls)
        fwd = [i for i, c in enumerate(calls) if isinstance(c, ForwardCall)]
        trees = [i for i, c in enumerate(calls) if not isinstance(c, ForwardCall)]
        for i, r in zip(trees, _expansions(model, [calls[i] for i in trees], batch_trees)):
            results[i] = r
        for i, r in zip(fwd, _forward(model, [calls[i] for i in fwd]) if fwd else []):
            results[i] = r
        return results
    try:
        return forward_batch(model, calls)
    except Exception as exc:  # noqa: BLE001 - isolate the failing call: rerun each alone
        if len(calls) == 1:
            return [exc]
    return [_run_one(model, call) for call in calls]
