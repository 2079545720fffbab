"""A batcher's rounds as JSON lines, for benchmarks that take a served burst apart (docs/architecture.md,
"Batched steps"): off unless the process's environment names a folder in `SPECEXTEND_ROUND_LOG`
(a served replica inherits it from the Ray driver that started the local cluster:
benchmarks/concurrency.py --round-log). Each round of `scheduler.Batcher.run_round` writes one line to
`<folder>/rounds-<pid>.jsonl`:

    {"t": wall clock at the round's start (time.time(), comparable across a host's processes),
     "s": the round's wall seconds, "sessions": admitted sessions, "drafts": draft steps the round
     issued, "wait_s": seconds it waited for them, "forwards": [[calls, rows, prompt chunks, wall
     seconds of the forward call], ...], "held": prompt chunks left for a later round,
     "advance_s": seconds the round's first pass over its sessions took (their host work on the last
     round's results, and any wait there for the device to finish that round's forward),
     "sync_s": where `SPECEXTEND_ROUND_LOG_SYNC=1` (a GPU), seconds the round's start waited for the
     device to finish what the process queued before it (then advance_s is host work alone),
     "regime": with the batch's governor (governor.py), the round's: free, plain or trees, or
     opening (held to trees while some session's draft still opened: every session stepped plainly),
     "tokens": the tokens the round's sessions emitted, "opening": sessions whose draft open (its
     prefill beside the target's, on one GPU) was under way at the round's end, "open_wait_s": where
     the round (held to trees) first waited for those opens (Batcher.wait_opens), its seconds}

A forward's wall seconds are the host's (on a GPU a replayed graph returns before the device is
done: the round's own wall time is what the sessions waited). Pure bookkeeping: nothing here
changes what a round does.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import Optional

ENV = "SPECEXTEND_ROUND_LOG"
SYNC_ENV = "SPECEXTEND_ROUND_LOG_SYNC"  # "1": each round begins by waiting for the device (perturbs: a probe)


class RoundLog:
    """One round's record while it runs; `write` appends it (a no-op when the log is off)."""

    def __init__(self, folder: Optional[str] = None) -> None:
        folder = os.environ.get(ENV) if folder is None else folder
        self.path = Path(folder) / f"rounds-{os.getpid()}.jsonl" if folder else None
        self.sync = bool(folder) and os.environ.get(SYNC_ENV) == "1"
        self._file = None
        self.rec: dict = {}
        self._t0 = 0.0

    @property
    def on(self) -> bool:
        return self.path is not None

    def begin(self, sessions: int, device=None) -> None:
        """`device`: the model's (torch.device); with SPECEXTEND_ROUND_LOG_SYNC=1 a CUDA device is
        synchronised first and the wait recorded as sync_s."""
        if self.on:
            self._t0 = time.perf_counter()
            self.rec = dict(t=time.time(), sessions=sessions, drafts=0, wait_s=0.0, forwards=[], held=0,
                            advance_s=0.0)
            if self.sync and device is not None and device.type == "cuda":
                import torch

                torch.cuda.synchronize(device)
                self.rec["sync_s"] = time.perf_counter() - self._t0

    def regime(self, name: str) -> None:
        """The governor's regime for this round (governor.FREE, PLAIN, TREES)."""
        if self.on:
            self.rec["regime"] = name

    def advanced(self, since: float) -> None:
        """The round's first pass over its sessions began at perf_counter() `since` and ends now."""
        if self.on:
            self.rec["advance_s"] = time.perf_counter() - since

    def drafts(self, issued: int, wait_s: float) -> None:
        if self.on:
            self.rec["drafts"], self.rec["wait_s"] = issued, self.rec["wait_s"] + wait_s

    def opens_waited(self, seconds: float) -> None:
        """The round waited `seconds` for draft opens before its steps (Batcher.wait_opens)."""
        if self.on:
            self.rec["open_wait_s"] = seconds

    def forward(self, calls: int, rows: int, chunks: int, seconds: float) -> None:
        if self.on:
            self.rec["forwards"].append([calls, rows, chunks, seconds])

    def write(self, held: int, tokens: int = 0, opening: int = 0) -> None:
        if not self.on or not self.rec:
            return
        self.rec["s"], self.rec["held"], self.rec["tokens"] = time.perf_counter() - self._t0, held, tokens
        self.rec["opening"] = opening
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", buffering=1)  # (a line at a time: a killed replica keeps its rounds)
        self._file.write(json.dumps(self.rec) + "\n")
        self.rec = {}

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read(folder: str, since: float = 0.0, until: float = float("inf")) -> list[dict]:
    """Every round logged under `folder` that began within [since, until), by start time."""
    rounds = []
    for path in Path(folder).glob("rounds-*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:  # (a line cut by a killed process)
                continue
            if since <= r["t"] < until:
                rounds.append(r)
    return sorted(rounds, key=lambda r: r["t"])


def summary(rounds: list[dict]) -> dict:
    """What a window of rounds did: how many, their wall seconds in all, the draft waits in them, the
    rounds that carried prompt chunks and their seconds, mean sessions and forward rows a round, the
    tokens emitted, the rounds in each of the governor's regimes and (`by_regime`) their seconds and
    tokens, and the rounds with a draft open under way (`opening_rounds`) and their seconds."""
    if not rounds:
        return dict(rounds=0)
    chunked = [r for r in rounds if any(f[2] for f in r["forwards"])]
    n = len(rounds)
    opening = [r for r in rounds if r.get("opening")]
    regimes = dict(Counter(r["regime"] for r in rounds if "regime" in r))  # (none without a governor)
    by_regime = {g: dict(s=sum(r["s"] for r in rounds if r.get("regime") == g),
                         tokens=sum(r.get("tokens", 0) for r in rounds if r.get("regime") == g)) for g in regimes}
    return dict(rounds=n, round_s=sum(r["s"] for r in rounds), wait_s=sum(r["wait_s"] for r in rounds),
                chunk_rounds=len(chunked), chunk_round_s=sum(r["s"] for r in chunked),
                advance_s=sum(r.get("advance_s", 0.0) for r in rounds), sync_s=sum(r.get("sync_s", 0.0) for r in rounds),
                sessions=sum(r["sessions"] for r in rounds) / n, drafts=sum(r["drafts"] for r in rounds) / n,
                rows=sum(f[1] for r in rounds for f in r["forwards"]) / n,
                span_s=rounds[-1]["t"] + rounds[-1]["s"] - rounds[0]["t"], regimes=regimes,
                tokens=sum(r.get("tokens", 0) for r in rounds), by_regime=by_regime,
                opening_rounds=len(opening), opening_s=sum(r["s"] for r in opening))
