"""Dynamic tree expansion (EAGLE-2 style): grow the global top-k frontier depth by depth.

`expand_tree` keeps the frontier, its scores and the attention mask on the model's device, so
a level's forward is queued without waiting for the previous level's results on the host: one
device-to-host copy for the whole tree at the end. With the draft's forwards replayed as CUDA
graphs this lets the host launch level d+1 while the device still runs level d.
`expand_tree_host` is the same algorithm with the bookkeeping in Python lists (its slow twin; the
tests compare them).

A level's bookkeeping (`level_post`: log-softmax, top-k over the vocabulary, the next frontier
and its mask) is ~15 small ops whose host cost dominated a small draft's step on an H100
(2026-11-23: a 68M draft step took 9.6 ms of wall time for 2.7 ms of kernels; torch.topk alone
cost ~185 us of host time a call, 11 calls a step). `Graphed(level_post)` replays it as one CUDA graph per
shape; level_post called directly is its twin (the tests compare them).

Both take `forward(ids [F], positions [F], mask [F, staged + F] bool, staged) -> logits [F, V]`:
the frontier's tokens at one depth, attending to the committed cache, to their forwarded
ancestors among the `staged` tree keys, and to themselves.
Both return (tokens, scores, parents, depths, forwarded) of the candidate pool, or None if
stopped: `forwarded` lists the pool ids whose K/V were staged, in staged-slot order (overlapped
drafting keeps expanding that pool, pool.py).
"""

from __future__ import annotations

from typing import Callable, Generator, Optional

import torch

from specextend.config import TreeConfig
from specextend.draft import vocab_topk

Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]
Pool = tuple[list[int], list[float], list[int], list[int], list[int]]
Level = tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]  # a level's forward: ids [F], positions [F], mask, staged


def top_logprobs(logits: torch.Tensor,  # [..., V] next-token logits
                 w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `w` most likely next tokens per row, best first: (log-probabilities [..., w] (float32, or
    float64 for float64 logits),
    token ids [..., w]). Top-k of the logits themselves (log-softmax keeps their order) minus the
    row's log-sum-exp, so the [..., V] float32 log-softmax is never written (its kernel runs one
    block per row: 34 us a call for the 0.5B draft's 152K vocabulary and 4-8 rows on an H200,
    2026-11-23). The whole draft step measured the same within noise either way (8.1-8.5 ms).
    Rows of a CUDA tensor go through vocab_topk.py's kernels (this torch path is their twin)."""
    rows = logits.reshape(-1, logits.shape[-1]) if logits.dim() <= 2 else logits  # [R, V] (a view)
    if vocab_topk.supported(rows, w):  # two Triton kernels instead of torch.topk's radix select
        lp, ids = vocab_topk.vocab_topk(rows, w)
        return (lp, ids) if logits.dim() == 2 else (lp[0], ids[0])
    cd = logits.dtype if logits.dtype in (torch.float32, torch.float64) else torch.float32
    top = torch.topk(logits, w)  # [..., w] sorted
    lse = torch.logsumexp(logits.to(cd), -1, keepdim=True)  # [..., 1]
    return top.values.to(cd) - lse, top.indices


def level_post(logits: torch.Tensor,  # [F, V] the frontier's next-token logits
               fr_score: torch.Tensor,  # [F] its cumulative log-probabilities
               fr_id: torch.Tensor,  # [F] its ids in the pool
               mask: torch.Tensor,  # [F, S] bool: what each frontier node attended to (incl. itself)
               k: int, size: int, wide: int = 0) -> tuple[torch.Tensor, ...]:
    """One level's bookkeeping (`size`: the pool's size before this level's candidates) -> the F * w
    candidates' tokens, scores and parents (w = `wide` or k children per node: overlapped drafting
    keeps more alternatives as possible bonus tokens), then the next frontier's tokens, scores, pool
    ids [F' = min(k, F * w)] and mask [F', S + F'] (a child sees what its parent saw, and itself).
    The frontier is the same for any w >= k: the global top-k holds at most one node's top-k."""
    f, w = logits.shape[0], wide or k
    child_lp, child_ids = top_logprobs(logits, w)  # [F, w]
    cand_scores = (fr_score[:, None] + child_lp).reshape(-1)  # [F * w]
    cand_tokens = child_ids.reshape(-1)  # [F * w]
    parents = fr_id.repeat_interleave(w)  # [F * w]
    best = torch.topk(cand_scores, min(k, f * w)).indices  # [F']
    rows = mask.index_select(0, torch.div(best, w, rounding_mode="floor"))  # [F', S]
    nxt_mask = torch.cat([rows, torch.eye(best.shape[0], dtype=torch.bool, device=mask.device)], dim=1)
    return cand_tokens, cand_scores, parents, cand_tokens[best], cand_scores[best], size + best, nxt_mask


def drive(co: Generator, forward: Forward, should_stop: Callable[[], bool] = lambda: False) -> Optional[Pool]:
    """Runs an expansion coroutine (`expand_tree_co`, `expand_tree_host_co`) with `forward` called
    for each level it yields; None if `should_stop()` says so before a level's forward."""
    try:
        request = next(co)
        while True:
            if should_stop():
                co.close()
                return None
            request = co.send(forward(*request))
    except StopIteration as stop:
        return stop.value


def expand_tree(forward: Forward, root_logits: torch.Tensor, cfg: TreeConfig, root_pos: int,
                should_stop: Callable[[], bool] = lambda: False, post=level_post, wide: int = 0) -> Optional[Pool]:
    """`post`: level_post or Graphed(level_post) (its CUDA-graph replay, models/graphed.py); `wide`: children kept per node
    (default: the tree's top-k)."""
    return drive(expand_tree_co(root_logits, cfg, root_pos, post, wide), forward, should_stop)


def expand_tree_co(root_logits: torch.Tensor, cfg: TreeConfig, root_pos: int, post=level_post,
                   wide: int = 0) -> Generator[Level, torch.Tensor, Pool]:
    """expand_tree as a coroutine: yields each level's forward arguments (ids, positions, mask,
    staged), is sent its logits [F, V], returns the pool. The draft worker drives several sessions'
    coroutines level by level, their forwards batched (draft/batch.py)."""
    toks, scores, parents, depths, forwarded = yield from expand_tree_dev_co(root_logits, cfg, root_pos, post, wide)
    return (toks.tolist(), scores.tolist(), parents.tolist(), depths,
            forwarded.tolist() if forwarded is not None else [])


def expand_tree_dev_co(root_logits: torch.Tensor, cfg: TreeConfig, root_pos, post=level_post,
                       wide: int = 0) -> Generator[Level, torch.Tensor, tuple]:
    """expand_tree_co with the pool left on the device: (tokens [P], scores [P], parents [P],
    depths (a list), forwarded [F_total] or None). Nothing here reads the device, so the whole
    expansion can be captured as one CUDA graph (draft/tree_graph.py); `root_pos` is an int or a
    device tensor [1] (a graph's static input)."""
    dev, k = root_logits.device, cfg.topk
    w = max(wide, k)
    top_lp, top_ids = top_logprobs(root_logits, w)  # [w], sorted
    fr_tok, fr_score = top_ids[:k], top_lp[:k]  # [k] frontier tokens, cumulative log-probs
    fr_id = torch.arange(k, device=dev)  # [k] frontier's ids in the pool
    toks, scores = [top_ids], [top_lp]  # pool, level by level (device tensors)
    parents = [torch.full((w,), -1, dtype=torch.long, device=dev)]
    depths = [1] * w
    mask = torch.eye(k, dtype=torch.bool, device=dev)  # [F, staged + F]: first level sees itself
    staged, size = 0, w
    forwarded = []  # [F] pool ids per level, in staged order
    for d in range(1, cfg.depth):
        f = fr_tok.shape[0]
        forwarded.append(fr_id)
        pos = (torch.full((f,), root_pos + d, device=dev) if isinstance(root_pos, int)
               else (root_pos + d).expand(f))  # [F]
        logits = yield fr_tok, pos, mask, staged  # [F, V]
        staged += f
        cand_tokens, cand_scores, parents_d, fr_tok, fr_score, fr_id, mask = post(logits, fr_score, fr_id, mask,
                                                                                  k, size, w)
        toks.append(cand_tokens)
        scores.append(cand_scores)
        parents.append(parents_d)
        depths += [d + 1] * (f * w)
        size += f * w
    return (torch.cat(toks), torch.cat(scores), torch.cat(parents), depths,
            torch.cat(forwarded) if forwarded else None)


def expand_tree_host(forward: Forward, root_logits: torch.Tensor, cfg: TreeConfig, root_pos: int,
                     should_stop: Callable[[], bool] = lambda: False, post=None, wide: int = 0) -> Optional[Pool]:
    """`post` is ignored: the twin keeps its bookkeeping on the host."""
    return drive(expand_tree_host_co(root_logits, cfg, root_pos, post, wide), forward, should_stop)


def expand_tree_host_co(root_logits: torch.Tensor, cfg: TreeConfig, root_pos: int, post=None,
                        wide: int = 0) -> Generator[Level, torch.Tensor, Pool]:
    """expand_tree_host as a coroutine (see expand_tree_co)."""
    dev, k = root_logits.device, cfg.topk
    w = max(wide, k)
    top_lp, top_ids = top_logprobs(root_logits, w)
    # candidate pool (parallel lists); slot = staged offset once forwarded, else -1
    toks: list[int] = top_ids.tolist()
    scores: list[float] = top_lp.tolist()
    parents: list[int] = [-1] * w
    depths: list[int] = [1] * w
    slots: list[int] = [-1] * w
    frontier = list(range(k))
    staged = 0
    forwarded: list[int] = []
    for d in range(1, cfg.depth):
        f = len(frontier)
        # mask over staged keys: each frontier node sees its forwarded ancestors and itself
        mask = torch.zeros(f, staged + f, dtype=torch.bool)
        for r, c in enumerate(frontier):
            a = parents[c]
            while a >= 0:
                mask[r, slots[a]] = True
                a = parents[a]
            mask[r, staged + r] = True
            slots[c] = staged + r
        forwarded += frontier
        logits = yield (torch.tensor([toks[c] for c in frontier], device=dev),
                        torch.full((f,), root_pos + d, device=dev), mask.to(dev), staged)
        staged += f
        child_lp, child_ids = top_logprobs(logits, w)  # [F, w]
        cand_scores = (torch.tensor([scores[c] for c in frontier], dtype=child_lp.dtype)[:, None] + child_lp.cpu())
        cand_tokens = child_ids.cpu()
        start = len(toks)
        toks += cand_tokens.reshape(-1).tolist()
        scores += cand_scores.reshape(-1).tolist()
        parents += [c for c in frontier for _ in range(w)]
        depths += [d + 1] * (f * w)
        slots += [-1] * (f * w)
        best = torch.topk(cand_scores.reshape(-1), min(k, f * w)).indices.tolist()
        frontier = [start + b for b in best]
    return toks, scores, parents, depths, forwarded
