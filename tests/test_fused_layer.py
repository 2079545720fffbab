"""Fused layer kernels (models/fused_layer.py) against their torch twins, and the full-step forward
with them against Decoder.forward_eager. On the CPU the kernels run in Triton's interpreter
(conftest.py); on CUDA the captured graphs must equal the twin."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")  # a dev dependency: present in CI

from specextend.attention.tree_merge import mask_bias, tree_attention_merged
from specextend.models import fused_layer
from specextend.models.full_graphs import FullStepGraphs
from specextend.models.graphs import StepGraphs
from specextend.models.rope import Rope, apply_rope
from specextend.models.segments import Segments

from test_full_graphs import DEVICE, DTYPES
from test_graphs import assert_same_run, decoder_on, run_calls

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
FOLD_TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 6e-2}  # folded weights, rounded once


def _gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h,g,t,staged,d,splits,chunk", [(4, 2, 7, 0, 16, 3, 0), (6, 2, 1, 0, 32, 1, 16),
                                                          (4, 1, 5, 9, 24, 2, 16), (8, 8, 3, 70, 16, 1, 0),
                                                          (8, 2, 12, 3, 64, 2, 0), (8, 2, 12, 3, 64, 37, 0),
                                                          (8, 2, 12, 3, 64, 21, 0)])
@pytest.mark.parametrize("need_lse", [False, True])
@pytest.mark.parametrize("sb", [0, 64])
def test_tree_combine_equals_tree_attention_merged(dtype, h, g, t, staged, d, splits, chunk, need_lse, sb):
    """GQA groups, one query, staged keys past one key block (n > 64), a non-power-of-two head dim,
    the head dim in chunks over programs (two of 16, the last one partial), more rows than one row
    block, S partials (some empty: lse -inf; 37 of them, the last 5 empty: four unrolled iterations
    of 8, the last one partial; with sb 64, every split in one load; 21, 16 of them in use: with sb
    64, two rounds of 8) or the one-prefix layout [H, T, D]."""
    gen = _gen(h * 100 + t * 10 + staged)
    r, n = h // g, staged + t
    rnd = lambda *s: torch.randn(*s, generator=gen).to(DEVICE)  # noqa: E731
    q = rnd(h, t, d).to(dtype)
    k, v = rnd(g, n, d).to(dtype), rnd(g, n, d).to(dtype)
    mask = torch.rand(t, n, generator=gen).to(DEVICE) < 0.6
    mask[:, staged:] |= torch.eye(t, dtype=torch.bool, device=DEVICE)  # every query sees itself
    bias = mask_bias(mask, r, torch.float32)
    if splits == 1:
        out_p, lse_p = rnd(h, t, d).to(dtype), rnd(h, t) * 3  # the piecewise graphs' layout
    else:
        out_p, lse_p = rnd(g, splits, r * t, d), rnd(g, splits, r * t) * 3
        lse_p[:, 0] = float("-inf")  # an empty split
        out_p[:, 0] = 0
        if splits > 8:  # trailing empty splits (a short prefix)
            lse_p[:, -5:] = float("-inf")
            out_p[:, -5:] = 0
    ref, ref_lse = tree_attention_merged(q, k, v, bias, out_p, lse_p, 0.3, need_lse=need_lse)  # [H, T, D]
    if splits > 8:
        out_p[:, -5:] = float("nan")  # the kernel reads no split past the last non-empty one
    got, lse = fused_layer.tree_combine(q, k, v, bias, out_p, lse_p, 0.3, need_lse, chunk, sb)  # [T, H * D]
    tol = TOL[dtype]
    torch.testing.assert_close(got.view(t, h, d).transpose(0, 1).float(), ref.float(), atol=tol, rtol=tol)
    if need_lse:
        torch.testing.assert_close(lse, ref_lse.float(), atol=1e-5, rtol=1e-5)
    else:
        assert lse is None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nb,t,st", [(4, 16, 0), (4, 16, 8), (3, 5, 7), (2, 1, 0)])
def test_tree_combine_reads_only_each_sessions_key_ranges(dtype, nb, t, st):
    """A batched forward's block-diagonal mask (FullStepGraphs._batch_mask: each session's rows see
    its own staged and new keys) with its key ranges (full_graphs.batch_key_ranges) equals the twin
    over every key. With 16 tokens a session each row block is one session's, so a bias made
    permissive outside the ranges (every other session's keys open) changes nothing: the kernel
    reads only the ranges. With 5 tokens a block spans sessions and reads the union of theirs."""
    from specextend.models.full_graphs import batch_key_ranges

    h, g, d = 4, 2, 16
    gen = _gen(nb * 100 + t * 10 + st)
    rnd = lambda *s: torch.randn(*s, generator=gen).to(DEVICE)  # noqa: E731
    rows, n = nb * t, nb * (st + t)
    q, k, v = rnd(h, rows, d).to(dtype), rnd(g, n, d).to(dtype), rnd(g, n, d).to(dtype)
    mask = torch.zeros(rows, n, dtype=torch.bool)
    for i in range(nb):
        lo = i * t
        mask[lo:lo + t, i * st:(i + 1) * st] = torch.rand(t, st, generator=gen) < 0.6
        mask[lo:lo + t, nb * st + lo:nb * st + lo + t] = torch.ones(t, t, dtype=torch.bool).tril()
    mask = mask.to(DEVICE)
    out_p, lse_p = rnd(g, 3, (h // g) * rows, d), rnd(g, 3, (h // g) * rows) * 3
    ref, ref_lse = tree_attention_merged(q, k, v, mask_bias(mask, h // g, torch.float32), out_p, lse_p, 0.3,
                                         need_lse=True)
    ranges = batch_key_ranges(nb, t, st, DEVICE)
    aligned = t % 16 == 0
    bias = mask_bias(mask | ~_own_blocks(nb, t, st).to(DEVICE) if aligned else mask, h // g, torch.float32)
    got, lse = fused_layer.tree_combine(q, k, v, bias, out_p, lse_p, 0.3, True, key_ranges=ranges)
    tol = TOL[dtype]
    torch.testing.assert_close(got.view(rows, h, d).transpose(0, 1).float(), ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(lse, ref_lse.float(), atol=1e-5, rtol=1e-5)
    if aligned and nb > 1:  # (without the ranges the opened keys count: the check above can fail)
        wide, _ = fused_layer.tree_combine(q, k, v, bias, out_p, lse_p, 0.3, True)
        assert not torch.allclose(wide.float(), got.float(), atol=tol, rtol=tol)


def _own_blocks(nb: int, t: int, st: int) -> torch.Tensor:
    """[nb * t, nb * (st + t)] bool: each row's own session's staged and new keys."""
    own = torch.zeros(nb * t, nb * (st + t), dtype=torch.bool)
    for i in range(nb):
        own[i * t:(i + 1) * t, i * st:(i + 1) * st] = True
        own[i * t:(i + 1) * t, nb * st + i * t:nb * st + (i + 1) * t] = True
    return own


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("store", [False, True])
def test_rope_scatter_equals_rope_and_copies(dtype, store):
    a = SimpleNamespace(num_heads=4, num_kv_heads=2, head_dim=16)  # the ModelArgs fields it reads
    t, (h, g, d) = 5, (4, 2, 16)
    gen = _gen(3)
    qkv = torch.randn(t, (h + 2 * g) * d, generator=gen).to(DEVICE, dtype)
    pos = torch.tensor([3, 4, 4, 5, 9], device=DEVICE)
    cos, sin = Rope(1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))).to(DEVICE).cos_sin(pos, dtype)
    scratch = torch.zeros(2, g, t + 3, d, dtype=dtype, device=DEVICE)  # staged slots first, as in a plan
    kpre = torch.zeros(g, t, d, dtype=dtype, device=DEVICE) if store else None
    q = fused_layer.rope_scatter(a, qkv, cos, sin, scratch[0, :, 3:], scratch[1, :, 3:], kpre)
    qk = apply_rope(qkv[:, :(h + g) * d].view(t, h + g, d), cos[:, None], sin[:, None])  # [T, H + G, D]
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=0, rtol=0)  # FMA or not
    torch.testing.assert_close(q, qk[:, :h].transpose(0, 1), **tol)
    torch.testing.assert_close(scratch[0, :, 3:], qk[:, h:].transpose(0, 1), **tol)
    torch.testing.assert_close(scratch[1, :, 3:], qkv[:, (h + g) * d:].view(t, g, d).transpose(0, 1))
    assert not scratch[:, :, :3].any()  # nothing written outside the destinations
    if store:
        torch.testing.assert_close(kpre, qkv[:, h * d:(h + g) * d].view(t, g, d).transpose(0, 1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,i", [(1, 40), (6, 1500)])
def test_silu_mul_equals_torch(dtype, t, i):
    gu = torch.randn(t, 2 * i, generator=_gen(i)).to(DEVICE, dtype) * 4
    gate, up = gu.chunk(2, dim=-1)
    torch.testing.assert_close(fused_layer.silu_mul(gu), F.silu(gate) * up, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_folded_norm_kernels_equal_norm_then_product(dtype):
    """Folded norms (fused_layer.fold_norms): rope_scatter and silu_mul given x @ (W * w_norm).T
    scale each row by x's 1/RMS (and add the QKV bias) before their own work; equal, within the
    rounding of the products, to RMSNorm, the product and the bias in order (E of 40: a masked
    tail of the row's statistics)."""
    from specextend.models.decoder import rms_norm

    a = SimpleNamespace(num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6)
    t, (h, g, d), e, i = 5, (4, 2, 16), 40, 24
    gen = _gen(11)
    x = (torch.randn(t, e, generator=gen) * 3).to(DEVICE, dtype)
    nw = (torch.rand(e, generator=gen) + 0.5).to(DEVICE, dtype)
    w = (torch.randn((h + 2 * g) * d, e, generator=gen) * 0.2).to(DEVICE, dtype)
    b = torch.randn((h + 2 * g) * d, generator=gen).to(DEVICE, dtype)
    gu_w = (torch.randn(2 * i, e, generator=gen) * 0.2).to(DEVICE, dtype)
    pos = torch.arange(t, device=DEVICE) + 7
    cos, sin = Rope(1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))).to(DEVICE).cos_sin(pos, dtype)
    folded = fused_layer.fold_norms(_layer_of(w, b, gu_w, nw))
    dst = torch.zeros(2, 2, g, t, d, dtype=dtype, device=DEVICE)  # [folded | reference, k | v, G, T, D]
    got = fused_layer.rope_scatter(a, torch.mm(x, folded.qkv.t()), cos, sin, dst[0, 0], dst[0, 1], None,
                                   norm_x=x, bias=b)
    ref = fused_layer.rope_scatter(a, F.linear(rms_norm(x, nw, 1e-6), w, b), cos, sin, dst[1, 0], dst[1, 1], None)
    tol = dict(atol=FOLD_TOL[dtype], rtol=FOLD_TOL[dtype])  # (the products' rounding: values of ~1-5)
    torch.testing.assert_close(got, ref, **tol)
    torch.testing.assert_close(dst[0], dst[1], **tol)
    got = fused_layer.silu_mul(torch.mm(x, folded.gate_up.t()), norm_x=x, eps=1e-6)
    gate, up = F.linear(rms_norm(x, nw, 1e-6), gu_w).chunk(2, dim=-1)
    torch.testing.assert_close(got, F.silu(gate) * up, **tol)


def _layer_of(qkv, bias, gate_up, nw):
    """A LayerWeights of the given products with both norms' weights nw (fold_norms' input)."""
    from specextend.models.decoder import LayerWeights

    return LayerWeights(qkv=qkv, qkv_bias=bias, o=qkv, q_norm=None, k_norm=None, gate_up=gate_up, down=qkv,
                        input_norm=nw, post_norm=nw)


@pytest.mark.parametrize("name", ["llama3", "qwen2"])
def test_folded_norms_full_step_twin_equals_eager(name):
    """A model with its norms folded into its weights (fold_model_norms: 8 kernels a layer under the
    fused plan) computes the unfolded model's function within the rounding the folding adds, for
    every decode-time call kind, through the fused plan and through the paths that run the norms as
    written (eager, the unfused plan); folding again changes nothing; QK-norm models refuse it."""
    dec = decoder_on(name, DEVICE, torch.float32)
    ref = run_calls(dec, dec.forward_eager, DEVICE)
    originals = list(dec.w.layers)
    fused_layer.fold_model_norms(dec)
    folded = fused_layer.FoldedLayerWeights
    assert all(isinstance(lw, folded) for lw in dec.w.layers)
    assert all(bool((lw.input_norm == 1).all() and (lw.post_norm == 1).all()) for lw in dec.w.layers)
    assert not any(torch.equal(lw.qkv, o.qkv) for lw, o in zip(dec.w.layers, originals))  # (norms not all ones)
    layers = list(dec.w.layers)
    fused_layer.fold_model_norms(dec)
    assert all(a is b for a, b in zip(layers, dec.w.layers))
    assert all(isinstance(lw, folded) for lw in dec.w.to(dtype=torch.float64).layers)  # moved or cast: still folded
    for fwd in (FullStepGraphs(dec, capture=False, fused=True).forward, dec.forward_eager,
                FullStepGraphs(dec, capture=False).forward):
        assert_same_run(ref, run_calls(dec, fwd, DEVICE), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="folded norms"):
        fused_layer.fold_model_norms(decoder_on("qwen3", DEVICE, torch.float32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,e", [(1, 40), (17, 896), (3, 4096)])
def test_rms_norm_equals_torch(dtype, t, e):
    """Rows of a non-power-of-two width (masked tail) and of the 8B's 4096."""
    from specextend.models.decoder import rms_norm

    gen = _gen(e)
    x = (torch.randn(t, e, generator=gen) * 3 + 1).to(DEVICE, dtype)
    w = (torch.rand(e, generator=gen) + 0.5).to(DEVICE, dtype)
    torch.testing.assert_close(fused_layer.rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6), atol=TOL[dtype],
                               rtol=TOL[dtype])


@pytest.mark.parametrize("name", ["llama3", "qwen2", "qwen3"])
@pytest.mark.parametrize("skinny", [False, True])
def test_fused_full_step_twin_equals_eager(name, skinny):
    """The full-step forward with the fused kernels (and the skinny linear ones) equals the plain
    forward, for every decode-time call kind (AR, draft levels with staged keys and the store,
    verification with CMR capture)."""
    dec = decoder_on(name, DEVICE, torch.float32)
    ref = run_calls(dec, dec.forward_eager, DEVICE)
    got = run_calls(dec, FullStepGraphs(dec, capture=False, fused=True, skinny=skinny).forward, DEVICE)
    assert_same_run(ref, got, atol=1e-5, rtol=1e-5)


def test_fused_piecewise_twin_equals_eager():
    """The piecewise graphs' one-prefix layout ([H, T, D]) through the fused combine kernel."""
    dec = decoder_on("llama3", DEVICE, torch.float32)
    ref = run_calls(dec, dec.forward_eager, DEVICE)
    got = run_calls(dec, StepGraphs(dec, capture=False, fused=True).forward, DEVICE)
    assert_same_run(ref, got, atol=1e-5, rtol=1e-5)


def test_fused_and_compiled_are_alternatives_and_float64_is_refused():
    with pytest.raises(ValueError, match="pick one"):
        Segments(compile=True, fused=True)
    with pytest.raises(ValueError, match="come with the fused"):
        Segments(skinny=True)
    with pytest.raises(ValueError, match="not torch.float64"):
        FullStepGraphs(decoder_on("llama3", DEVICE, torch.float64), capture=False, fused=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("skinny", [False, True])
def test_captured_fused_full_graphs_equal_twin(dtype, tol, skinny):
    dec = decoder_on("qwen2", "cuda", dtype)
    graphs = FullStepGraphs(dec, capture=True, fused=True, skinny=skinny)
    got = run_calls(dec, graphs.forward, "cuda")
    ref = run_calls(dec, FullStepGraphs(dec, capture=False).forward, "cuda")
    assert graphs.num_graphs == 5 * len(graphs.pieces)
    assert_same_run(ref, got, atol=tol, rtol=tol)



@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused plan is CUDA's")
def test_the_loader_folds_the_norms_of_every_model_under_the_fused_plan(monkeypatch):
    """Target and draft alike (loader.FOLD_NORMS); off, the weights stay as loaded."""
    from specextend.models import loader

    for role in ("target", "draft"):
        m = loader.load_model("random:llama-tiny", role, dtype="bfloat16", device="cuda")
        assert all(isinstance(lw, fused_layer.FoldedLayerWeights) for lw in m.decoder.w.layers)
    monkeypatch.setattr(loader, "FOLD_NORMS", False)
    m = loader.load_model("random:llama-tiny", "target", dtype="bfloat16", device="cuda")
    assert not any(isinstance(lw, fused_layer.FoldedLayerWeights) for lw in m.decoder.w.layers)


def test_the_execution_plan_is_chosen_once_from_the_configuration(tiny_models):
    """execution=auto is the eager plan off CUDA; graphs are refused there with a clear error; the
    production plan takes the fused kernels for every dtype they support."""
    import pytest as _pytest

    from specextend.models.loader import ModelLoadError, attach_plan, fused_kernels_supported, load_model

    t = load_model("random:llama-tiny", dtype="float32", device="cpu", execution="auto")
    assert t.decoder.graphs is None
    with _pytest.raises(ModelLoadError, match="execution=graphs needs CUDA"):
        attach_plan(t.decoder, "graphs")
    assert fused_kernels_supported(t.decoder)
    assert not fused_kernels_supported(tiny_models("float64")[0].decoder)
