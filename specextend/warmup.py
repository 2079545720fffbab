"""Warm-up before traffic: every decode-time forward shape a request can take, run once, so that its
CUDA graphs are captured and its Triton kernels compiled before the first request instead of during
it (docs/architecture.md, "Execution plans"). On an H100 (2026-11-23) a request that met new shapes
stalled for up to 0.7 s a step: the real pair's first `specextend` request (16K) decoded at 23
tokens/s against 376 for `ar` on the same prompt in the same run.

The shapes of a step are fixed by the tree's rung (nodes, depth: the verify's rows), whether the
step refreshes retrieval (the verify captures the last layer) and how many tokens were accepted
(the draft's forward of them). Acceptance replay forces every accepted length 0..depth, cycled
against the refresh interval so that each length meets a refresh, for rungs covering the adaptive
ladder's shapes (`_covering`), plus one plain request, and the draft worker's own warm-up (its padded catch-up forward,
and overlapped drafting's shapes); the tests check that a normal request afterwards meets no shape
the warm-up did not. With overlapped drafting a ready tree has any size up to the step's bound (the
pool's best nodes, however few), and a missed step's tree only one level: those requests cannot
meet every size, so the target verifies synthetic trees of every size once (`warm_verify_sizes`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from typing import Sequence

import torch

from specextend.ladder import Rung, ladder
from specextend.lookup import ContextIndex, RequestLookup
from specextend.lookup_ahead import DeviceHistory, runs_ahead
from specextend.retrieval import score_chunks
from specextend.draft.base import DraftSessionParams
from specextend.open_costs import open_lengths, open_seconds
from specextend.engine import Engine
from specextend.target import TargetSession
from specextend.stats import RequestStats
from specextend.config import SamplingParams

log = logging.getLogger(__name__)


def warm_up(engine: Engine, prompt_ids: Sequence[int], batch_sessions: int = 1) -> RequestStats:
    """Runs the warm-up requests on `engine`'s models (the speculative ones with every step at the
    rung asked for, whatever the engine's tree policy), and captures the target's batched forwards
    of up to `batch_sessions` sessions (`warm_batches`); returns the stats of the last speculative
    one (its `fallback` says whether the draft answered)."""
    cfg = engine.config
    _, _, stats = engine.generate(prompt_ids, SamplingParams(max_new_tokens=min(4, cfg.max_new_tokens), ignore_eos=True),
                                  speculate=False)
    if engine.prefix_cache is not None:  # (the requests' prompts, not the warm-up's; `_fixed` engines keep their own)
        engine.prefix_cache.clear()
    if batch_sessions > 1:
        warm_batches(engine, batch_sessions)
    if cfg.mode == "lookup":  # chains alone: each verify size once
        warm_verify_sizes(engine, prompt_ids)
    warm_lookup_runs(engine, prompt_ids)
    if not cfg.uses_draft:
        return stats
    draft_warm_up = getattr(engine.draft, "warm_up", None)  # an in-process worker (a remote one warms itself)
    if draft_warm_up is not None:
        draft_warm_up(DraftSessionParams(cfg.tree, cfg.retrieval, max_new_tokens=64))
    warm_scoring(engine)
    warm_opens(engine, prompt_ids)
    every = max(cfg.retrieval.every, 1) if cfg.retrieval.enabled else 1
    for rung in _covering(ladder(cfg.tree)[1:]):
        fixed = _fixed(engine, tree=replace(cfg.tree, depth=rung.depth))
        lengths = list(range(rung.depth + 1))  # accepted draft tokens per step
        steps = len(lengths) * every // math.gcd(len(lengths), every)  # every (length, refresh) pair
        tokens = sum(lengths[i % len(lengths)] + 1 for i in range(steps)) + 2
        params = SamplingParams(max_new_tokens=min(tokens, engine.target.max_context - len(prompt_ids)),
                                ignore_eos=True)
        _, _, stats = fixed.generate(prompt_ids, params, replay=lengths, max_tree_nodes=rung.nodes)
        if stats.fallback:
            break
    warm_verify_sizes(engine, prompt_ids)
    return stats


def warm_opens(engine: Engine, prompt_ids: Sequence[int]) -> dict[int, float]:
    """Times the draft's open (its prefill: open_costs.open_seconds) of prompts of open_costs.open_lengths
    up to the prompt limit, closing each, into the engine's OpenCosts; -> seconds by length. Where
    the policy defers opens, a batch's governor prices the trees window's opens from these
    (Load.open_s): without them the first burst priced them from a prior, the draft weights' share
    of each session's own target prefill, which a batched prefill makes cheap, and sixteen 4K
    sessions of the real pair on an H200 priced their opens at under 0.18 s, ran the trees window,
    and spent 0.83 s opening (2026-12-03: 0.42x `ar` for the burst; docs/architecture.md,
    "Adaptive speculation", *Deferred open*). The shortest open runs twice: its first meets the
    draft's first prefill of that size; each prompt starts with its own token, so that no open
    loads another's prefix from the draft's prefix cache. A failing draft stops it (the requests
    fall back to plain decoding on their own)."""
    if not (engine.defer_opens and engine.config.tree_policy == "adaptive" and not engine.config.overlap
            and not engine.draft_never_pays):
        return {}
    params = DraftSessionParams(engine.config.tree, engine.config.retrieval, max_new_tokens=64)
    lengths = open_lengths(engine.max_prompt_tokens - 64)
    timed: dict[int, float] = {}
    for i, n in enumerate(lengths[:1] + lengths):
        sid = f"warm-open-{i}"
        prompt = [1 + i] + [prompt_ids[j % len(prompt_ids)] for j in range(n - 1)]  # (its own first token)
        try:
            timed[n] = open_seconds(engine.draft.open, sid, prompt, params)
        except Exception as e:  # noqa: BLE001 - a draft that cannot open it (DraftError, out of memory)
            log.warning("warm-up: the draft's open of %d tokens failed (%s); longer opens are priced from shorter ones", n, e)
            break
        finally:
            try:
                engine.draft.close(sid)
            except Exception:  # noqa: BLE001 - closing is best-effort (draft_link._close_draft)
                pass
        if i:
            engine.open_costs.record(n, timed[n])
    if timed:
        log.info("warm-up: the draft's opens took %s", ", ".join(f"{n} tokens {1e3 * x:.1f} ms" for n, x in timed.items()))
    return timed


SCORING_LENGTHS = (1024, 4096, 16384, 65536)  # contexts whose scoring runs once at warm-up (within the model's)


def warm_scoring(engine: Engine) -> list[int]:
    """The retrieval scoring (retrieval.score_chunks) once at each of SCORING_LENGTHS that the
    target's context holds and that has more chunks than the draft keeps: the warm-up's own
    requests are too short to score (their chunks fit the budget), and the first call of each
    kernel loads it on the request's path, stalling the whole batch: on an H200 the first scoring
    of a 16K context took 214 ms of host time (140 in the fp32 einsum), a later one at 4K 13 ms (a
    new GEMM kernel), every later one below 1 ms (2026-12-03). -> the contexts scored."""
    cfg, args = engine.config, engine.target.args
    r = cfg.retrieval
    if not (cfg.uses_draft and r.enabled and r.select == "attention"):
        return []
    dev, dtype = engine.target.decoder.device, engine.target.decoder.dtype
    done = []
    for ctx in SCORING_LENGTHS:
        if ctx > engine.target.max_context or -(-ctx // r.chunk_size) <= r.top_k:
            continue
        q = torch.randn(args.num_heads, args.head_dim, device=dev, dtype=dtype)  # [H, D]
        lse = torch.zeros(args.num_heads, device=dev)  # [H]
        keys = torch.randn(args.num_kv_heads, ctx, args.head_dim, device=dev, dtype=dtype)  # [G, S, D]
        score_chunks(q, lse, keys, engine.target.decoder.scale, r).cpu()  # (waits: the kernels ran)
        done.append(ctx)
    return done


def _fixed(engine: Engine, **changes) -> Engine:
    """`engine`'s models with every step a drafted tree (fixed policy, and overlap_miss=draft: an
    unready step would decode plainly and leave that step's verify shape to a request). The warm-up's
    requests are the engine's own: the limit on a user's max_tokens does not bound them (an app with
    max_new_tokens=64 refused its own warm-up, which needs up to (depth+1)·refresh steps' tokens)."""
    return Engine(replace(engine.config, tree_policy="fixed", overlap_miss="draft",
                          max_new_tokens=engine.target.max_context, **changes), engine.target, engine.draft)


def warm_verify_sizes(engine: Engine, prompt_ids: Sequence[int]) -> int:
    """With overlapped drafting or context lookup, the target's verify of every tree size
    1..tree_nodes + lookup_tokens (and with the last layer captured, where retrieval scores it) on a
    throwaway session: each size is its own CUDA graph. Returns the verifies run (0 with neither:
    trees come at the ladder's sizes)."""
    cfg = engine.config
    if not cfg.overlap and not cfg.lookup_tokens or cfg.mode == "ar":
        return 0
    prompt = list(prompt_ids)
    # a tree and the lookup chain grafted onto it (mode lookup: a chain alone)
    largest = (cfg.tree.nodes if cfg.uses_draft else 0) + cfg.lookup_tokens
    session = TargetSession(engine.target.decoder, len(prompt) + largest + 2, hybrid=cfg.hybrid_attention)
    session.prefill(prompt, cfg.prefill_chunk)
    captures = (False, True) if cfg.retrieval.enabled and cfg.retrieval.select == "attention" else (False,)
    n = 0
    for nodes in range(1, largest + 1):
        for capture in captures:  # nodes under the root: the shape is the rows, not the tree
            session.verify(prompt[-1], [prompt[i % len(prompt)] for i in range(nodes)], [-1] * nodes, capture)
            n += 1
    return n


def warm_lookup_runs(engine: Engine, prompt_ids: Sequence[int], steps: int = 2) -> int:
    """Where a request's steps without a tree would run ahead of the host (lookup_ahead.py),
    a few such steps on a throwaway session: the run's Triton kernels compile now (about a second
    each, on a request's path otherwise) and its forward's plan is met. Returns the steps run (0:
    requests take no runs)."""
    cfg = engine.config
    prompt = list(prompt_ids)
    if not cfg.lookup_tokens or not cfg.plain_ahead or cfg.mode == "ar" or len(prompt) < 2:
        return 0
    q = cfg.lookup_tokens
    index = ContextIndex(prompt, engine.target.args.vocab_size)
    lookup = RequestLookup(index, q)
    if not runs_ahead(engine.target.decoder, SamplingParams(max_new_tokens=steps), lookup, None, engine.lookup_ahead):
        return 0
    session = TargetSession(engine.target.decoder, len(prompt) + steps * (q + 1) + 2, hybrid=cfg.hybrid_attention)
    session.prefill(prompt[:-1], cfg.prefill_chunk)  # the cache holds every token but the root
    history = DeviceHistory(session.cache.capacity, q, engine.target.decoder.device)
    history.sync(index)
    for _ in range(steps):
        _, _, event = session.run(history.step_co(session))
        if event is not None:
            event.synchronize()
    return steps


def _covering(rungs: list[Rung]) -> list[Rung]:
    """The rungs whose requests meet every shape of the ladder's: each size at its deepest rung (its
    verify rows, every accepted length, the draft levels' staged keys), then any depth none of those
    has (the draft's tree graphs are per depth, not per size), each run at its own depth. A size's
    shallow rung usually adds nothing (the 4-node rung is 3 levels deep)."""
    todo = list({r.nodes: r for r in rungs}.values())  # ordered by nodes, then depth: a size's last is its deepest
    depths = {r.depth for r in todo}
    for r in rungs:
        if r.depth not in depths:
            depths.add(r.depth)
            todo.append(r)
    return todo


def warm_batches(engine: Engine, batch_sessions: int) -> int:
    """The target's batched forwards (several sessions' steps as one, docs/architecture.md, "Batched
    steps") captured for a plain step and each size of the adaptive ladder's trees (a verify
    forward is the root and the tree's nodes), for 2, 4, ... sessions up to `batch_sessions`;
    returns the plans built (0 where the target's plan does not batch)."""
    graphs = engine.target.decoder.graphs
    if graphs is None:
        return 0
    tokens = {1}
    cfg = engine.config
    if cfg.uses_draft:
        tokens |= {r.nodes + 1 for r in ladder(cfg.tree)[1:]}
        if cfg.lookup_tokens:  # a lookup chain alone, and grafted onto the largest tree
            tokens |= {cfg.lookup_tokens + 1, cfg.tree.nodes + cfg.lookup_tokens + 1}
    elif cfg.mode == "lookup":  # a lookup chain alone
        tokens.add(cfg.lookup_tokens + 1)
    return graphs.warm_batches(sorted(tokens), batch_sessions)


def long_prompt_len(engine: Engine) -> int:
    """Tokens of a prompt that meets what a long request meets and the short warm-up prompt does not:
    two prefill chunks, a draft prefill past its window, a retrieval selection of its whole budget
    (sink, top-k and recent chunks) with more chunks to choose from; within the prompt limit."""
    cfg, r = engine.config, engine.config.retrieval
    n = max(2 * cfg.prefill_chunk, (r.draft_prefill_window or 0) + r.chunk_size,
            (r.sink_chunks + r.top_k + r.recent_chunks + 2) * r.chunk_size)
    return max(1, min(n, engine.max_prompt_tokens - 64))


def warm_long(engine: Engine, prompt_ids: Sequence[int]) -> RequestStats:
    """One speculative request on a long prompt (`prompt_ids` repeated to long_prompt_len tokens),
    every step a drafted one-token tree, through several retrieval refreshes, so that the one-off
    costs that only a long request meets (allocations at its lengths, kernels and host buffers of
    its sizes) fall before traffic. Why: on two H200s (2026-11-27, benchmarks/README.md) an app's
    first 16K request decoded at 20-47 tokens/s against 340-420 for its next, after the short
    warm-up alone; whether this request absorbs all of it is not yet measured on a GPU."""
    cfg = engine.config
    n = long_prompt_len(engine)
    prompt = [prompt_ids[i % len(prompt_ids)] for i in range(n)]
    every = max(cfg.retrieval.every, 1) if cfg.retrieval.enabled else 1
    fixed = _fixed(engine)
    params = SamplingParams(max_new_tokens=4 * (2 * every + 1), ignore_eos=True)
    return fixed.generate(prompt, params, replay=[1])[2]
