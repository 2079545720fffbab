"""The engine's link to its draft (docs/architecture.md, "Adaptive speculation", "Overlapped
drafting"): whether a draft is worth opening at all, a session's join once the draft's open is done,
the fallback to plain decoding on a DraftError, and a session's close after its last call in flight.
A mixin of Engine: it uses the engine's `config`, `draft` and `target`."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import Generator, Optional

from specextend.config import EngineConfig
from specextend.controller import SLOW_DRAFT, TreeController
from specextend.draft.base import DraftError
from specextend.models.args import ModelArgs
from specextend.scheduler import DraftCall
from specextend.stats import RequestStats

log = logging.getLogger("specextend.engine")


def settled(call: Optional[Future]) -> Generator[DraftCall, object, None]:
    """Waits for a draft call still in flight (a tell), if any, raising its DraftError; returns None
    (the caller's new value for it). Calls of a session go one at a time."""
    if call is not None:
        call.result() if call.done() else (yield DraftCall(future=call))
    return None


def seconds_of(fn, *args) -> float:
    """Calls fn(*args) and returns its wall time in seconds (the draft's open: its prefill)."""
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t


def draft_weight_ratio(target: ModelArgs, draft: Optional[ModelArgs]) -> float:
    """The weights a draft forward multiplies by over the target's (0.0: the draft's shape unknown)."""
    return draft.decode_weights() / target.decode_weights() if draft is not None else 0.0


def never_pays(config: EngineConfig, ratio: float) -> bool:
    """A draft `ratio` times the target's weights costs at least that many target forwards a tree
    level: from SLOW_DRAFT up no tree can beat a plain step, whatever it accepts, and the adaptive
    policy does not open it (the fixed policy drafts every step anyway)."""
    return config.uses_draft and config.tree_policy == "adaptive" and ratio >= SLOW_DRAFT


class DraftLink:
    config: EngineConfig
    draft: object  # DraftBackend

    def _join(self, opening: Future, ctl: TreeController, target_prefill_s: float, stats: RequestStats,
              sid: str) -> Generator[DraftCall, object, bool]:
        """The draft's open, finished (or waited for): whether the session speculates from now on (a
        failed open: plain decoding). Its time against the target's prefill of the same prompt is the
        controller's prior for what drafting costs (docs/architecture.md, "Adaptive speculation")."""
        try:
            open_s = opening.result() if opening.done() else (yield DraftCall(future=opening))
        except DraftError as e:
            return self._fall_back(stats, sid, e)
        stats.draft_open_s, stats.target_prefill_s = open_s, target_prefill_s
        ctl.seed_draft(open_s / max(target_prefill_s, 1e-9))
        return True


    def _fall_back(self, stats: RequestStats, sid: str, err: Exception) -> bool:
        log.warning("draft failed for session %s (%s); continuing with plain decoding", sid, err)
        stats.fallback = True
        self._close_draft(sid)
        return False

    def _close_after(self, sid: str, told: Optional[Future], opening: Future) -> None:
        if opening.exception() is not None:  # no session was opened
            return
        if told is None:
            self._close_draft(sid)
        else:
            told.add_done_callback(lambda _: self._close_draft(sid))

    def _close_draft(self, sid: str) -> None:
        try:
            self.draft.close(sid)
        except Exception as e:  # closing is best-effort; a dead draft has nothing left to free
            log.info("closing draft session %s failed: %s", sid, e)
