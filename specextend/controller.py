"""Speculation that never loses: a per-session choice, step by step, between a speculative step (draft
a tree, verify it) and a plain decoding step (docs/architecture.md, "Adaptive speculation").

The controller measures online what each kind of step costs at this session's context length and
what a speculative step yields (tokens per step), as exponentially weighted averages, and
speculates while that pays: tokens_per_spec_step / spec_step_s >= 1 / plain_step_s. While it
does not, it probes (one speculative step) after enough plain steps that probes cost at most
about a tenth of the time (`probe_cost`: plain steps worth `probe_ratio` speculative steps); a
probe that still does not pay doubles the interval (up to `max_probe`), one that pays switches
speculation back on. The draft's state stays current while speculation is off: the next speculative step sends
it every token committed since, and it forwards them in one chunked forward. Lossless by
construction: a plain step is exactly plain decoding, and a speculative step is verified.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class TreeController:
    warmup: int = 2  # speculative steps measured before the first decision
    min_probe: int = 4  # plain steps before the first probe, at least
    probe_ratio: float = 10.0  # ... and at least this many speculative steps' worth of plain time
    max_probe: int = 1024
    alpha: float = 0.3  # weight of the newest measurement in the averages
    spec_s: Optional[float] = None  # seconds per speculative step (draft + verify + transport)
    spec_tokens: Optional[float] = None  # tokens per speculative step
    plain_s: Optional[float] = None  # seconds per plain step
    spec_steps: int = 0
    plain_steps: int = 0
    probe_steps: int = 0
    plain_run: int = 0  # plain steps since the last speculative one
    probe_every: int = 0  # 0: not decided yet
    _probing: bool = False

    def _base_interval(self) -> int:
        return max(self.min_probe, int(self.probe_ratio * self.spec_s / self.plain_s + 0.5))

    def pays(self) -> bool:
        """Does a speculative step yield at least as many tokens per second as plain decoding?"""
        if self.spec_s is None or self.plain_s is None:
            return True
        return self.spec_tokens * self.plain_s >= self.spec_s

    def speculate(self) -> bool:
        """The kind of the next step: True = speculative."""
        if self.spec_steps < self.warmup:
            return True
        if self.plain_s is None:
            return False  # measure one plain step
        if self.pays():
            return True
        if not self.probe_every:
            self.probe_every = self._base_interval()
        if self.plain_run >= self.probe_every:
            self._probing = True
            return True
        return False

    def record_spec(self, seconds: float, tokens: int) -> None:
        self.spec_s = _ewma(self.spec_s, seconds, self.alpha)
        self.spec_tokens = _ewma(self.spec_tokens, float(tokens), self.alpha)
        self.spec_steps += 1
        self.plain_run = 0
        if self._probing:
            self._probing = False
            self.probe_steps += 1
            self.probe_every = 0 if self.pays() else min(2 * self.probe_every, self.max_probe)

    def record_plain(self, seconds: float) -> None:
        self.plain_s = _ewma(self.plain_s, seconds, self.alpha)
        self.plain_steps += 1
        self.plain_run += 1


class AlwaysSpeculate:
    """tree_policy=fixed: every step speculative (the controller's interface, no decisions)."""

    spec_steps = plain_steps = probe_steps = 0

    def speculate(self) -> bool:
        return True

    def record_spec(self, seconds: float, tokens: int) -> None:
        self.spec_steps += 1

    def record_plain(self, seconds: float) -> None:
        self.plain_steps += 1


def _ewma(old: Optional[float], new: float, alpha: float) -> float:
    return new if old is None else (1 - alpha) * old + alpha * new
