"""Why the adaptive policy trails the best fixed tree at equal steps: each configuration's steps of
one replayed regime, side by side (kind, tree, tokens, wall ms, draft wait, target forward time),
and the host time outside the steps (docs/architecture.md, "Adaptive speculation").

Builds the engines as benchmarks/regimes.py does (one draft worker, every shape warmed up), runs
`--reps` interleaved requests of each configuration and prints per configuration: decode tokens/s,
steps, the mean of each step's parts, the rungs chosen (adaptive) and the time between steps.

    python benchmarks/regime_trace.py --device cuda --regime "8b replayed 5" --configs adaptive,8x6,16x6
"""

from __future__ import annotations

import argparse
import logging
import time
import statistics
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

from specextend import controller, stats
from specextend.bench import record
from specextend.bench.texts import documents, prompt_ids
from specextend.builder import draft_worker, load_pair
from specextend.config import EngineConfig, SamplingParams, TreeConfig
from specextend.draft.worker import DraftWorker
from specextend.engine import Engine
from specextend.models import late_work
from specextend.warmup import warm_long, warm_up

from regimes import ALL_REGIMES  # this folder (on the path when run as a script)

OUT = Path(__file__).parent / "results" / "regimes" / "trace"


def hook(log: list) -> None:
    """Records each choice of the adaptive policy and each step's parts into `log`."""
    choose, done = controller.TreeController.choose, stats.RequestStats.step_done

    def traced_choose(self, sessions: int = 1):
        rung = choose(self, sessions)
        if type(self) is controller.TreeController:
            log.append(dict(ev="choice", nodes=rung.nodes, depth=rung.depth, plain=rung.plain,
                            probe=bool(self._probing), predicted_ms=self.step_seconds(rung) * 1e3))
        return rung

    def traced_done(self, kind, tokens, seconds, wait_s=0.0, forward_s=0.0):
        log.append(dict(ev="step", kind=kind, tokens=tokens, ms=seconds * 1e3, wait_ms=wait_s * 1e3,
                        forward_ms=forward_s * 1e3))
        return done(self, kind, tokens, seconds, wait_s, forward_s)

    controller.TreeController.choose, stats.RequestStats.step_done = traced_choose, traced_done


class _Late(logging.Handler):
    """Collects late work (models/late_work.py: captures, compiles, collections after the warm-up)."""

    def __init__(self, items: list) -> None:
        super().__init__(logging.WARNING)
        self.items = items

    def emit(self, record: logging.LogRecord) -> None:
        self.items.append(record.getMessage()[:160])


def time_jobs(slow: list, floor_s: float = 0.02) -> None:
    """Records the draft worker's jobs that took `floor_s` or more (their type and ms) into `slow`."""
    do = DraftWorker._do

    def timed(self, job):
        t = time.perf_counter()
        try:
            return do(self, job)
        finally:
            dt = time.perf_counter() - t
            if dt >= floor_s:
                slow.append(f"{type(job).__name__} {dt * 1e3:.1f} ms")

    DraftWorker._do = timed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--regime", default="8b replayed 5", choices=sorted(ALL_REGIMES))
    p.add_argument("--configs", default="adaptive,8x6", help="adaptive, and fixed trees as NxD")
    p.add_argument("--device", default="cuda")
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--fresh", action="store_true",
                   help="every request a prompt no cache has seen (the prompt rotated by a different offset)")
    p.add_argument("--warm", default="app", choices=("app", "short", "full"),
                   help="warm each engine as regimes.py and a served replica do (the prompt's first 64 tokens, "
                        "then warm_long), on those 64 tokens alone, or on the whole prompt")
    a = p.parse_args(argv)
    target_name, draft_name, doc, replay, *own = ALL_REGIMES[a.regime]
    base = EngineConfig(target=target_name, draft=draft_name, mode="specextend", device=a.device,
                        dtype="float32" if a.device == "cpu" else "bfloat16")
    target, draft = load_pair(base)
    worker = draft_worker(replace(base, tree=TreeConfig(nodes=32, depth=6)), draft)
    prompt = prompt_ids(target.tokenizer, documents([doc])[0], own[0] if own else a.length)
    engines = {}
    for c in a.configs.split(","):
        if c == "adaptive":
            cfg = replace(base, tree=TreeConfig(nodes=32, depth=6), tree_policy="adaptive")
        else:
            n, d = map(int, c.split("x"))
            cfg = replace(base, tree=TreeConfig(nodes=n, depth=d), tree_policy="fixed")
        engines[c] = Engine(cfg, target, worker, draft_args=draft.args)
    for e in engines.values():
        warm_up(e, prompt if a.warm == "full" else prompt[:64])
        if a.warm == "app":
            warm_long(e, prompt[:64])
        e.forget_text(), e.forget_costs()
    log: list = []
    hook(log)
    late: list = []
    logging.getLogger(late_work.__name__).addHandler(_Late(late))
    late_work.mark_ready()
    slow: list = []
    time_jobs(slow)
    params = SamplingParams(max_new_tokens=a.new_tokens, ignore_eos=True)
    out = []
    for rep in range(a.reps):
        for c, e in engines.items():
            log.clear(), late.clear(), slow.clear()
            k = 97 * (rep * len(engines) + len(out) % len(engines)) + 1 if a.fresh else 0
            ids, _, st = e.generate(prompt[k:] + prompt[:k], params, replay=replay)
            steps = [x for x in log if x["ev"] == "step"]
            choices = [x for x in log if x["ev"] == "choice"]
            rate = (st.num_generated - 1) / st.decode_s
            in_steps = sum(s["ms"] for s in steps)
            kinds = {}
            for k in sorted({s["kind"] for s in steps}):
                ks = [s for s in steps if s["kind"] == k]
                kinds[k] = dict(n=len(ks), tokens=sum(s["tokens"] for s in ks) / len(ks),
                                ms=statistics.mean(s["ms"] for s in ks),
                                wait_ms=statistics.mean(s["wait_ms"] for s in ks),
                                forward_ms=statistics.mean(s["forward_ms"] for s in ks),
                                max_ms=max(s["ms"] for s in ks))
            trees = [s for s in steps if s["kind"] == "tree"]
            first = f"first tree {trees[0]['ms']:.1f} ms (wait {trees[0]['wait_ms']:.1f}); " if trees else ""
            rungs = Counter(("plain" if x["plain"] else f"{x['nodes']}x{x['depth']}") + ("p" if x["probe"] else "")
                            for x in choices)
            row = dict(rep=rep, config=c, tokens_per_s=rate, decode_ms=st.decode_s * 1e3, steps_ms=in_steps,
                       outside_ms=st.decode_s * 1e3 - in_steps, kinds=kinds, rungs=dict(rungs), log=list(log),
                       late=list(late), slow_jobs=list(slow))
            out.append(row)
            ks = "; ".join(f"{k} n={v['n']} tok={v['tokens']:.2f} ms={v['ms']:.2f} (wait {v['wait_ms']:.2f},"
                           f" fwd {v['forward_ms']:.2f}, max {v['max_ms']:.1f})" for k, v in kinds.items())
            print(f"rep {rep} {c:9s} {rate:7.1f} tok/s  decode {row['decode_ms']:.1f} ms, outside steps "
                  f"{row['outside_ms']:.1f}; {first}{ks}; rungs {dict(rungs)}"
                  + (f"; late work {late}" if late else "") + (f"; slow draft jobs {slow}" if slow else ""), flush=True)
    worker.shutdown()
    argv = sys.argv[1:] if argv is None else argv
    path = record.write_rows(OUT, f"trace-{a.regime.replace(' ', '-')}-", "regime_trace", a, out, argv)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
