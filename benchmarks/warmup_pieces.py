"""Where a replica's warm-up time goes: each piece of warmup.warm_up and warm_long timed, with the
CUDA-graph plans it captured and the Triton kernels it compiled or loaded (models/late_work.py).

The engine is built in process as a replica with the draft in its process builds it (the app's
settings, `draft_in_replica=true` by default here); random weights of a real geometry meet the
real pair's shapes. Run it with a cold Triton cache (`TRITON_CACHE_DIR` pointing at an empty
folder) for a first start, warm for a restart. Prints a table, writes JSON (commit, device, date,
command) under benchmarks/results/warmup/.

    python benchmarks/warmup_pieces.py target=random:qwen2.5-1.5b draft=random:qwen2.5-0.5b
"""

from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path

import torch

from specextend import builder, warmup
from specextend.bench.record import device_name, meta, slug
from specextend.engine import Engine
from specextend.models import late_work
from specextend.serving.settings import AppSettings

OUT = Path(__file__).resolve().parent / "results" / "warmup"


def main() -> None:
    args = dict(a.split("=", 1) for a in sys.argv[1:])  # AppSettings fields, as `serve run` takes them
    settings = AppSettings.model_validate({"target": "default", "draft": "default", "num_gpus": 0.5,
                                           "tree_policy": "adaptive", "draft_in_replica": True, **args})
    cfg = settings.to_engine_config()
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rows = []

    def timed(name, fn):
        @functools.wraps(fn)
        def run(*a, **k):
            before = late_work.counts(late=False)
            sync()
            t0 = time.perf_counter()
            out = fn(*a, **k)
            sync()
            after = late_work.counts(late=False)
            what = name
            if name == "request":  # Engine.generate(self, prompt, params, ...)
                what = f"request of {a[2].max_new_tokens} tokens, trees of {k.get('max_tree_nodes') or '-'} nodes"
            rows.append(dict(piece=what, seconds=round(time.perf_counter() - t0, 2),
                             plans=after["capture"] - before["capture"], kernels=after["kernel"] - before["kernel"]))
            print(f"{what}: {rows[-1]['seconds']} s, {rows[-1]['plans']} plans, {rows[-1]['kernels']} kernels", flush=True)
            return out
        return run

    t0 = time.perf_counter()
    target, draft = builder.load_pair(cfg)
    load_s = time.perf_counter() - t0
    worker = timed("draft worker's warm-up", builder.draft_worker)(cfg, draft) if draft is not None else None
    engine = Engine(cfg, target, worker, draft_args=draft.args if draft is not None else None)
    warmup.warm_batches = timed("batched plans (warm_batches)", warmup.warm_batches)
    warmup.warm_verify_sizes = timed("verify of every size (warm_verify_sizes)", warmup.warm_verify_sizes)
    Engine.generate = timed("request", Engine.generate)
    ids = list(range(100, 132))
    t1 = time.perf_counter()
    warmup.warm_up(engine, ids, settings.max_batch_sessions)
    if cfg.uses_draft:
        warmup.warm_long(engine, ids[:4])
    total = time.perf_counter() - t1
    print("\n| piece | s | plans | kernels |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['piece']} | {r['seconds']} | {r['plans']} | {r['kernels']} |")
    print(f"| warm-up in all (after the draft's) | {total:.1f} | | |\nweights loaded in {load_s:.1f} s")
    device = "cuda" if cuda else "cpu"
    result = dict(meta=meta("warmup", device, ["python", *sys.argv], settings=args), load_s=round(load_s, 1),
                  warm_up_s=round(total, 1), pieces=rows)
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{slug(device_name(device))}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
