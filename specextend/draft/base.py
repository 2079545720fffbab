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
      With `bound.ready_only` a draft that overlaps answers from its pool or, when nothing is
      ready, at once with an empty tree, and catches up after answering; the target then decodes
      one token plainly (docs/architecture.md, "Overlapped drafting"). A draft without overlap
      ignores it.
      A step with the same number as the last applied one is a retry: it returns the same tree
      and applies nothing twice.
  close(session_id)                             frees everything of the session (idempotent)

A backend may also begin a step without blocking the caller (an early ask from the engine's thread):
  start_step(...same as step...) -> Future[DraftTree] | None
      the step sent or queued now, its tree (or error) in the future, with its times (`submitted`,
      `started`, `ended`); None where it cannot begin one without waiting (the caller then calls
      `step` on a thread of its own).

With overlapped drafting a backend may also prepare the next tree before the verdict
(`supports_prepare`, docs/architecture.md, "Prepared outcomes"):
  prepare(session_id, step, accepted_tokens, retrieval, due_s) -> Future[Outcomes]
      sent right after the target queues a verification: applies `accepted_tokens` as step `step`
      (as `step` would, its tree unused; nothing when empty: the last step already applied them),
      keeps drafting ahead, and answers `due_s` after its arrival (or when it has nothing left to
      draft) with the trees it has ready for the likeliest verdicts of that verification. A
      verdict among them needs no step call: its tree is there, and the verdict travels with the
      next prepare; any other verdict takes a step call as before.

The draft side runs these as jobs on one worker (worker.py): open, step and close in arrival
order, and, with overlap on, background drafting between them that any arriving job pre-empts.
"""

from __future__ import annotations

import abc
import functools
from concurrent.futures import Future
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
    lookup_tokens: int = 0  # context-lookup chains of this length put into the overlap pool (0: none)


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
    ready_only: bool = False  # with overlap: a tree from the pool, or none at once (never drafted on the step's path)

    def apply(self, tree: TreeConfig) -> TreeConfig:
        """The session's tree within this cap (memoised: a validated TreeConfig is built once per
        cap and tree, not on every step's path, where building one took ~50 us of the ~250 us of a
        ready answer on the CPU)."""
        return _bounded(tree, self.nodes, self.depth)


@functools.lru_cache(maxsize=1024)
def _bounded(tree: TreeConfig, nodes: int, depth: int) -> TreeConfig:
    return TreeConfig(nodes=min(tree.nodes, nodes or tree.nodes), depth=min(tree.depth, depth or tree.depth),
                      topk=tree.topk)


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
    flight_s: float = field(default=0.0, compare=False)  # ... and for a background forward in flight that
    # held the answer's first level (a ready step: docs/architecture.md, "Overlapped drafting")


@dataclass(frozen=True)
class Outcomes:
    """A prepare's answer: for the likeliest verdicts of the tree being verified (each the accepted
    path's tokens + the bonus token), the next tree, as `step(session_id, self.step, verdict)`
    would answer it from the pool; likeliest first."""

    step: int  # the step number of the next verdict
    trees: tuple[tuple[tuple[int, ...], DraftTree], ...] = ()  # (verdict tokens, its tree)
    server_s: float = field(default=0.0, compare=False)  # the draft side's time from arrival to answer
    queued_s: float = field(default=0.0, compare=False)  # ... of which it waited for the draft's thread

    def get(self, verdict: Sequence[int]) -> Optional[DraftTree]:
        key = tuple(verdict)
        return next((tree for v, tree in self.trees if v == key), None)


class DraftBackend(abc.ABC):
    supports_prepare: bool = False  # `prepare` (overlapped drafting's prepared outcomes) is served

    @abc.abstractmethod
    def open(self, session_id: str, prompt_ids: Sequence[int], params: DraftSessionParams) -> Optional[float]:
        """Opens the session (prefills its prompt); -> the seconds the open itself ran on the draft,
        its wait in the draft's queue behind other jobs left out, or None where not known (the
        caller times the call: open_costs.open_seconds)."""

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

    def start_step(self, session_id: str, step: int, accepted_tokens: Sequence[int],
                   retrieval: Optional[Retrieval] = None, bound: Optional[TreeBound] = None) -> "Optional[Future]":
        """`step`, begun on the caller's thread and answered in a future (a DraftTree, or the step's
        error), with its times as attributes: `submitted` (called), `started` (sent on), `ended`
        (answered), perf_counter. None where this backend cannot begin a step without blocking:
        the caller then runs `step` on a thread of its own (docs/architecture.md, "Overlapped
        drafting", early asks)."""
        return None

    def prepare(self, session_id: str, step: int, accepted_tokens: Sequence[int], retrieval: Optional[Retrieval],
                due_s: float) -> "Future[Outcomes]":
        """See the module's docstring; only where `supports_prepare`."""
        raise NotImplementedError(f"{type(self).__name__} does not prepare outcomes")

    def health(self) -> bool:
        return True
