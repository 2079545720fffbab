"""The draft's persistent candidate pool for overlapped drafting (docs/architecture.md, "Overlapped
drafting"). Host-side bookkeeping only: which candidate tokens exist below the current root, their
path scores, and which of them have been forwarded (their K/V staged in the draft's working cache
after the committed tokens, at `slot`).

After a tree is sent, the draft keeps expanding this pool, best path score first, while the
target verifies. Every pool node is a possible next root: the verdict (accepted path + bonus
token) names one, and when that node has been forwarded, `reroot` keeps its subtree, whose best
nodes are the next tree, ready at once. Path scores approximate the outcome probabilities: the
bonus token is, under the draft, a child of the last accepted node with probability
exp(score), so the expansion order is the order in which outcomes are likely.

Node ids are indices into the parallel lists; the root (the last committed token) is not a node
(its children have parent -1). Scores are log-probabilities relative to the root.

The pool grows by `2 x tree_topk` children per forwarded node (about a thousand nodes after a few
steps), and its bookkeeping runs on the draft's host thread between forwards and on a ready
step's critical path, so its queries are output-sensitive: children by parent (walk, reroot), a
heap of the unforwarded nodes (frontier), numpy for the best-n selection (tree.py).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

from specextend.tree import reindex_tree, select_best_nodes


@dataclass
class Pool:
    tokens: list[int] = field(default_factory=list)  # [P]
    scores: list[float] = field(default_factory=list)  # [P] path log-probability from the root
    parents: list[int] = field(default_factory=list)  # [P] parent id, -1 = the root
    depths: list[int] = field(default_factory=list)  # [P] root's children = 1
    slots: list[int] = field(default_factory=list)  # [P] staged offset once forwarded, else -1
    staged: int = 0  # staged slots in use (forwarded nodes and padding)
    # indexes over the lists above (kept by the methods here; slots may be set from outside only
    # from -1 to a slot, which the heap tolerates: it drops forwarded nodes as it meets them)
    _kids: dict[int, list[int]] = field(default_factory=dict, repr=False, compare=False)  # parent -> children
    _todo: list[tuple[float, int, int]] = field(default_factory=list, repr=False, compare=False)  # heap (-score, depth, id)

    def __post_init__(self) -> None:
        self._reindex()

    def _reindex(self) -> None:
        self._kids = {}
        for i, p in enumerate(self.parents):
            self._kids.setdefault(p, []).append(i)
        self._todo = [(-self.scores[i], self.depths[i], i) for i, s in enumerate(self.slots) if s < 0]
        heapq.heapify(self._todo)

    @classmethod
    def from_expansion(cls, tokens: Sequence[int], scores: Sequence[float], parents: Sequence[int],
                       depths: Sequence[int], forwarded: Sequence[int]) -> "Pool":
        """A pool from expand_tree's result; `forwarded` lists node ids in staged-slot order."""
        slots = [-1] * len(tokens)
        for slot, node in enumerate(forwarded):
            slots[node] = slot
        return cls(list(tokens), list(scores), list(parents), list(depths), slots, len(forwarded))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def forwarded(self) -> int:
        return sum(s >= 0 for s in self.slots)

    def children(self, node: int) -> list[int]:
        return list(self._kids.get(node, ()))

    def frontier(self, rows: int, max_depth: int) -> list[int]:
        """Up to `rows` not yet forwarded nodes with the best scores, best first (a node after its
        parent: a child scores below it); ties by depth, then id. Forwarded nodes leave the heap as
        they reach its top, as do entries of a node whose score was raised since (`add_children`)."""
        heap, out, deep = self._todo, [], []
        while heap and len(out) < rows:
            item = heapq.heappop(heap)
            i = item[2]
            if self.slots[i] >= 0 or -item[0] != self.scores[i]:
                continue  # forwarded since it was pushed (gone for good), or a stale score
            (out if item[1] < max_depth else deep).append(item)
        for item in out + deep:  # a query: they stay candidates until forwarded
            heapq.heappush(heap, item)
        return [i for _, _, i in out]

    def ancestors(self, node: int) -> list[int]:
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def mask(self, nodes: Sequence[int], start: int) -> torch.Tensor:
        """[F, start + F] bool over staged keys for forwarding `nodes` at slots start, start + 1, ...:
        each row sees its ancestors' slots (forwarded earlier, or earlier in `nodes`) and its own.
        Built in numpy: element writes into a torch tensor cost ~1 us each on the host."""
        f = len(nodes)
        slot = {node: start + r for r, node in enumerate(nodes)}
        mask = np.zeros((f, start + f), dtype=bool)
        for r, node in enumerate(nodes):
            cols = [slot.get(a, self.slots[a]) for a in self.ancestors(node)]
            if min(cols) < 0:
                raise ValueError(f"an ancestor of pool node {node} is not forwarded before it")
            mask[r, cols] = True
        return torch.from_numpy(mask)

    def mark_forwarded(self, nodes: Sequence[int], start: int, width: int) -> None:
        """`nodes` now have K/V at slots start + r; `width` slots from `start` are used."""
        for r, node in enumerate(nodes):
            self.slots[node] = start + r
        self.staged = start + width

    def add_children(self, nodes: Sequence[int], child_tokens: torch.Tensor,  # [F, k]
                     child_logp: torch.Tensor) -> list[list[int]]:  # [F, k] log-probabilities
        """Each forwarded node's top-k children join the pool; a child that a lookup chain put there
        already (`add_chain`) keeps its node, its score raised to the draft's where that is higher.
        Returns the children's ids, [F][k], in the columns' order."""
        toks, logp = child_tokens.tolist(), child_logp.tolist()
        out = []
        for r, node in enumerate(nodes):
            kids = self._kids.setdefault(node, [])
            base, depth = self.scores[node], self.depths[node] + 1
            known = {self.tokens[i]: i for i in kids}
            ids = []
            for tok, lp in zip(toks[r], logp[r]):
                score, i = base + float(lp), known.get(int(tok))
                if i is None:
                    i = known[int(tok)] = self._append(int(tok), score, node, depth)
                    kids.append(i)
                elif score > self.scores[i]:
                    self.scores[i] = score
                    if self.slots[i] < 0:
                        heapq.heappush(self._todo, (-score, depth, i))
                ids.append(i)
            out.append(ids)
        return out

    def _append(self, tok: int, score: float, parent: int, depth: int) -> int:
        i = len(self.tokens)
        self.tokens.append(tok)
        self.scores.append(score)
        self.parents.append(parent)
        self.depths.append(depth)
        self.slots.append(-1)
        heapq.heappush(self._todo, (-score, depth, i))
        return i

    def add_chain(self, tokens: Sequence[int], logp: float) -> int:
        """A context-lookup chain (docs/architecture.md, "Context lookup") below the root: it follows
        the pool's nodes while they carry its tokens, and its other tokens join as a path of new
        candidates, each scoring `logp` (< 0) below its parent, so that the background forwards
        reach them in their turn (parents first) and a verdict that runs through the chain finds
        its nodes forwarded. Returns the nodes added."""
        if not logp < 0:
            raise ValueError(f"a chain token's log-probability must be negative, got {logp}")
        path = self.walk(tokens)
        k = next((j for j, n in enumerate(path) if n is None), len(path))  # the first token not in the pool
        node = path[k - 1] if k else -1
        for tok in tokens[k:]:  # below a new node nothing is in the pool: the rest is new
            base, depth = (self.scores[node], self.depths[node] + 1) if node >= 0 else (0.0, 1)
            nxt = self._append(int(tok), base + logp, node, depth)
            self._kids.setdefault(node, []).append(nxt)
            node = nxt
        return len(tokens) - k

    def best_tree(self, n: int) -> tuple[list[int], list[int]]:
        """The best n nodes by path score, as a tree (tokens, parents) in topological order."""
        chosen = select_best_nodes(self.scores, self.depths, self.parents, n)
        return reindex_tree(chosen, self.tokens, self.parents)

    def outcome_trees(self, m: int, n: int) -> list[tuple[tuple[int, ...], list[int], list[int]]]:
        """The m likeliest verdicts whose next tree is ready, best first: forwarded nodes whose
        children have joined the pool, by path score (a verdict's probability under the draft), each
        as (its verdict's tokens: the path from the root's child down to it, the last one the bonus
        token; the next tree's tokens; its parents), the tree being what `reroot` at that verdict
        and `best_tree(n)` would give (the subtree's best n nodes, grown from the new root through
        forwarded nodes by a heap: O(n log n) a verdict, not O(subtree)). Twin: reroot + best_tree."""
        ready = [i for i, s in enumerate(self.slots) if s >= 0 and self._kids.get(i)]
        ready.sort(key=lambda i: (-self.scores[i], self.depths[i], i))
        out = []
        for b in ready[:m]:
            heap = [(-self.scores[c], self.depths[c], c) for c in self._kids[b]]
            heapq.heapify(heap)
            chosen: list[int] = []
            while heap and len(chosen) < n:
                _, _, c = heapq.heappop(heap)
                chosen.append(c)
                if self.slots[c] >= 0:
                    for g in self._kids.get(c, ()):
                        heapq.heappush(heap, (-self.scores[g], self.depths[g], g))
            pos = {c: k for k, c in enumerate(chosen)}
            out.append((tuple(self.tokens[a] for a in self.ancestors(b)), [self.tokens[c] for c in chosen],
                        [pos.get(self.parents[c], -1) for c in chosen]))
        return out

    def ready_depth(self) -> int:
        """Depth of the deepest node (how far ahead the pool reaches)."""
        return max(self.depths, default=0)

    def walk(self, tokens: Sequence[int]) -> list[Optional[int]]:
        """Node ids along `tokens` from the root (None from the first token not in the pool)."""
        out: list[Optional[int]] = []
        node = -1
        for tok in tokens:
            nxt = None
            if node is not None:
                nxt = next((i for i in self._kids.get(node, ()) if self.tokens[i] == tok), None)
            out.append(nxt)
            node = nxt
        return out

    def first_unforwarded(self, path: Sequence[Optional[int]]) -> Optional[int]:
        """Index of the first entry of `path` (walk's result) not in the pool or not forwarded;
        None when every node of it was forwarded."""
        return next((k for k, node in enumerate(path) if node is None or self.slots[node] < 0), None)

    def unstage(self) -> list[int]:
        """Forget every staged slot (the working cache was rebuilt); returns the nodes that were
        forwarded, in their old slot order (parents first), to forward again."""
        order = sorted((i for i, s in enumerate(self.slots) if s >= 0), key=lambda i: self.slots[i])
        self.slots = [-1] * len(self.slots)
        self.staged = 0
        self._reindex()
        return order

    def reroot(self, path: Sequence[int]) -> tuple["Pool", list[int], list[int]]:
        """The verdict's nodes `path` (accepted path + bonus, all forwarded) become committed; the new
        root is path[-1]. Returns the pool of its descendants and the staged slots to keep: first
        the committed ones (path order), then the kept descendants' (in the new pool's slot order)."""
        return self.reroot_ids(path)[:3]

    def reroot_ids(self, path: Sequence[int]) -> tuple["Pool", list[int], list[int], dict[int, int]]:
        """`reroot`, and the map old id -> new id of the nodes kept (the new root -> -1)."""
        root = path[-1]
        # the root's descendants whose parents are forwarded (or the root itself), in id order
        # (topological: parents come first), found through the children index
        found, stack = [], [root]
        while stack:
            p = stack.pop()
            if p == root or self.slots[p] >= 0:
                kids = self._kids.get(p, ())
                found.extend(kids)
                stack.extend(kids)
        found.sort()
        keep: dict[int, int] = {root: -1}  # old id -> new id
        base_score, base_depth = self.scores[root], self.depths[root]
        tokens, scores, parents, depths = [], [], [], []
        for new_id, i in enumerate(found):
            keep[i] = new_id
            tokens.append(self.tokens[i])
            scores.append(self.scores[i] - base_score)
            parents.append(keep[self.parents[i]])
            depths.append(self.depths[i] - base_depth)
        old_ids = sorted((i for i in found if self.slots[i] >= 0), key=lambda i: self.slots[i])
        slots = [-1] * len(found)
        staged_keep = []
        for slot, old in enumerate(old_ids):
            slots[keep[old]] = slot
            staged_keep.append(self.slots[old])
        new = Pool(tokens, scores, parents, depths, slots, len(staged_keep))
        return new, [self.slots[i] for i in path], staged_keep, keep
