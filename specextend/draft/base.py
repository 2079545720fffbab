"""The one interface through which the target reaches its draft (in-process or over gRPC).

Protocol of a session (the target drives):
  open(session_id, prompt_ids, params)          the draft prefills the prompt
  step(session_id, step, accepted_tokens, retrieval, bound) -> DraftTree
      step 0 carries the first generated token; step k>0 carries the tokens committed by
      verification k-1 (accepted path + bonus token). The last accepted token is the next root.
      `retrieval` (chunk ids over the committed context) arrives every few steps, may be late,
      dropped or repeated: it only changes which chunks the draft keeps, never the output.
      `bound` (the target's adaptive policy, controller.py) caps this step's tree below the
      session's tree config; the tree is sent best first, so any prefix of it is a smaller tree.
      A step with the same number as the last applied one is a retry: it returns the same tree
      and applies nothing twice.
  close(session_id)                             frees everything of the session (idempotent)

The draft side runs these as jobs on one worker (worker.py): open, step and close in arrival
order, and, with overlap on, background drafting between them that any arriving job pre-empts.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Optional, Sequence

from specextend.config import RetrievalConfig, TreeConfig


class DraftError(RuntimeError):
    """Any failure of the draft (dead actor, RPC error, deadline, bad session).

    The engine reacts to it by falling back to plain decoding for the request."""


class DraftSessionNotFound(DraftError):
    pass


class DraftStepOutOfOrder(DraftError):
    pass


@dataclass(frozen=True)
class DraftSessionParams:
    tree: TreeConfig = field(default_factory=TreeConfig)
    retrieval: RetrievalConfig = field(default_factory=RetrievalConfig)
    max_new_tokens: int = 64  # bounds the draft's cache allocation


@dataclass(frozen=True)
class Retrieval:
    chunk_ids: tuple[int, ...]  # selected chunks of the committed context, document order
    chunk_size: int


@dataclass(frozen=True)
class TreeBound:
    """One step's cap on the tree (docs/architecture.md, "Adaptive speculation"): at most `nodes`
    nodes, at most `depth` levels; 0 keeps the session's own setting."""

    nodes: int = 0
    depth: int = 0

    def apply(self, tree: TreeConfig) -> TreeConfig:
        return TreeConfig(nodes=min(tree.nodes, self.nodes or tree.nodes),
                          depth=min(tree.depth, self.depth or tree.depth), topk=tree.topk)


@dataclass(frozen=True)
class DraftTree:
    """Draft tree, best node first (by path score, docs/architecture.md, "Draft tree"), which is a
    topological order: tokens[:m], parents[:m] is the best m-node tree. parents[i] = index of node
    i's parent, -1 for the root."""

    step: int
    tokens: tuple[int, ...]  # [N]
    parents: tuple[int, ...]  # [N]
    draft_cache_tokens: int = 0  # working-cache size the draft drafted with (metrics)
    ready: bool = False  # answered from the overlap pool (drafted while the target verified)
    ahead_depth: int = 0  # depth of the ready pool below the new root when answered (0: not ready)
    # timing, not part of the tree (equality ignores it): the draft's time on the step from its arrival
    # to its answer (0: not measured), and how much of it the step waited for the draft's thread
    server_s: float = field(default=0.0, compare=False)
    queued_s: float = field(default=0.0, compare=False)


class DraftBackend(abc.ABC):
    @abc.abstractmethod
    def open(self, session_id: str, prompt_ids: Sequence[int], params: DraftSessionParams) -> None: ...

    @abc.abstractmethod
    def step(
        self,
        session_id: str,
        step: int,
        accepted_tokens: Sequence[int],
        retrieval: Optional[Retrieval] = None,
        bound: Optional[TreeBound] = None,
    ) -> DraftTree: ...

    @abc.abstractmethod
    def close(self, session_id: str) -> None: ...

    def health(self) -> bool:
        return True
