"""HTA in one kernel for a short committed cache (attention/triton_short.py) against its twins: the
plain torch one (partials_reference + tree_attention_merged), the split path's Triton pair
(prefix_partials + tree_combine) and plain masked attention over prefix + tree keys (float64); then
the full-step plans that take it (the draft's retrieval working cache) against Decoder.forward_eager.
On the CPU the kernels run in Triton's interpreter (conftest.py), which misreads bfloat16 memory:
float16 stands for the half-precision path there, bfloat16 on CUDA."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")  # a dev dependency: present in CI

from specextend.attention.eager import attention_eager
from specextend.attention.tree_merge import mask_bias
from specextend.attention.triton_prefix import cache_meta, num_splits, prefix_partials
from specextend.attention.triton_short import SHORT_MAX_KEYS, config, short_attention, short_reference
from specextend.models import fused_layer
from specextend.models.full_graphs import FullStepGraphs

from test_full_graphs import DEVICE, DTYPES
from test_graphs import assert_same_run, decoder_on, run_calls

CAP = 1100  # keys of the test cache: L = CAP reads up to the end of its buffer
SCALE = 0.125
# (L, tree keys n, T, H, G, D, need_lse): every L meets several of the others; block edges at 64
# (128-dim heads: key blocks of 64) and 128 (64-dim: blocks of 128) and a partial last block
CASES = [
    (1, 1, 1, 14, 2, 64, True),
    (1, 64, 17, 8, 2, 128, False),
    (63, 17, 8, 14, 2, 64, False),
    (63, 0, 1, 8, 2, 128, True),
    (64, 64, 8, 8, 2, 128, True),
    (64, 1, 17, 14, 2, 64, False),
    (65, 17, 64, 14, 2, 64, True),
    (65, 0, 8, 8, 2, 128, False),
    (129, 17, 1, 8, 2, 64, True),
    (1000, 64, 8, 14, 2, 64, False),  # the draft's level (Qwen2.5-0.5B geometry)
    (1000, 17, 17, 8, 2, 128, True),
    (1000, 0, 1, 14, 2, 64, True),
    (CAP, 1, 64, 8, 2, 64, False),
    (CAP, 64, 1, 14, 2, 64, True),
    (CAP, 17, 8, 14, 2, 64, True),
]


def _tol(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2 if dtype == torch.bfloat16
                                                                            else 2e-3, rtol=2e-2)


def _problem(L, n, t, h, g, d, dtype, seed):
    """A cache [2, 2, G, CAP, D] read at layer 1 (layer 0 and the slots past L are NaN: the kernel must
    not read them), q [H, T, D], tree keys [G, n, D] as strided views (the plans' scratch), and a
    mask with rows that see no tree key (row 0: the prefix only)."""
    gen = torch.Generator().manual_seed(seed)
    data = torch.randn(2, 2, g, CAP, d, generator=gen).to(DEVICE, dtype)  # KVCache.data layout
    data[0] = float("nan")
    data[1, :, :, L:] = float("nan")
    q = torch.randn(h, t, d, generator=gen).to(DEVICE, dtype)
    scratch = torch.randn(2, g, n + 3, d, generator=gen).to(DEVICE, dtype)
    k, v = scratch[0, :, :n], scratch[1, :, :n]  # [G, n, D], stride (n + 3) * D
    mask = torch.rand(t, n, generator=gen) < 0.6
    mask[0] = False
    bias = mask_bias(mask.to(DEVICE), h // g, torch.float32)  # [(H/G) * T, n]
    anchor = torch.zeros(16, dtype=dtype, device=DEVICE)
    meta = torch.tensor(cache_meta(data, anchor, L), dtype=torch.int64, device=DEVICE)
    return data, q, k, v, bias, anchor, meta


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L,n,t,h,g,d,need_lse", CASES)
def test_short_attention_equals_its_twin(dtype, L, n, t, h, g, d, need_lse):
    data, q, k, v, bias, anchor, meta = _problem(L, n, t, h, g, d, dtype, seed=L * 7 + n + t)
    out = torch.full((t, h * d), float("nan"), dtype=dtype, device=DEVICE)  # poisoned: every element written
    lse = torch.full((h, t), float("nan"), device=DEVICE)
    got, got_lse = short_attention(q, anchor, meta, 1, k, v, bias, SCALE, need_lse, out, lse)
    assert got is out and (got_lse is lse if need_lse else got_lse is None)
    ref, ref_lse = short_reference(q, data[1, 0], data[1, 1], L, k, v, bias, SCALE, need_lse)  # [T, H * D]
    torch.testing.assert_close(got.float(), ref.float(), **_tol(dtype))
    if need_lse:
        torch.testing.assert_close(got_lse, ref_lse, atol=1e-5, rtol=1e-5)
    else:
        assert torch.isnan(lse).all()  # not written


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L,n,t,need_lse", [(1000, 20, 4, False), (1000, 72, 8, True), (1100, 64, 16, False)])
def test_short_attention_equals_the_split_pair(dtype, L, n, t, need_lse):
    """The kernel it replaces in a short plan: prefix_partials' splits, then tree_combine's merge
    (the draft's geometry: 14 query heads, 2 KV heads, 64 dims)."""
    h, g, d = 14, 2, 64
    data, q, k, v, bias, anchor, meta = _problem(L, n, t, h, g, d, dtype, seed=L + n + t)
    rows = (h // g) * t
    s = num_splits(rows, g, 132, dtype == torch.float32)
    out_p = torch.empty(g, s, rows, d, device=DEVICE)  # [G, S, R*T, D]
    lse_p = torch.empty(g, s, rows, device=DEVICE)
    prefix_partials(q.view(g, rows, d), anchor, meta, 1, SCALE, out_p, lse_p)
    ref, ref_lse = fused_layer.tree_combine(q, k.contiguous(), v.contiguous(), bias, out_p, lse_p, SCALE, need_lse)
    got, got_lse = short_attention(q, anchor, meta, 1, k, v, bias, SCALE, need_lse)
    torch.testing.assert_close(got.float(), ref.float(), **_tol(dtype))
    if need_lse:
        torch.testing.assert_close(got_lse, ref_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("L,n", [(40, 9), (0, 9), (40, 0)])
def test_twin_equals_plain_masked_attention(L, n):
    """The twin itself (float64) against one masked softmax over the prefix and the tree keys."""
    h, g, t, d = 6, 2, 3, 16
    gen = torch.Generator().manual_seed(L + n)
    q = torch.randn(h, t, d, generator=gen, dtype=torch.float64)
    kc, vc = torch.randn(2, g, L + 5, d, generator=gen, dtype=torch.float64)
    k, v = torch.randn(2, g, n, d, generator=gen, dtype=torch.float64)
    mask = torch.rand(t, n, generator=gen) < 0.5
    if n:
        mask[:, 0] = True  # with no prefix (L = 0), every row sees a key
    full = torch.cat([torch.ones(t, L, dtype=torch.bool), mask], 1)  # [T, L + n]
    exp, exp_lse = attention_eager(q, torch.cat([kc[:, :L], k], 1), torch.cat([vc[:, :L], v], 1), full, SCALE)
    got, lse = short_reference(q, kc, vc, L, k, v, mask_bias(mask, h // g, torch.float64), SCALE, need_lse=True)
    torch.testing.assert_close(got, exp.transpose(0, 1).reshape(t, h * d), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse, exp_lse, atol=1e-12, rtol=1e-12)


def test_a_row_that_sees_no_key_is_zero_with_lse_minus_infinity():
    """No committed key (L = 0) and a row whose tree keys are all masked: out 0, lse -inf, as
    tree_combine writes such a row (no NaN)."""
    data, q, k, v, bias, anchor, meta = _problem(0, 5, 3, 4, 2, 64, torch.float32, seed=1)
    got, lse = short_attention(q, anchor, meta, 1, k, v, bias, SCALE, True)
    rows = got.view(3, 4, 64)[0]  # token 0 of every head: its mask row is empty
    assert (rows == 0).all() and torch.isinf(lse[:, 0]).all() and (lse[:, 0] < 0).all()
    assert not torch.isnan(got).any() and not torch.isnan(lse).any()


def test_launch_parameters_cover_the_shapes():
    assert config(56, 72, 64) == dict(bm=16, block_n=128, tree_n=32, num_warps=4, num_stages=3)
    assert config(56, 72, 128)["block_n"] == 64  # the same bytes per block for 128-dim heads
    assert config(4, 1, 64)["tree_n"] == 16  # the smallest dot
    assert config(56, 72, 64, ieee=True) == dict(bm=16, block_n=32, tree_n=16, num_warps=8, num_stages=2)


def _short_caches(dec, working_length):
    """dec.new_cache with every cache marked as its owner would mark the draft's working cache."""
    inner = dec.new_cache

    def new_cache(capacity):
        c = inner(capacity)
        c.working_length = working_length
        return c

    dec.new_cache = new_cache


@pytest.mark.parametrize("name", ["llama3", "qwen2", "qwen3"])
def test_short_plans_equal_eager(name):
    """Every decode-time call kind (AR, committed forwards with the store, verification with the
    CMR capture: the last layer's lse through the kernel, draft levels over staged keys) through
    short plans equals the plain forward (QK-norm: qwen3's layer_pre is the torch one)."""
    dec = decoder_on(name, DEVICE, torch.float32)
    ref = run_calls(dec, dec.forward_eager, DEVICE)
    _short_caches(dec, 1052)
    graphs = FullStepGraphs(dec, capture=False, fused=True)
    got = run_calls(dec, graphs.forward, DEVICE)
    assert graphs.plans and all(k.short for k in graphs.plans)
    assert_same_run(ref, got, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_captured_short_plans_equal_the_split_twin(dtype, tol):
    dec = decoder_on("qwen2", "cuda", dtype)
    ref = run_calls(dec, FullStepGraphs(dec, capture=False).forward, "cuda")  # unfused: the split path
    _short_caches(dec, 1052)
    graphs = FullStepGraphs(dec, capture=True, fused=True)
    got = run_calls(dec, graphs.forward, "cuda")
    assert graphs.plans and all(k.short for k in graphs.plans)
    assert graphs.num_graphs == 5 * len(graphs.pieces)
    assert_same_run(ref, got, atol=tol, rtol=tol)


def test_only_short_marked_caches_of_fused_plans_are_short():
    """The split path for a cache without the hint (the target's, the draft's without retrieval),
    one marked longer than SHORT_MAX_KEYS, and plans without the fused layer kernels."""
    dec = decoder_on("llama3", DEVICE, torch.float32)
    fused, unfused = FullStepGraphs(dec, capture=False, fused=True), FullStepGraphs(dec, capture=False)
    c = dec.new_cache(64)
    assert not fused.short_cache(c)
    c.working_length = SHORT_MAX_KEYS
    assert fused.short_cache(c) and not unfused.short_cache(c)
    c.working_length = SHORT_MAX_KEYS + 1
    assert not fused.short_cache(c)


def test_draft_session_drafts_the_same_trees_through_short_plans(tiny_models):
    """The draft's working cache is marked short with retrieval on (and not without): its levels,
    catch-ups and a refresh's rebuilt cache go through short plans, and the trees equal the eager
    session's."""
    from specextend.config import RetrievalConfig, TreeConfig
    from specextend.draft.base import DraftSessionParams, Retrieval
    from specextend.draft.session import DraftSession

    _, draft = tiny_models("float32")
    dec = draft.decoder
    cfg = RetrievalConfig(enabled=True, chunk_size=8, top_k=4, every=2, draft_prefill_window=32)
    params = DraftSessionParams(TreeConfig(8, 3, 2), cfg, max_new_tokens=64)
    prompt = [(11 * i + 5) % dec.args.vocab_size for i in range(90)]
    plain = DraftSession(dec, prompt, DraftSessionParams(TreeConfig(8, 3, 2), RetrievalConfig(enabled=False)))
    assert plain.work.working_length is None  # the full cache: the split path
    graphs = FullStepGraphs(dec, capture=False, fused=True)
    steps = [([7], None), ([3, 9], Retrieval(chunk_ids=(0, 4, 9, 10), chunk_size=8)),
             ([4, 1, 2, 8, 6, 5], None)]  # the last: more than a step accepts (a catch-up)
    trees = []
    try:
        for plan in (None, graphs):
            dec.graphs = plan
            s = DraftSession(dec, prompt, params)
            assert s.work.working_length == 32 + 2 * 4 + 1  # budget + every * (depth + 1) + 1
            trees.append([s.step(i, acc, r).tokens for i, (acc, r) in enumerate(steps)])
    finally:
        dec.graphs = None
    assert trees[0] == trees[1]
    assert graphs.plans and all(k.short for k in graphs.plans)


def test_the_gpu_benchmark_runs_its_checks_on_the_cpu():
    """benchmarks/short_attention.py (the H200 timing of the split pair against the kernel) runs
    every code path but the timing on the CPU, and its agreement check passes."""
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "benchmarks/short_attention.py", "--device", "cpu", "--lengths", "70",
                           "--tokens", "2", "--staged", "3"], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])["rows"]
    assert [(r["L"], r["T"], r["n"], r["agree"]) for r in rows] == [(70, 2, 5, True)]
