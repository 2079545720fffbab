"""The adaptive policy step by step, beside context lookup alone: at each choice the chain the
context offers (its nodes and the gate's expected tokens), the predicted tokens per second of a
step without a tree and of the chosen (or best) tree, and each step's kind, tokens and wall time.
`lookup` and `specextend` (adaptive) alternate on one prompt, each engine kept across requests as
a replica keeps it; per request it prints the tree steps, then predicted against made per kind of
step, and writes every step to results/trace/ (docs/architecture.md, "Adaptive speculation").

    python benchmarks/trace_choice.py --device cuda --length 16384 --doc python --new-tokens 256 --reps 3

H200, 2026-11-29 (commit 1865b5a, the real pair): benchmarks/README.md, *Length sweep (GPU)*, "Step by
step" (results/trace/trace-choice-real-*-1x-nvidia-h200.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from specextend import controller, stats
from specextend.bench import e2e, record
from specextend.bench.texts import documents, prompt_ids
from specextend.config import SamplingParams
from specextend.ladder import PLAIN

OUT = Path(__file__).parent / "results" / "trace"
MODES = ["lookup", "specextend"]


def hook(log: list) -> None:
    """Records each adaptive choice (TreeController.choose) and each step (RequestStats.step_done) into `log`."""
    choose, done = controller.TreeController.choose, stats.RequestStats.step_done

    def traced_choose(self, sessions: int = 1):
        rung = choose(self, sessions)
        if type(self) is controller.TreeController:  # (not the fixed policy)
            tree = max(self.rungs[1:], key=self.value)  # the best tree (the chosen one, when a tree is)
            log.append(dict(ev="choice", plain=rung.plain, nodes=rung.nodes, depth=rung.depth,
                            chain_now=self.chain_now, found=self.chain_found, probe=self._probing,
                            recheck=self.recheck.pending,
                            rate_plain=self.rate(PLAIN), rate_chosen=self.value(rung),
                            tree=(tree.nodes, tree.depth), rate_tree=self.value(tree),
                            accepted=self.expected_accepted(tree), lookup_spec=self.lookup_spec,
                            seconds_tree=self.step_seconds(tree), seconds_plain=self.step_seconds(PLAIN)))
        return rung

    def traced_done(self, kind, tokens, seconds, wait_s=0.0, forward_s=0.0):
        log.append(dict(ev="step", kind=kind, tokens=tokens, ms=seconds * 1e3, wait_ms=wait_s * 1e3))
        return done(self, kind, tokens, seconds, wait_s, forward_s)

    controller.TreeController.choose, stats.RequestStats.step_done = traced_choose, traced_done


def summary(log: list) -> list[str]:
    """Each tree step's choice and outcome, then predicted against made for the tree steps and for
    the steps without a tree that had a chain."""
    pairs = [(c, s) for c, s in zip(log, log[1:]) if c["ev"] == "choice" and s["ev"] == "step"]
    trees = [(c, s) for c, s in pairs if not c["plain"] and s["kind"] == "tree"]
    chains = [(c, s) for c, s in pairs if c["plain"] and c["chain_now"] and c["chain_now"][0]]
    lines = [f"  tree {c['nodes']}x{c['depth']}{' probe' if c['probe'] else ''}: chain {c['chain_now']}, "
             f"predicted {c['rate_chosen'] * 1e-3:.3f} tok/ms (without a tree {c['rate_plain'] * 1e-3:.3f}; "
             f"accepted {c['accepted']:.2f}, chain credit {c['lookup_spec']:.2f}) -> {s['tokens']} tokens "
             f"in {s['ms']:.2f} ms (wait {s['wait_ms']:.2f})" for c, s in trees]
    choices = [c for c in log if c["ev"] == "choice"]
    lines.append(f"  choices {len(choices)}: probes {sum(c['probe'] and not c['plain'] for c in choices)}, "
                 f"rechecks of the plain step {sum(c.get('recheck', False) for c in choices)}")
    for name, group in (("tree steps", trees), ("chain steps", chains)):
        if group:
            made = sum(s["tokens"] for _, s in group) / sum(s["ms"] for _, s in group)
            lines.append(f"  {name}: {len(group)}, predicted {statistics.mean(c['rate_chosen'] for c, _ in group) * 1e-3:.3f}"
                         f" tok/ms, made {made:.3f}; predicted step {statistics.mean(c['seconds_tree' if name[0] == 't' else 'seconds_plain'] for c, _ in group) * 1e3:.2f} ms,"
                         f" took {statistics.mean(s['ms'] for _, s in group):.2f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pair", default="real", choices=sorted(e2e.PAIRS))
    p.add_argument("--device", default="cpu")
    p.add_argument("--length", type=int, default=16384)
    p.add_argument("--doc", default="python")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--reps", type=int, default=3)
    argv = sys.argv[1:] if argv is None else argv
    a = p.parse_args(argv)
    log: list = []
    hook(log)
    target, engines, _, workers = e2e._engines(e2e.PAIRS[a.pair], MODES, "auto", "adaptive", a.device)
    prompt = prompt_ids(target.tokenizer, documents([a.doc])[0], a.length)
    params = SamplingParams(max_new_tokens=a.new_tokens, ignore_eos=True)
    warm: set = set()
    for m in MODES:
        e2e.warm_up(engines[m], prompt, warm)
    runs = []
    for rep in range(a.reps):
        for m in MODES:
            log.clear()
            ids, _, st = engines[m].generate(prompt, params)
            kinds = {k: (n, round(t / max(n, 1), 2), round(1e3 * s / max(n, 1), 2))
                     for k, (n, t, s, _, _) in st.step_kinds.items()}
            rate = (st.num_generated - 1) / st.decode_s
            # the decode's wall time outside its steps (between them, and before the first), ms
            outside = dict(outside=1e3 * (st.decode_s - sum(v[2] for v in st.step_kinds.values())),
                           between=1e3 * st.between_s, retrieval=1e3 * st.retrieval_s,
                           draft_open=1e3 * st.draft_open_s, prefill=1e3 * st.prefill_s)
            outside = {k: round(v, 2) for k, v in outside.items()}
            print(f"request {rep} {m}: {rate:.1f} tok/s, steps (n, tokens, ms) {kinds}; ms {outside}", flush=True)
            if m == "specextend":
                print("\n".join(summary(log)), flush=True)
            runs.append(dict(rep=rep, mode=m, tokens_per_s=rate, kinds=kinds, ms=outside, steps=list(log), ids=ids))
    for w in workers:
        w.shutdown()
    OUT.mkdir(parents=True, exist_ok=True)
    meta = record.meta("trace_choice", a.device, ["benchmarks/trace_choice.py", *(argv or [])])
    path = OUT / f"trace-choice-{a.pair}-{a.doc}-{a.length}-{record.slug(record.device_name(a.device))}.json"
    path.write_text(json.dumps(dict(meta=meta, args=vars(a), runs=runs)) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
