"""The Triton kernels compile for the GPU (sm_90, H100/H200) at the product's shapes, checked on any
machine: Triton's CPU interpreter runs the kernels' logic but not the GPU compiler, which rejects
things the interpreter accepts (a non-constexpr global failed only there) and decides shared memory
and register spills. Runs benchmarks/triton_aot.py in a subprocess without TRITON_INTERPRET."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

REPO = Path(__file__).resolve().parents[1]
FUSED = {"tree_combine", "rope_scatter", "silu_mul", "rms_norm", "skinny_linear", "skinny_loop"}


def test_kernels_compile_for_sm90_within_shared_memory_and_fused_ones_do_not_spill():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "benchmarks/triton_aot.py", "--quick", "--dtypes", "bf16,fp32"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.stdout.strip(), proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])["rows"]
    topk = {f"{k} w={w}" for k in ("block_topk", "merge_topk") for w in (4, 8, 16)}  # draft/vocab_topk.py
    assert {r["kernel"] for r in rows} == FUSED | {"prefix_partials", "layer_kernel"} | topk
    assert {r["dtype"] for r in rows} == {"bf16", "fp32"}
    bad = [r for r in rows if not r["ok"]]
    assert not bad, bad  # compiled, shared memory within the sm_90 limit
    assert proc.returncode == 0
    spills = [r for r in rows if r["kernel"] in FUSED and r["stack"]]
    assert not spills, spills
    # the vocabulary top-k at the widths the product uses (tree_topk 4, overlap's 8) keeps to registers
    assert not [r for r in rows if r["kernel"].endswith(("w=4", "w=8")) and r["stack"]]
    # half-precision attention dots run on the tensor cores (wgmma where the tile allows)
    assert all(r["mma"] for r in rows if r["kernel"] in ("tree_combine", "prefix_partials", "skinny_linear", "skinny_loop",
                                                        "layer_kernel")
               and r["dtype"] == "bf16")
