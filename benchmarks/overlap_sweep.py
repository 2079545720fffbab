"""Overlapped drafting's knobs on two GPUs: the target on cuda:0, the draft on cuda:1, in one process.

  python benchmarks/overlap_sweep.py --pair real --length 16384 --docs nodejs,shakespeare \
      --variants 3x8,2x8,1x8,2x16 --out overlap.json

A variant `DxR` drafts D levels before answering a step that found nothing ready (`sync_depth`)
and forwards R pool nodes per background forward (`overlap_rows`); `lL` chains L forwards on the
device per background launch (`overlap_levels`); a suffix `eN` refreshes the
draft's retrieval every N steps instead of the configured interval (`e0`: retrieval off), and `nN`
sends trees of N nodes, `dN` lets a retrieval selection that arrives with a ready tree wait up to
N ready steps for a miss (`refresh_defer`; e.g. `1x8l2e16n8d0`), and a final `s` settles a ready
step's K/V moves before answering it (the twin of answering first, DraftWorker's `answer_first`), and
`p` turns prepared outcomes on (DraftWorker's `prepare`, the app's `draft_prepare`), `w` makes a
step whose tree is not ready wait for a drafted one (`overlap_miss=draft`; default: a plain step),
and `kN` turns context lookup on with chains of N tokens (`lookup_tokens`, both sides: e.g. `1x8k8`;
without it lookup is off here, whereas the app's default is 8). Per row, the draft worker's thread time split
(foreground jobs, the host side of background slices, polling with a slice in flight, idle). Every variant runs the same
prompts after `ar` (the baseline of the ratios, same round), `--rounds` times interleaved; per variant
(medians over documents and rounds): decode tokens/s, its ratio
to `ar`, acceptance, the share of steps answered from the pool (tree ready), the target's wait
and the verify time per step. Fixed trees (the method, not the controller).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from dataclasses import replace

import torch

from specextend.bench.e2e import MODES, PAIRS, TIE_TOLERANCE, load_models, run_engine
from specextend.bench.record import meta
from specextend.bench.texts import documents, prompt_ids
from specextend.draft.base import DraftSessionParams
from specextend.draft.worker import DraftWorker
from specextend.engine import Engine
from specextend.near_tie import lossless_check

WORKER_COUNTS = ("background_forwards", "ready_trees", "flight_steps", "flight_waits", "rebuilds", "chained_nodes",
                 "dropped_levels")
WORKER_TIMES = ("foreground_s", "background_host_s", "poll_s")  # (idle_s counts a wait when it ends)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pair", default="real", choices=sorted(PAIRS))
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--docs", default="nodejs,shakespeare")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--variants", default="3x8,2x8,1x8,2x16,3x16")
    ap.add_argument("--out")
    ap.add_argument("--rounds", type=int, default=1,
                    help="runs of every variant per document, interleaved (ratios are to the same round's ar)")
    ap.add_argument("--cpu", action="store_true", help="a smoke run with both models on the CPU")
    a = ap.parse_args()
    assert a.cpu or torch.cuda.device_count() >= 2, "two GPUs: the target on cuda:0, the draft on cuda:1"
    pair = PAIRS[a.pair]
    draft_dev = "cpu" if a.cpu else "cuda:1"
    base, target, drafts = load_models(pair, "auto", "fixed", "cpu" if a.cpu else "cuda", () if a.cpu else (draft_dev,))
    prompts = [(d.name, prompt_ids(target.tokenizer, d, a.length)) for d in documents(a.docs.split(","))]
    engines = {"ar": Engine(replace(base, **MODES["ar"]), target, None)}
    workers = []
    for v in a.variants.split(","):
        m = re.fullmatch(r"(\d+)x(\d+)(?:l(\d+))?(?:e(\d+))?(?:n(\d+))?(?:d(\d+))?(s)?(p)?(w)?(?:k(\d+))?", v)
        assert m, f"variant {v!r}: DxR[lL][eN][nN][dN][s][p][w][kN]"
        depth, rows = int(m[1]), int(m[2])
        cfg = replace(base, **MODES["specextend"], draft_overlap=True, overlap_miss="draft" if m[9] else "plain",
                      lookup_tokens=int(m[10] or 0))
        if m[4] is not None:
            n = int(m[4])
            cfg = replace(cfg, retrieval=replace(cfg.retrieval, enabled=n > 0, every=max(n, 1)))
        if m[5] is not None:
            cfg = replace(cfg, tree=replace(cfg.tree, nodes=int(m[5])))
        w = DraftWorker(drafts[draft_dev].decoder, prefill_chunk=base.prefill_chunk, overlap=True,
                        sync_depth=depth, overlap_rows=rows, overlap_levels=int(m[3] or 1),
                        answer_first=m[7] is None, prepare=m[8] is not None, **({} if m[6] is None else dict(refresh_defer=int(m[6]))))
        # its background shapes' CUDA graphs before any timed request (the served app warms its draft
        # the same way; a first overlap engine otherwise met them in its timed request, 2026-11-26)
        w.warm_up(DraftSessionParams(cfg.tree, cfg.retrieval, max_new_tokens=a.new_tokens))
        workers.append(w)
        engines[v] = Engine(cfg, target, w)
    warm: set = set()
    tol = TIE_TOLERANCE.get(target.decoder.dtype, 0.125)
    rows_out = []
    try:
        for (doc, prompt), rnd in [(p, k) for p in prompts for k in range(a.rounds)]:
            ref = None
            for name, eng in engines.items():
                worker = eng.draft if name != "ar" else None
                before = worker.stats() if worker is not None else None
                ids, r = run_engine(eng, prompt, a.new_tokens, None, warm)
                if worker is not None:  # what the worker did for this request (its session has closed)
                    time.sleep(0.05)
                    after = worker.stats()
                    r.update({k: getattr(after, k) - getattr(before, k) for k in WORKER_COUNTS + WORKER_TIMES})
                ref = ids if name == "ar" else ref
                check = lossless_check(target.decoder, prompt, ref, ids, tol) if name != "ar" else {}
                r.update(variant=name, doc=doc, round=rnd, identical=ids == ref, near_tie=check.get("near_tie", True))
                rows_out.append(r)
                print(f"{doc} {name}: {r['decode_tokens_per_s']:.1f} tok/s, acc {r['mean_acceptance_length']:.2f}, "
                      f"ready {r['tree_ready_fraction']:.2f}, unready {r.get('unready_steps', 0)} (prepared {r.get('prepared_steps', 0)} of "
                      f"{r['num_steps']}, median wait {r.get('wait_prepared_ms', 0.0):.2f} ms), "
                      f"wait {r['draft_wait_ms']:.2f} ms, "
                      f"verify {r['verify_ms']:.2f} ms; median wait ready {r['wait_ready_ms']:.2f}, "
                      f"drafted {r['wait_drafted_ms']:.2f}, with a retrieval {r['wait_refresh_ms']:.2f} ms; ready: "
                      f"draft side {r.get('ready_server_ms', 0.0):.2f}, queued {r.get('ready_queued_ms', 0.0):.2f} ms; "
                      + ", ".join(f"{k} {r[k]}" for k in WORKER_COUNTS if k in r)
                      + ("; thread ms: " + ", ".join(f"{k[:-2]} {1e3 * r[k]:.0f}" for k in WORKER_TIMES) if "poll_s" in r else ""),
                      flush=True)
    finally:
        for w in workers:
            w.stop()
    ar = {(r["doc"], r["round"]): r["decode_tokens_per_s"] for r in rows_out if r["variant"] == "ar"}
    print("\n| variant | decode tok/s | x ar (median) | acceptance | tree ready | unready steps | wait ms | "
          "median wait ready ms | queued for the draft's thread ms | ready: draft side / queued ms | verify ms |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|")
    for name in engines:
        rs = [r for r in rows_out if r["variant"] == name]
        m = {k: statistics.median(r[k] for r in rs) for k in ("decode_tokens_per_s", "mean_acceptance_length",
                                                               "tree_ready_fraction", "draft_wait_ms", "verify_ms",
                                                               "unready_steps",
                                                               "wait_ready_ms", "draft_queue_ms",
                                                               "ready_server_ms", "ready_queued_ms")}
        x = statistics.median(r["decode_tokens_per_s"] / ar[r["doc"], r["round"]] for r in rs)
        print(f"| {name} | {m['decode_tokens_per_s']:.1f} | {x:.2f} | {m['mean_acceptance_length']:.2f} | "
              f"{m['tree_ready_fraction']:.2f} | {m['unready_steps']:g} | {m['draft_wait_ms']:.2f} | {m['wait_ready_ms']:.2f} | "
              f"{m['draft_queue_ms']:.2f} | {m['ready_server_ms']:.2f} / {m['ready_queued_ms']:.2f} | "
              f"{m['verify_ms']:.2f} |")
    if a.out:
        with open(a.out, "w") as f:
            info = dict(meta("overlap_sweep", "cpu" if a.cpu else "cuda", []), command="python " + " ".join(sys.argv))
            json.dump(dict(meta=info, length=a.length, rows=rows_out), f, indent=1)


if __name__ == "__main__":
    main()
