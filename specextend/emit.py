"""What a decode step hands its caller: the tokens it emitted, cut exactly where plain decoding
would stop (a stop token, max_new_tokens), and the request's stats so far."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from specextend.config import SamplingParams
from specextend.stats import RequestStats


@dataclass
class StepEvent:
    token_ids: list[int]  # tokens emitted by this step (possibly empty)
    finish_reason: Optional[str]  # None, "stop" or "length"
    stats: RequestStats


class Emitter:
    """Appends tokens in order and cuts exactly where plain decoding would stop."""

    def __init__(self, params: SamplingParams, eos_ids: Sequence[int], stats: RequestStats):
        self.params = params
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
        self.stats = stats
        self.finish: Optional[str] = None

    def ends(self, tokens: Sequence[int]) -> bool:
        """Whether emitting `tokens` would finish the request (nothing emitted yet)."""
        return (any(t in self.stop_ids for t in tokens)
                or self.stats.num_generated + len(tokens) >= self.params.max_new_tokens)

    def emit(self, tokens: Sequence[int]) -> StepEvent:
        out = []
        for tok in tokens:
            out.append(tok)
            self.stats.num_generated += 1
            if tok in self.stop_ids:
                self.finish = "stop"
            elif self.stats.num_generated >= self.params.max_new_tokens:
                self.finish = "length"
            if self.finish:
                break
        return StepEvent(out, self.finish, self.stats)
