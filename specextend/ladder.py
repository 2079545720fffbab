"""The adaptive policy's ladder (docs/architecture.md, "Adaptive speculation"): the shapes a step
may take (`Rung`: plain, or a tree of n nodes and d levels), the ladder of them a session's tree
implies, and what each rung would have accepted of a verified tree (`prefix_accepts`). Pure
functions; the choice among them is controller.py's."""

from __future__ import annotations

from typing import NamedTuple, Sequence

from specextend.config import TreeConfig
from specextend.draft.base import TreeBound
from specextend.tree import node_depths


class Rung(NamedTuple):
    """One step's shape: a tree of at most `nodes` nodes and `depth` levels; nodes = 0: plain. A
    named tuple: the policy hashes rungs some forty times a step (its averages are keyed by them),
    and a tuple's hash and equality are the interpreter's own (a frozen dataclass's are Python
    calls: ~5 of the ~30 us a step of the policy's host work on the CI's CPU, 2026-11-29)."""

    nodes: int
    depth: int

    @property
    def plain(self) -> bool:
        return self.nodes == 0

    @property
    def bound(self) -> TreeBound:
        return TreeBound(self.nodes, self.depth)


PLAIN = Rung(0, 0)
SHALLOW = 3  # levels of each size's shallow rung


def ladder(tree: TreeConfig, smallest: int = 4) -> list[Rung]:
    """[plain, 4, 8, 16, ... nodes, the session's tree]: each smaller size as deep as the session's
    tree (n nodes reach n levels at most), the session's tree at its own depth, and, where that is
    deeper than SHALLOW, the same size SHALLOW levels deep just before it (half the drafting: on an
    H100 the 8B geometry's 32 nodes x 3 levels beat 32 x 6 by 9% with acceptance replayed at 3,
    2026-11-24). Every size goes deep: a narrow deep tree is the best one where the draft's chain
    is long and sure (acceptance replayed at 5 on an H200, 2026-11-29: 8 x 6 at 1.31x 8 x 3, and
    the ladder's old 8 x 4 bound adaptive to 0.91x of it). Ordered by nodes, then depth."""
    sizes, n = [], smallest
    while n < tree.nodes:
        sizes.append(Rung(n, min(tree.depth, n)))
        n *= 2
    rungs = [PLAIN]
    for r in sizes + [Rung(tree.nodes, tree.depth)]:
        if r.depth > SHALLOW and r.nodes > SHALLOW:
            rungs.append(Rung(r.nodes, SHALLOW))
        rungs.append(r)
    return rungs


def prefix_accepts(accepted: Sequence[int], parents: Sequence[int], sent: Rung,
                   rungs: Sequence[Rung]) -> dict[Rung, int]:
    """Accepted draft tokens each tree rung would have had this step, for the rungs the verified
    tree covers (no more nodes, no deeper than `sent`). `accepted`: the accepted path's node
    indices into the verified tree (best first); a rung's tree is the first `nodes` of its nodes
    no deeper than `depth`, and it accepts the path while the path stays inside it."""
    depths = node_depths(parents)  # [N]
    out = {}
    for r in rungs:
        if r.plain or r.nodes > sent.nodes or r.depth > sent.depth:
            continue
        inside = set([i for i, d in enumerate(depths) if d <= r.depth][:r.nodes])
        n = 0
        while n < len(accepted) and accepted[n] in inside:
            n += 1
        out[r] = n
    return out
