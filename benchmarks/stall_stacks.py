"""Where a slow round of the batcher spends its time: runs benchmarks/batching.py (its arguments
after `--`) with its round log on and a sampler thread that records the batcher thread's Python
stack every `--every-ms`; then, for each round that took longer than `--slow-ms`, prints the
stacks sampled inside it, most frequent first (docs/architecture.md, "Batched steps").

  SPECEXTEND_ROUND_LOG=/tmp/rl python benchmarks/stall_stacks.py --slow-ms 50 -- \
      --target random:llama-68m --draft random:llama-68m --device cpu --sessions 4 --modes specextend

A round log line's `t` is its start on the wall clock (time.time()), as the samples' are. Prefill
rounds (any prompt chunk in a forward) are skipped: they are slow by design.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import batching  # noqa: E402

DEPTH = 14  # innermost frames kept per sample


class Sampler(threading.Thread):
    """Samples the stacks of the threads named `name` every `every_s` seconds."""

    def __init__(self, name: str, every_s: float) -> None:
        super().__init__(daemon=True, name="stall-sampler")
        self.target_name, self.every_s = name, every_s
        self.samples: list[tuple[float, tuple[str, ...]]] = []  # (time.time(), innermost frames last)
        self._stop_ev = threading.Event()

    def run(self) -> None:
        while not self._stop_ev.wait(self.every_s):
            idents = {t.ident for t in threading.enumerate() if t.name == self.target_name}
            now = time.time()
            for ident, frame in sys._current_frames().items():
                if ident in idents:
                    stack = traceback.extract_stack(frame)[-DEPTH:]
                    self.samples.append((now, tuple(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in stack)))

    def stop(self) -> None:
        self._stop_ev.set()
        self.join()


def slow_rounds(folder: Path, slow_s: float) -> list[dict]:
    """The round log's decode rounds (no prompt chunk) that took more than `slow_s`."""
    out = []
    for path in sorted(folder.glob("rounds-*.jsonl")):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            if r["s"] > slow_s and not any(f[2] for f in r["forwards"]):
                out.append(r)
    return out


def report(rounds: list[dict], samples: list, top: int) -> list[dict]:
    """Each slow round with its most frequent sampled stacks (printed; returned for the JSON)."""
    rows = []
    for r in rounds:
        inside = [s for t, s in samples if r["t"] <= t <= r["t"] + r["s"]]
        common = collections.Counter(inside).most_common(top)
        print(f"round at {r['t']:.3f}: {1e3 * r['s']:.1f} ms, advance {1e3 * r['advance_s']:.1f} ms, "
              f"regime {r.get('regime', '-')}, tokens {r['tokens']}, {len(inside)} samples")
        for stack, n in common:
            print(f"  {n:4d} x " + "\n         ".join(stack[-8:]))
        rows.append(dict(round=r, stacks=[dict(count=n, frames=list(s)) for s, n in common]))
    return rows


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, rest = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--slow-ms", type=float, default=50.0)
    p.add_argument("--every-ms", type=float, default=2.0)
    p.add_argument("--top", type=int, default=3)
    p.add_argument("--out", default="", help="the slow rounds and their stacks as JSON")
    a = p.parse_args(own)
    folder = os.environ.get("SPECEXTEND_ROUND_LOG")
    if not folder:
        p.error("set SPECEXTEND_ROUND_LOG to a folder: the slow rounds are read from the round log")
    sampler = Sampler("batcher", a.every_ms / 1e3)
    sampler.start()
    try:
        batching.main(rest)
    finally:
        sampler.stop()
    rows = report(slow_rounds(Path(folder), a.slow_ms / 1e3), sampler.samples, a.top)
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
