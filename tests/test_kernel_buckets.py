"""Start-up cost: the fused kernels of the full-step plan compile once per bucket of shapes, not once
per tree size. Overlapped drafting verifies ready trees of any size up to the step's bound and context
lookup grafts chains onto them, so the warm-up meets some 25-50 forward shapes; with the token, key
and split counts as compile-time constants each shape compiled its own kernels, ~0.8 s each on a GPU
host (H200, 2026-11-29: the real pair's replica warm-up compiled ~270 Triton kernels in 226 s,
docs/architecture.md, "Execution plans"). Here every launch's compile key (its constexprs, and the
16-divisibility Triton specializes the other integers on) is recorded over trees of 1 to 33 rows."""

import pytest
import torch

pytest.importorskip("triton")

from specextend.attention import _triton_kernels
from specextend.attention.backends import CAUSAL
from specextend.bench.compile_keys import recording
from specextend.models import _triton_layer
from specextend.models.decoder import ForwardOptions
from specextend.models.full_graphs import FullStepGraphs
from specextend.tree import ancestor_mask

from test_graphs import decoder_on

KERNELS = ((_triton_layer, "tree_combine"), (_triton_layer, "rope_scatter"), (_triton_kernels, "prefix_partials"))


def test_trees_of_every_size_share_a_few_compiled_kernels():
    dec = decoder_on("qwen2", "cpu", torch.float32)
    graphs = FullStepGraphs(dec, capture=False, fused=True)
    cache = dec.new_cache(128)
    gen = torch.Generator().manual_seed(0)
    dec.forward_eager(torch.randint(0, dec.args.vocab_size, (20,), generator=gen), torch.arange(20), cache, CAUSAL,
                      ForwardOptions())
    cache.advance(20)
    sizes = (1, 2, 3, 5, 9, 12, 16, 17, 25, 33)  # (the interpreter takes ~0.7 s a forward)
    with recording(list(KERNELS)) as recorders:
        for t in sizes:  # a root and t - 1 nodes in a chain: the verify forward's rows, with and without capture
            for capture in (False, True):
                mask = CAUSAL if t == 1 else ancestor_mask([-1] + list(range(t - 2)), "cpu")
                graphs.forward(torch.randint(0, dec.args.vocab_size, (t,), generator=gen), torch.arange(20, 20 + t),
                               cache, mask, ForwardOptions(capture_last=capture))
    counts = {name: len(r.keys) for name, r in recorders.items()}
    # compiled once per bucket (key blocks of 16, the splits' power of two, row blocks, the LSE), not
    # per size: 20 tree_combine, 10 rope_scatter and 18 prefix_partials specializations before (the
    # three counts as compile-time constants, the layer index specialized)
    assert counts["rope_scatter"] == 1, counts
    assert counts["tree_combine"] <= 6 and counts["prefix_partials"] <= 2, counts
    assert _triton_layer.tree_combine is recorders["tree_combine"].kernel  # (put back)


def test_a_recorded_key_tells_what_triton_specializes_on():
    from specextend.bench.compile_keys import Recorder

    r = Recorder(_triton_kernels.prefix_partials)
    q = torch.zeros(2, 4)
    base = dict(G=2, D=16, DP=16, BLOCK_M=16, BLOCK_N=32, MIN_CHUNK=128, IEEE=True, INTERPRET=True, num_warps=8)
    key = lambda **kw: r.key((q, q, q, q, q, 0.5, 3, 12, 6, 1, 4), {**base, **kw})  # noqa: E731
    assert key() == key()
    assert key(BLOCK_M=32) != key()  # a constexpr
    assert key(num_warps=4) != key()  # a launch option
    assert r.key((q, q, q, q, q, 0.5, 16, 32, 16, 1, 1), base) == key()  # layer, M, T, NB, SPLITS: not specialized
    r = Recorder(_triton_layer.silu_mul)
    assert r.key((q, q), dict(I=64, BLOCK=64)) != r.key((q.double(), q), dict(I=64, BLOCK=64))  # a dtype
