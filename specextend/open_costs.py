"""What a draft's open (its prefill of a session's prompt) is expected to cost, from the opens timed
so far (docs/architecture.md, "Adaptive speculation", *Deferred open*).

An open's seconds are not proportional to its prompt's length: a short prompt's are mostly fixed
costs (launches, the session's set-up), a long one's the prefill's arithmetic. Scaling a 16-token
open's seconds per token to a 16K prompt priced that open at seconds where it takes 158-180 ms
(the 0.5B draft on an H200, 2026-12-03): a deferred open never came due, and the batch's governor held
sessions to trees that could not open. So each open is kept by its prompt's length (the latest per
power-of-two bucket), and a prompt is priced only from an open within SPAN times its length,
scaled by the ratio of lengths; with none that near, the cost is unknown (None) and the caller
behaves as before any open was timed (it opens at once, and the open times its own length).
"""

from __future__ import annotations

import math
import time
from typing import Optional

SPAN = 4.0  # an open prices prompts up to this many times longer or shorter than its own


class OpenCosts:
    """The opens timed so far, by prompt length: `record` one, `seconds` for a prompt's expected."""

    def __init__(self) -> None:
        self._by_bucket: dict[int, tuple[int, float]] = {}  # log2 bucket -> (prompt tokens, seconds)

    def record(self, tokens: int, seconds: float) -> None:
        tokens = max(int(tokens), 1)
        self._by_bucket[tokens.bit_length()] = (tokens, max(float(seconds), 0.0))

    def seconds(self, tokens: int) -> Optional[float]:
        """Expected seconds of an open of a `tokens`-token prompt: the timed open nearest in length
        (by ratio), scaled by the ratio, if within SPAN; else None (unknown)."""
        tokens = max(int(tokens), 1)
        best = min(self._by_bucket.values(), key=lambda ts: abs(math.log(ts[0] / tokens)), default=None)
        if best is None or max(best[0] / tokens, tokens / best[0]) > SPAN:
            return None
        return best[1] * tokens / best[0]

    def timed(self) -> dict[int, float]:
        """The opens kept, seconds by prompt tokens (benchmarks' records)."""
        return dict(sorted(self._by_bucket.values()))

    @property
    def known(self) -> bool:
        """Whether any open has been timed."""
        return bool(self._by_bucket)


def open_seconds(open_fn, *args) -> float:
    """Calls the draft's open, open_fn(*args); -> the seconds the open itself ran where the draft
    reports them (DraftBackend.open: not its wait in the draft's queue behind other sessions' opens,
    which a burst's opens, run one at a time, would add to each and so overprice the next ones),
    else the call's wall time."""
    t = time.perf_counter()
    ran = open_fn(*args)
    wall = time.perf_counter() - t
    return ran if isinstance(ran, float) and 0.0 < ran <= wall else wall


FIRST_TIMED = 1024  # the shortest prompt the start-up's opens time (warmup.warm_opens)


def open_lengths(limit: int, first: int = FIRST_TIMED) -> list[int]:
    """Prompt lengths whose opens, timed at start-up, price every prompt from `first` / SPAN up to
    `limit` tokens: `first`, then SPAN times longer each, while within `limit` (each prices within
    SPAN of its length, so the next one past the limit is not needed; nor would its capped twin
    keep its own bucket in OpenCosts); `limit` alone where it is shorter than `first`."""
    if limit < 1:
        return []
    out, n = [], min(first, limit)
    while n <= limit:
        out.append(n)
        n = int(n * SPAN)
    return out
