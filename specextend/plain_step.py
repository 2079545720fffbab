"""A decode step without a draft tree (docs/architecture.md, "Context lookup"): the target's next
token, or, where the request's context lookup has a chain worth its rows, that chain verified in one
forward (its accepted tokens, then the target's next one). Lossless as any verification."""

from __future__ import annotations

import time
from typing import Callable, Generator, Optional

from specextend.config import SamplingParams
from specextend.lookup import RequestLookup, graft
from specextend.models.batch import ForwardCall
from specextend.retrieval import launch_scoring
from specextend.sampling import next_token
from specextend.stats import RequestStats
from specextend.target import TargetSession
from specextend.verify import Reference, verify_tree


def _queued(scoring, queued: Optional[Callable[[], object]]) -> None:
    """Once the forward is queued: a pending selection's scoring, then the caller's hook (a tell)."""
    launch_scoring(scoring)
    if queued is not None:
        queued()


def plain_step_co(target: TargetSession, root: int, params: SamplingParams, gen, timed,
                  lookup: Optional[RequestLookup] = None, stats: Optional[RequestStats] = None,
                  queued: Optional[Callable[[], object]] = None,
                  reference: Optional[Reference] = None,
                  scoring=None, teach_host: bool = True, chains: bool = True) -> Generator[ForwardCall, object, list[int]]:
    """A step with no draft tree from `root`: [the next token]; with a context `lookup` that has a
    chain worth its rows, that chain verified instead (its accepted tokens, then the target's
    next one); the emitted tokens committed to the lookup. `timed` wraps each forward coroutine
    (the engine's: its cost line and a batching driver's load, session_calls.metered). `queued` is called
    once the forward is queued, before its logits are read: host work that then costs the step
    nothing (the engine's tell to an overlapping draft); a retrieval selection still to be scored
    (`scoring`: retrieval.launch_scoring) is launched just before it. `reference` (benchmarks):
    verify.Reference, with `stats` (its count of emitted tokens is the position). `teach_host`
    False: the step's wall time is not a plain step's (the draft's open runs beside it and holds
    the host), so the lookup's gate learns its chain but not its host work. `chains` False: no chain
    (the batch's governor holds the step plain), the emitted token still committed to the lookup."""
    t0 = time.perf_counter()
    chain = lookup.chain() if lookup is not None and chains else []
    if not chain:
        logits = yield from timed(target.decode_co(root))
        _queued(scoring, queued)
        out = [next_token(logits, params, gen)]
        if reference is not None:
            out = [reference.pick(logits.view(1, -1), 0, out[0], stats.num_generated)]
    else:
        tokens, parents, _ = graft((), (), chain)  # a path: [k], [k]
        logits = yield from timed(target.verify_co(root, tokens, parents, capture=False))
        _queued(scoring, queued)
        verdict = verify_tree(logits, tokens, parents, params, gen, reference=reference,
                              emitted=0 if stats is None else stats.num_generated)
        target.commit(verdict.accepted)
        stats.lookup_steps += 1
        stats.lookup_nodes += len(tokens)
        stats.lookup_accepted += verdict.accept_length
        out = verdict.tokens
    if lookup is not None:  # with its wall time: the gate prices a chain step's host work too
        lookup.commit(out, step_s=time.perf_counter() - t0 if teach_host else None)
        if stats is not None:
            stats.lookup_skipped = lookup.skipped
    return out
