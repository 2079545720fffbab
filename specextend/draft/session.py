"""One request's state on the draft side: caches, retrieval selection, tree drafting.

Caches (DESIGN 3.4): `work` is the working cache the draft attends over (rotated K, positions
renumbered 0..W-1); with retrieval on, `store` keeps every committed token's pre-RoPE K and its V
at true positions, and the working cache is rebuilt from it when a new selection arrives. Without
retrieval the working cache is simply the full cache.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from specextend.attention.backends import CAUSAL
from specextend.draft.base import DraftSessionParams, DraftTree, Retrieval
from specextend.models.decoder import Decoder, ForwardOptions
from specextend.models.rope import apply_rope
from specextend.retrieval import chunk_positions, initial_chunks
from specextend.tree import reindex_tree, select_best_nodes


class DraftSession:
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
        """Commit the accepted tokens (the last is the next root) and draft the next tree."""
        if not accepted_tokens:
            raise ValueError("a step needs at least the bonus token")
        if retrieval is not None and self.store is not None and retrieval.chunk_ids:
            self._rebuild(retrieval.chunk_ids, retrieval.chunk_size)
        root_logits = self._forward_committed(list(accepted_tokens))
        tokens, parents = self._draft_tree(root_logits)
        return DraftTree(step=step, tokens=tuple(tokens), parents=tuple(parents),
                         draft_cache_tokens=self.work.length)

    def _draft_tree(self, root_logits: torch.Tensor) -> tuple[list[int], list[int]]:
        """Dynamic tree (EAGLE-2 style): expand the global top-k frontier depth by depth."""
        cfg = self.params.tree
        dev = self.model.device
        k = cfg.topk
        logp = torch.log_softmax(root_logits.float(), -1)
        top = torch.topk(logp, k)
        # candidate pool (parallel lists); slot = staged offset once forwarded, else -1
        toks: list[int] = top.indices.tolist()
        scores: list[float] = top.values.tolist()
        parents: list[int] = [-1] * k
        depths: list[int] = [1] * k
        slots: list[int] = [-1] * k
        frontier = list(range(k))
        staged = 0
        base = self.work.length - 1  # the root's position
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
            logits, _ = self.model.forward(
                torch.tensor([toks[c] for c in frontier], device=dev),
                torch.full((f,), base + d, device=dev), self.work, mask.to(dev),
                ForwardOptions(staged=staged))
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
        chosen = select_best_nodes(scores, depths, parents, self.params.tree.nodes)
        return reindex_tree(chosen, toks, parents)
