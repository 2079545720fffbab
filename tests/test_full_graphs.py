"""Full-step graphs (models/full_graphs.py) and their Triton split-KV prefix kernel.

On the CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py before
Triton is imported), so CI checks the same kernel code the GPU compiles: against its torch
reference, merged against the one-shot prefix attention, and the whole full-step forward (the
graphs' twin) against Decoder.forward_eager for every decode-time call kind. On CUDA the captured
graphs must equal the twin, with sessions of different caches interleaved through one plan.
"""

import os

import pytest
import torch

pytest.importorskip("triton")  # a dev dependency: present in CI

from specextend.attention.backends import CAUSAL, sdpa_lse
from specextend.attention.tree_merge import mask_bias, tree_attention_merged
from specextend.attention.triton_prefix import (cache_meta, config, num_splits, partials_reference, split_chunk,
                                                 prefix_partials)
from specextend.models.decoder import ForwardOptions
from specextend.models.full_graphs import FullStepGraphs, full_graphs_supported, launch_pieces
from specextend.tree import ancestor_mask

from test_graphs import PARENTS, assert_same_run, decoder_on, run_calls

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

if DEVICE == "cpu":
    assert os.environ.get("TRITON_INTERPRET") == "1", "conftest.py sets Triton's interpreter on the CPU"
# Triton's interpreter misreads bfloat16 memory (float16 exercises the same half-precision path)
DTYPES = [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("length,splits,d,min_chunk", [(200, 4, 32, 16), (37, 8, 24, 16), (1, 3, 16, 16),
                                                      (200, 8, 32, 64)])
def test_prefix_partials_equal_reference(dtype, length, splits, d, min_chunk):
    """Every split's (out, lse), empty splits included (lse -inf, out 0), and their merge equals
    attention over the whole prefix; the kernel reads layer 1 of a cache through its address. A
    minimum chunk of 64 keys fills 4 of 8 splits with 200 keys (25 keys a split without it)."""
    gen = torch.Generator().manual_seed(length)
    layers, g, cap, rows = 2, 2, 256, 10
    data = torch.randn(layers, 2, g, cap, d, generator=gen).to(DEVICE, dtype)  # KVCache.data layout
    q = torch.randn(g, rows, d, generator=gen).to(DEVICE, dtype)
    anchor = torch.zeros(16, dtype=dtype, device=DEVICE)
    meta = torch.tensor(cache_meta(data, anchor, length), dtype=torch.int64, device=DEVICE)
    out = torch.full((g, splits, rows, d), float("nan"), device=DEVICE)  # poisoned: all must be written
    lse = torch.full((g, splits, rows), float("nan"), device=DEVICE)
    prefix_partials(q, anchor, meta, 1, 0.3, out, lse, block_n=16, min_chunk=min_chunk)
    ref_out, ref_lse = partials_reference(q, data[1, 0], data[1, 1], length, splits, 0.3, block_n=16,
                                          min_chunk=min_chunk)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(lse, ref_lse, atol=tol, rtol=tol)
    torch.testing.assert_close(out, ref_out, atol=tol, rtol=tol)
    used = -(-length // split_chunk(length, splits, 16, min_chunk))
    assert used == (4 if min_chunk == 64 else min(splits, -(-length // 16)))
    assert torch.isinf(lse[:, used:]).all() and not torch.isinf(lse[:, :used]).any()  # the first `used` filled
    w = torch.softmax(lse, dim=1)  # [G, S, rows]
    merged = (w[..., None] * out).sum(1)
    whole, _ = sdpa_lse(q.float()[None], data[1, 0, :, :length].float()[None],
                        data[1, 1, :, :length].float()[None], False, 0.3)
    torch.testing.assert_close(merged, whole[0], atol=tol, rtol=tol)


def test_tree_merge_of_partials_equals_single_prefix():
    """The tree merge over S prefix partials equals the merge over their one-shot equivalent."""
    gen = torch.Generator().manual_seed(0)
    h, g, t, n, d, L, s = 4, 2, 4, 4, 8, 50, 5  # ancestor_mask adds the root: 4 nodes
    q = torch.randn(h, t, d, generator=gen, dtype=torch.float64)
    kt, vt = torch.randn(2, g, n, d, generator=gen, dtype=torch.float64)
    kp, vp = torch.randn(2, g, L, d, generator=gen, dtype=torch.float64)
    bias = mask_bias(ancestor_mask([-1, 0, 0], "cpu"), h // g, torch.float64)
    qf = q.reshape(g, (h // g) * t, d)
    parts = partials_reference(qf, kp, vp, L, s, 0.4, block_n=4, min_chunk=4)
    whole, whole_lse = sdpa_lse(qf[None], kp[None], vp[None], False, 0.4)
    ref, ref_lse = tree_attention_merged(q, kt, vt, bias, whole[0].reshape(h, t, d), whole_lse[0].reshape(h, t),
                                         0.4, need_lse=True)
    got, got_lse = tree_attention_merged(q, kt, vt, bias, *parts, 0.4, need_lse=True)
    torch.testing.assert_close(got, ref, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(got_lse, ref_lse, atol=1e-12, rtol=1e-12)


def test_prefix_key_blocks_by_rows_and_head_dim():
    """An AR step's rows read 128 keys at a time; 17-64 rows 64 with head dims over 64 (the 1.5B's
    lookup verifies) and 128 with head dims of 64 or less (the 0.5B draft's levels); float32 32."""
    assert config(6, False, 128)["block_n"] == 128
    assert config(24, False, 128)["block_n"] == 64 and config(28, False, 64)["block_n"] == 128
    assert config(28, True, 64)["block_n"] == 32
    assert config(102, False, 64)["block_n"] == 64  # larger trees: as before, whatever the head dim


def test_num_splits_fills_the_machine():
    assert num_splits(4, 8, 132) == 16  # AR decode: one row block per KV head, 128 programs
    assert num_splits(68, 8, 132) == 16  # a 17-node tree: one row block of 128
    assert num_splits(204, 8, 132) == 8  # a 51-node tree: two row blocks of 128
    assert num_splits(4096, 8, 132) == 1
    assert num_splits(4, 2, 132) == 64  # at most MAX_SPLITS partials (two KV heads: 66 would fill the machine)
    assert num_splits(204, 8, 132, ieee=True) == 2  # float32: row blocks of 32 (seven per KV head)


@pytest.mark.parametrize("name", ["llama3", "qwen3"])
def test_full_step_twin_equals_eager(name):
    """The full-step forward (segments + the Triton prefix kernel) equals the plain forward."""
    dec = decoder_on(name, DEVICE, torch.float32)
    assert full_graphs_supported(dec)
    ref = run_calls(dec, dec.forward_eager, DEVICE)
    got = run_calls(dec, FullStepGraphs(dec, capture=False).forward, DEVICE)
    assert_same_run(ref, got, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("compile,split", [(False, True), (False, False), (True, True)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_captured_full_graphs_equal_twin(dtype, tol, compile, split):
    dec = decoder_on("qwen3", "cuda", dtype)
    graphs = FullStepGraphs(dec, capture=True, compile=compile, split_launch=split)
    got = run_calls(dec, graphs.forward, "cuda")
    ref = run_calls(dec, FullStepGraphs(dec, capture=False).forward, "cuda")
    assert len(graphs.pieces) == (2 if split else 1)  # split: the residual and q cross graphs
    assert graphs.num_graphs == 5 * len(graphs.pieces)  # per shape, replayed in the second round
    assert_same_run(ref, got, atol=tol, rtol=tol)


@pytest.mark.parametrize("capture", [False, pytest.param(True, marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device"))])
def test_sessions_interleaved_through_one_full_graph(capture):
    """Sessions with their own caches (different addresses, capacities, lengths) alternate through
    one plan per shape: each equals its own eager run."""
    dec = decoder_on("llama3", DEVICE, torch.float32)
    graphs = FullStepGraphs(dec, capture=capture)

    def session(n, cap, seed):
        ids = torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed)).to(DEVICE)
        caches = [dec.new_cache(cap), dec.new_cache(cap)]
        for c in caches:  # one for the graphed path, one for the eager reference
            dec.forward_eager(ids, torch.arange(n, device=DEVICE), c, CAUSAL, ForwardOptions())
            c.advance(n)
        return caches

    sessions = [session(20, 96, 1), session(45, 128, 2)]
    mask = ancestor_mask(PARENTS, DEVICE)
    depths = torch.tensor([0, 1, 1, 2, 2, 3, 4], device=DEVICE)
    for step in range(3):
        for s, (cg, ce) in enumerate(sessions):
            tok = torch.tensor([5 + 7 * step + s], device=DEVICE)
            pos = torch.tensor([cg.length], device=DEVICE)
            got = graphs.forward(tok, pos, cg, CAUSAL, ForwardOptions())[0]
            ref = dec.forward_eager(tok, pos, ce, CAUSAL, ForwardOptions())[0]
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
            for c in (cg, ce):
                c.advance(1)
            tree = torch.arange(7, device=DEVICE) + step
            got = graphs.forward(tree, cg.length + depths, cg, mask, ForwardOptions())[0]
            ref = dec.forward_eager(tree, ce.length + depths, ce, mask, ForwardOptions())[0]
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
            for c in (cg, ce):
                c.commit(torch.tensor([0, 2]))
    assert len(graphs.plans) == 2


@pytest.mark.parametrize("steps", [1, 2, 3, 7, 17, 25, 29, 33])
def test_launch_pieces_cover_the_body_in_doubling_graphs(steps):
    """Pieces of 1, 2, 4, ... layers, in order, covering every body step once; a short tail joins
    the piece before it; unsplit, one piece."""
    pieces = launch_pieces(steps)
    assert [i for p in pieces for i in p] == list(range(steps))
    sizes = [len(p) for p in pieces]
    assert all(sizes[k] == 2 ** k for k in range(len(sizes) - 1))  # every piece but the last doubles
    assert len(sizes) == 1 or sizes[-1] >= 2 ** (len(sizes) - 1) // 2  # no short tail of its own
    assert launch_pieces(steps, split=False) == [range(steps)]
