"""The draft worker's jobs (jobs.py runs them) and the counts it reports (docs/architecture.md, "Draft side")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from specextend.draft.base import DraftSessionParams, Retrieval, TreeBound


@dataclass(frozen=True)
class Open:
    session_id: str
    prompt_ids: tuple[int, ...]  # [L]
    params: DraftSessionParams


@dataclass(frozen=True)
class Step:
    session_id: str
    step: int
    accepted_tokens: tuple[int, ...]
    retrieval: Optional[Retrieval] = None
    bound: Optional[TreeBound] = None  # this step's cap on the tree (base.py)


@dataclass(frozen=True)
class Close:
    session_id: str


@dataclass(frozen=True)
class Prepare:
    """base.py's `prepare`: apply the verdict (if any) as step `step`, answer `due_s` later."""

    session_id: str
    step: int
    accepted_tokens: tuple[int, ...]  # (): nothing to apply
    retrieval: Optional[Retrieval] = None
    due_s: float = 0.0


Job = Union[Open, Step, Close, Prepare]


@dataclass(frozen=True)
class WorkerStats:
    sessions: int
    background_forwards: int
    ready_trees: int  # steps answered from the overlap pool
    rebuilds: int = 0  # working-cache rebuilds of the sessions closed so far
    rebuild_s: float = 0.0  # their time, on the draft's device clock
    flight_steps: int = 0  # steps that arrived with a background forward in flight (sessions closed so far)
    flight_waits: int = 0  # ... of them ready steps that waited for it (their new root was in it)
    step_batches: int = 0  # batches of Step jobs run (a lone step is a batch of one)
    batched_steps: int = 0  # Step jobs in them
    step_forwards: int = 0  # forwards the steps ran (each carrying one or more sessions' calls)
    step_calls: int = 0  # calls those forwards carried
    chained_nodes: int = 0  # pool nodes forwarded in chained levels (chain.py, Chained; sessions closed so far)
    dropped_levels: int = 0  # chained levels dropped by a re-root before they were attached (same)
    # where the worker thread's time went (seconds): foreground jobs, the host side of background
    # slices (launch and finish), polling the job queue with a slice in flight, idle with nothing to do
    foreground_s: float = 0.0
    background_host_s: float = 0.0
    poll_s: float = 0.0
    idle_s: float = 0.0
