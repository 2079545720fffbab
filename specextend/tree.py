"""Draft-tree tensors (docs/architecture.md, "Draft tree"): masks, depths and best-node selection. Pure functions.

A tree is `tokens[N]`, `parents[N]` in topological order, parents[i] = -1 for the root's
children. Verification and drafting index the root as 0 and node i as i + 1.
"""

from __future__ import annotations

import functools

from typing import Sequence

import numpy as np
import torch


def node_depths(parents: Sequence[int]) -> list[int]:
    """Depth of each node (root's children = 1); parents must be topologically ordered."""
    depth: list[int] = []
    for p in parents:
        if p >= len(depth):
            raise ValueError("parents must be in topological order")
        depth.append(1 if p < 0 else depth[p] + 1)
    return depth


def ancestor_mask(parents: Sequence[int], device="cpu") -> torch.Tensor:
    """[N+1, N+1] bool over [root] + nodes: row i sees the root, its ancestors and itself. Built in
    numpy (12 us for 16 nodes; row copies of a torch tensor took 140 us of host time, on the
    verify step's critical path before its graph launch), copied to the device through pinned
    memory (models/transfer.to_device: a pageable copy may wait for the device's queued work; a
    ready tree from the pool has a new shape nearly every step, a cache miss)."""
    n = len(parents)
    mask = np.zeros((n + 1, n + 1), dtype=bool)
    mask[:, 0] = True
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i + 1] = mask[p + 1]
        mask[i + 1, i + 1] = True
    from specextend.models.transfer import to_device  # (models imports this module)

    return to_device(mask, torch.bool, device)


@functools.lru_cache(maxsize=512)
def _ancestor_mask_cached(parents: tuple[int, ...], device: str) -> torch.Tensor:
    return ancestor_mask(parents, device)


def ancestor_mask_cached(parents: Sequence[int], device) -> torch.Tensor:
    """ancestor_mask, one shared device tensor per (tree shape, device): a chain of k tokens, the
    verification of every lookup step, always has the same mask, and a forward's plan whose mask
    buffer holds that tensor's content already skips the copy (graphs.StepGraphs.forward). Never
    written to by its users (read-only)."""
    return _ancestor_mask_cached(tuple(int(p) for p in parents), str(torch.device(device)))


def children_of(parents: Sequence[int]) -> list[list[int]]:
    """children[j] = node indices whose parent is node j - 1 (j = 0 is the root), in list order."""
    children: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, p in enumerate(parents):
        children[p + 1].append(i)
    return children


def select_best_nodes(scores: Sequence[float], depths: Sequence[int], parents: Sequence[int],
                      n: int) -> list[int]:
    """The n best candidates by path score (log-probability), closed under ancestors.

    A child's score never exceeds its parent's, and ties are broken by depth, so the best-n set
    contains every selected node's parent. Returned best first, which is a topological order
    (a parent precedes its children): every prefix of the result is the best tree of its size,
    which the adaptive policy relies on (docs/architecture.md, "Adaptive speculation")."""
    if len(scores) > 64:  # numpy: the same order (lexsort is stable: id breaks the last ties)
        order = np.lexsort((np.asarray(depths), -np.asarray(scores, dtype=np.float64)))[:n].tolist()
    else:
        order = sorted(range(len(scores)), key=lambda i: (-scores[i], depths[i], i))[:n]
    seen: set[int] = set()
    for i in order:  # closure holds by construction; fail loudly if a caller breaks it
        if parents[i] >= 0 and parents[i] not in seen:
            raise ValueError("candidate scores are not monotone along paths")
        seen.add(i)
    return order


def reindex_tree(selected: Sequence[int], tokens: Sequence[int], parents: Sequence[int]
                 ) -> tuple[list[int], list[int]]:
    """Candidate-pool indices -> the final tree's tokens and parents (indices into the tree)."""
    pos = {c: i for i, c in enumerate(selected)}
    return [tokens[c] for c in selected], [pos[parents[c]] if parents[c] >= 0 else -1 for c in selected]
