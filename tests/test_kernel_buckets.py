"""Start-up cost: the fused kernels of the full-step plan compile once per bucket of shapes, not once
per tree size. Overlapped drafting verifies ready trees of any size up to the step's bound and context
lookup grafts chains onto them, so the warm-up meets some 25-50 forward shapes; with the token, key
and split counts as compile-time constants each shape compiled its own kernels, ~0.8 s each on a GPU
host (H200, 2026-11-29: the real pair's replica warm-up compiled ~270 Triton kernels in 226 s,
docs/architecture.md, "Execution plans"). Here every launch's compile key (its constexprs, and the
16-divisibility Triton specializes the other integers on) is recorded over trees of 1 to 33 rows."""

import inspect

import pytest
import torch

pytest.importorskip("triton")

from specextend.attention import _triton_kernels
from specextend.attention.backends import CAUSAL
from specextend.models import _triton_layer
from specextend.models.decoder import ForwardOptions
from specextend.models.full_graphs import FullStepGraphs
from specextend.tree import ancestor_mask

from test_graphs import decoder_on

KERNELS = ((_triton_layer, "tree_combine"), (_triton_layer, "rope_scatter"), (_triton_kernels, "prefix_partials"))


class Recorder:
    """Stands in for a Triton kernel: records each launch's compile key, then launches it."""

    def __init__(self, kernel):
        self.kernel, self.keys = kernel, set()
        fn = getattr(kernel, "fn", kernel)
        self.params = inspect.signature(fn).parameters
        jit_kw = getattr(kernel, "kwargs", None) or {}
        self.fixed = set(getattr(kernel, "do_not_specialize", None) or jit_kw.get("do_not_specialize", ()) or ())

    def _key(self, args, kwargs) -> tuple:
        own = {k: v for k, v in kwargs.items() if k in self.params}
        bound = inspect.signature(getattr(self.kernel, "fn", self.kernel)).bind_partial(*args, **own).arguments
        key = [tuple(sorted((k, v) for k, v in kwargs.items() if k not in self.params))]  # num_warps, ...
        for name, value in bound.items():
            constexpr = "constexpr" in str(self.params[name].annotation)
            if constexpr:
                key.append((name, value))
            elif isinstance(value, torch.Tensor):
                key.append((name, value.dtype))
            elif isinstance(value, int) and name not in self.fixed:
                key.append((name, value % 16 == 0, value == 1))
        return tuple(key)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.keys.add(self._key(args, kwargs))
            return self.kernel[grid](*args, **kwargs)
        return launch


def test_trees_of_every_size_share_a_few_compiled_kernels(monkeypatch):
    recorders = {}
    for module, name in KERNELS:
        recorders[name] = Recorder(getattr(module, name))
        monkeypatch.setattr(module, name, recorders[name])
    dec = decoder_on("qwen2", "cpu", torch.float32)
    graphs = FullStepGraphs(dec, capture=False, fused=True)
    cache = dec.new_cache(128)
    gen = torch.Generator().manual_seed(0)
    dec.forward_eager(torch.randint(0, dec.args.vocab_size, (20,), generator=gen), torch.arange(20), cache, CAUSAL,
                      ForwardOptions())
    cache.advance(20)
    sizes = (1, 2, 3, 5, 9, 12, 16, 17, 25, 33)  # (the interpreter takes ~0.7 s a forward)
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
