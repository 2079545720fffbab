"""Dynamic tree expansion (EAGLE-2 style): grow the global top-k frontier depth by depth.

`expand_tree` keeps the frontier, its scores and the attention mask on the model's device, so
a level's forward is queued without waiting for the previous level's results on the host: one
device-to-host copy for the whole tree at the end. With the draft's forwards replayed as CUDA
graphs this lets the host launch level d+1 while the device still runs level d.
`expand_tree_host` is the same algorithm with the bookkeeping in Python lists (its slow twin; the
tests compare them).

Both take `forward(ids [F], positions [F], mask [F, staged + F] bool, staged) -> logits [F, V]`:
the frontier's tokens at one depth, attending to the committed cache, to their forwarded
ancestors among the `staged` tree keys, and to themselves.
Both return (tokens, scores, parents, depths) of the candidate pool, or None if stopped.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from specextend.config import TreeConfig

Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]
Pool = tuple[list[int], list[float], list[int], list[int]]


def expand_tree(forward: Forward, root_logits: torch.Tensor, cfg: TreeConfig, root_pos: int,
                should_stop: Callable[[], bool] = lambda: False) -> Optional[Pool]:
    dev, k = root_logits.device, cfg.topk
    top = torch.topk(torch.log_softmax(root_logits.float(), -1), k)
    fr_tok, fr_score = top.indices, top.values  # [k] frontier tokens, cumulative log-probs
    fr_id = torch.arange(k, device=dev)  # [k] frontier's ids in the pool
    toks, scores = [fr_tok], [fr_score]  # pool, level by level (device tensors)
    parents = [torch.full((k,), -1, dtype=torch.long, device=dev)]
    depths = [1] * k
    mask = torch.eye(k, dtype=torch.bool, device=dev)  # [F, staged + F]: first level sees itself
    staged, size = 0, k
    for d in range(1, cfg.depth):
        if should_stop():
            return None
        f = fr_tok.shape[0]
        logits = forward(fr_tok, torch.full((f,), root_pos + d, device=dev), mask, staged)  # [F, V]
        staged += f
        child = torch.topk(torch.log_softmax(logits.float(), -1), k)  # [F, k]
        cand_scores = (fr_score[:, None] + child.values).reshape(-1)  # [F * k]
        cand_tokens = child.indices.reshape(-1)  # [F * k]
        toks.append(cand_tokens)
        scores.append(cand_scores)
        parents.append(fr_id.repeat_interleave(k))
        depths += [d + 1] * (f * k)
        best = torch.topk(cand_scores, min(k, f * k)).indices  # [F'] next frontier
        fr_id = size + best
        fr_tok, fr_score = cand_tokens[best], cand_scores[best]
        size += f * k
        # a child sees what its parent saw (ancestors and the parent itself) and itself
        rows = mask.index_select(0, torch.div(best, k, rounding_mode="floor"))  # [F', staged]
        mask = torch.cat([rows, torch.eye(best.shape[0], dtype=torch.bool, device=dev)], dim=1)
    return (torch.cat(toks).tolist(), torch.cat(scores).tolist(), torch.cat(parents).tolist(), depths)


def expand_tree_host(forward: Forward, root_logits: torch.Tensor, cfg: TreeConfig, root_pos: int,
                     should_stop: Callable[[], bool] = lambda: False) -> Optional[Pool]:
    dev, k = root_logits.device, cfg.topk
    top = torch.topk(torch.log_softmax(root_logits.float(), -1), k)
    # candidate pool (parallel lists); slot = staged offset once forwarded, else -1
    toks: list[int] = top.indices.tolist()
    scores: list[float] = top.values.tolist()
    parents: list[int] = [-1] * k
    depths: list[int] = [1] * k
    slots: list[int] = [-1] * k
    frontier = list(range(k))
    staged = 0
    for d in range(1, cfg.depth):
        if should_stop():
            return None
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
        logits = forward(torch.tensor([toks[c] for c in frontier], device=dev),
                         torch.full((f,), root_pos + d, device=dev), mask.to(dev), staged)
        staged += f
        child = torch.topk(torch.log_softmax(logits.float(), -1), k)  # [F, k]
        cand_scores = (torch.tensor([scores[c] for c in frontier])[:, None] + child.values.cpu())
        cand_tokens = child.indices.cpu()
        start = len(toks)
        toks += cand_tokens.reshape(-1).tolist()
        scores += cand_scores.reshape(-1).tolist()
        parents += [c for c in frontier for _ in range(k)]
        depths += [d + 1] * (f * k)
        slots += [-1] * (f * k)
        best = torch.topk(cand_scores.reshape(-1), min(k, f * k)).indices.tolist()
        frontier = [start + b for b in best]
    return toks, scores, parents, depths
