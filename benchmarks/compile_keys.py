"""The Triton specializations a replica's warm-up meets, counted on any machine: each is a kernel
compiled at start-up on a GPU (~0.8 s on an H200 host; docs/architecture.md, "Execution plans").

The engine is built as a replica with the draft in its process builds it (the app's settings,
overlapped drafting on), with the GPU's plan run as its twin on the CPU (full-step forwards, fused
kernels, the split count of 132 multiprocessors) and Triton's interpreter; the three kernels whose
keys depend on the forward's shape are recorded and not run (their outputs zeroed:
specextend/bench/compile_keys.py), the other fused kernels recorded and run. Not counted: the
target's batched plans (on the CPU a plan is built without a forward) and the draft's vocabulary
top-k kernels (GPU only). A large geometry takes long on the CPU (the real pair's: 30 minutes on 2
cores, its weights in float32).

    python benchmarks/compile_keys.py target=random:qwen2.5-1.5b draft=random:qwen2.5-0.5b
"""

from __future__ import annotations

import os
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported

import torch  # noqa: E402

from specextend import builder, warmup  # noqa: E402
from specextend.attention import _triton_kernels  # noqa: E402
from specextend.bench.compile_keys import recording  # noqa: E402
from specextend.draft.session import DraftSession  # noqa: E402
from specextend.engine import Engine  # noqa: E402
from specextend.models import _triton_layer  # noqa: E402
from specextend.models.full_graphs import FullStepGraphs  # noqa: E402
from specextend.serving.settings import AppSettings  # noqa: E402

SHAPED = ("tree_combine", "rope_scatter", "prefix_partials")
KERNELS = [(_triton_layer, "tree_combine"), (_triton_layer, "rope_scatter"), (_triton_kernels, "prefix_partials"),
           (_triton_layer, "silu_mul"), (_triton_layer, "rms_norm")]
H200_SMS = 132


def main() -> None:
    args = dict(a.split("=", 1) for a in sys.argv[1:])
    settings = AppSettings.model_validate({"target": "random:qwen2.5-1.5b", "draft": "random:qwen2.5-0.5b",
                                           "num_gpus": 0, "tree_policy": "adaptive", "dtype": "float32",
                                           "draft_overlap": True, **args})
    cfg = settings.to_engine_config()
    DraftSession.pads_catch_up = staticmethod(lambda model: True)  # as with CUDA graphs
    t0 = time.perf_counter()
    target, draft = builder.load_pair(cfg)
    for m in (target, draft):
        m.decoder.graphs = FullStepGraphs(m.decoder, capture=False, fused=True)
        m.decoder.graphs.num_sms = H200_SMS
    counts = lambda rec: {n: len(r.keys) for n, r in rec.items()}  # noqa: E731
    with recording(KERNELS, dry=SHAPED) as rec:
        worker = builder.draft_worker(cfg, draft)
        print(f"the draft worker's warm-up: {counts(rec)} ({time.perf_counter() - t0:.0f} s)", flush=True)
        engine = Engine(cfg, target, worker, draft_args=draft.args)
        ids = list(range(100, 132))
        warmup.warm_up(engine, ids, settings.max_batch_sessions)
        warmup.warm_long(engine, ids[:4])
        worker.shutdown()
    print(f"the whole warm-up: {counts(rec)}, {sum(counts(rec).values())} specializations "
          f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    torch.set_num_threads(os.cpu_count() or 1)
    main()
