"""One request's state on the draft side: caches, retrieval selection, tree drafting.

Caches (DESIGN 3.4): `work` is the working cache the draft attends over (rotated K, positions
renumbered 0..W-1); with retrieval on, `store` keeps every committed token's pre-RoPE K and its V
at true positions, and the working cache is rebuilt from it when a new selection arrives. Without
retrieval the working cache is simply the full cache.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence

import torch

from specextend.attention.backends import CAUSAL
from specextend.draft.base import DraftSessionParams, DraftTree, Retrieval
from specextend.draft.expand import PostGraphs, expand_tree, level_post
from specextend.kv_cache import CacheFull
from specextend.models.decoder import Decoder, ForwardOptions
from specextend.models.rope import apply_rope
from specextend.retrieval import chunk_positions, initial_chunks
from specextend.tree import children_of, reindex_tree, select_best_nodes


@dataclass(frozen=True)
class Speculation:
    """A next step drafted ahead of its request (pipelined drafting, DESIGN 4)."""

    path: tuple[int, ...]  # the guess: the target accepts the tree's best branch ...
    bonus: Optional[int]  # ... then emits the draft's own next token (None until computed)
    tree: Optional[DraftTree]  # drafted for that guess; None until done, or if abandoned
    work_length: int  # cache lengths before the guess was committed (rollback)
    store_length: int

    def may_match(self, accepted: Sequence[int]) -> bool:
        """Could these accepted tokens be the guess (as far as it is known yet)?"""
        acc = tuple(accepted)
        return acc[:-1] == self.path and (self.bonus is None or acc[-1] == self.bonus)


def best_branch(tree: DraftTree) -> list[int]:
    """Tokens along the first-child chain from the root (the draft's best branch)."""
    children = children_of(tree.parents)
    out, row = [], 0
    while children[row]:
        node = children[row][0]
        out.append(tree.tokens[node])
        row = node + 1
    return out


_POST_LOCK = threading.Lock()


class DraftSession:
    expand = staticmethod(expand_tree)  # the tree search (expand_tree_host: its twin)

    def __init__(self, model: Decoder, prompt_ids: Sequence[int], params: DraftSessionParams,
                 prefill_chunk: int = 2048):
        self.model = model
        self.params = params
        self.cfg = params.retrieval
        tree = params.tree
        extra = params.max_new_tokens + tree.depth * tree.topk + tree.depth + 8
        self.work = model.new_cache(len(prompt_ids) + extra)
        self.store = model.new_cache(len(prompt_ids) + extra) if self.cfg.enabled else None
        self.refreshes = 0
        self.speculation: Optional[Speculation] = None
        self.pipeline_hits = 0
        self._prefill(list(prompt_ids), prefill_chunk)

    # ----------------------------------------------------------------- caches
    def _forward_committed(self, ids: list[int], window: int = 0) -> torch.Tensor:
        """Forward committed tokens (causal), append them to both caches; logits of the last [V]."""
        dev = self.model.device
        t = len(ids)
        pos = torch.arange(self.work.length, self.work.length + t, device=dev)
        logits, _ = self.model.forward(
            torch.tensor(ids, device=dev), pos, self.work, CAUSAL,
            ForwardOptions(window=window, store=self.store, logits_rows=torch.tensor([t - 1], device=dev)))
        self.work.advance(t)
        if self.store is not None:
            self.store.advance(t)
        return logits[0]

    def _prefill(self, prompt: list[int], chunk: int) -> None:
        for lo in range(0, len(prompt), chunk):
            self._forward_committed(prompt[lo:lo + chunk], window=self.cfg.draft_prefill_window)
        if self.store is not None and len(prompt) > self.cfg.budget_tokens:
            self._rebuild(initial_chunks(len(prompt), self.cfg), self.cfg.chunk_size)

    def _rebuild(self, chunk_ids: Sequence[int], chunk_size: int) -> None:
        """Working cache := the stored tokens of the selected chunks, re-rotated at 0..W-1."""
        pos = chunk_positions(chunk_ids, chunk_size, self.store.length).to(self.model.device)  # [W]
        kv = self.store.data.index_select(3, pos)  # [layers, 2, G, W, D]
        cos, sin = self.model.rope.cos_sin(torch.arange(pos.numel(), device=pos.device), self.model.dtype)
        self.work.load(apply_rope(kv[:, 0], cos, sin), kv[:, 1])
        self.refreshes += 1

    @property
    def cache_tokens(self) -> int:
        return self.work.length

    # ----------------------------------------------------------------- step
    def step(self, step: int, accepted_tokens: Sequence[int], retrieval: Optional[Retrieval]) -> DraftTree:
        """Commit the accepted tokens (the last is the next root) and draft the next tree.
        A speculation that guessed these tokens (and no retrieval to apply) answers at once;
        any other is rolled back first."""
        if not accepted_tokens:
            raise ValueError("a step needs at least the bonus token")
        refresh = retrieval is not None and self.store is not None and bool(retrieval.chunk_ids)
        spec, self.speculation = self.speculation, None
        if spec is not None:
            if spec.tree is not None and not refresh and spec.may_match(accepted_tokens):
                self.pipeline_hits += 1
                return DraftTree(step=step, tokens=spec.tree.tokens, parents=spec.tree.parents,
                                 draft_cache_tokens=spec.tree.draft_cache_tokens, pipelined=True)
            self._rollback(spec)
        if refresh:
            self._rebuild(retrieval.chunk_ids, retrieval.chunk_size)
        root_logits = self._forward_committed(list(accepted_tokens))
        tokens, parents = self._draft_tree(root_logits)
        return DraftTree(step=step, tokens=tuple(tokens), parents=tuple(parents),
                         draft_cache_tokens=self.work.length)

    def speculate(self, tree: DraftTree, should_stop: Callable[[], bool] = lambda: False) -> None:
        """Draft the step after `tree` ahead of its request, guessing that the target accepts the
        tree's best branch and then emits the draft's own next token. Checked between forwards,
        `should_stop()` abandons the work (rolled back at the next step). Any tree is verified by
        the target, so a wrong guess costs time, never correctness."""
        if self.speculation is not None:
            return
        path = tuple(best_branch(tree))
        spec = Speculation(path, None, None, self.work.length, self.store.length if self.store is not None else 0)
        self.speculation = spec
        try:
            if not path or should_stop():
                return
            bonus = int(torch.argmax(self._forward_committed(list(path))))
            self.speculation = spec = replace(spec, bonus=bonus)
            if should_stop():
                return
            drafted = self._draft_tree(self._forward_committed([bonus]), should_stop)
        except CacheFull:  # near the end of the request's budget: no room to guess ahead
            return
        if drafted is not None:
            tokens, parents = drafted
            self.speculation = replace(spec, tree=DraftTree(
                step=tree.step + 1, tokens=tuple(tokens), parents=tuple(parents),
                draft_cache_tokens=self.work.length))

    def _rollback(self, spec: Speculation) -> None:
        self.work.truncate(spec.work_length)
        if self.store is not None:
            self.store.truncate(spec.store_length)

    def _post(self):
        """The expansion's per-level bookkeeping: CUDA graphs where the model's forwards are graphed
        (made once per model, shared by its sessions), else op by op."""
        m = self.model
        if m.graphs is None or not m.graphs.capture:
            return level_post
        with _POST_LOCK:
            if m.post_graphs is None:
                m.post_graphs = PostGraphs(m.device)
        return m.post_graphs

    def _draft_tree(self, root_logits: torch.Tensor,
                    should_stop: Callable[[], bool] = lambda: False) -> Optional[tuple[list[int], list[int]]]:
        """Dynamic tree (EAGLE-2 style, draft/expand.py), then the best `nodes` of its pool."""
        def forward(ids, positions, mask, staged):
            return self.model.forward(ids, positions, self.work, mask, ForwardOptions(staged=staged))[0]

        pool = self.expand(forward, root_logits, self.params.tree, self.work.length - 1, should_stop,
                           post=self._post())
        if pool is None:
            return None
        toks, scores, parents, depths = pool
        chosen = select_best_nodes(scores, depths, parents, self.params.tree.nodes)
        return reindex_tree(chosen, toks, parents)
