"""Piecewise step graphs (models/graphs.py) against the plain forward.

On any device the segmented forward (the graphs' slow twin, capture=False) must equal
Decoder.forward_eager for every decode-time call the engine makes: AR decode, committed forwards
with the retrieval store, tree verification with the CMR capture, deeper draft levels over staged
keys, logits rows; with plans reused at a new prefix length. On CUDA the captured graphs must
equal the twin. And engines running through the twin stay lossless.
"""

import pytest
import torch

from specextend.attention.backends import CAUSAL
from specextend.config import EngineConfig, RetrievalConfig, SamplingParams, TreeConfig
from specextend.draft.worker import DraftWorker
from specextend.engine import Engine
from specextend.models.decoder import ForwardOptions
from specextend.models.graphs import StepGraphs
from specextend.models.loader import load_model
from specextend.tree import ancestor_mask

from helpers import build_pair

PARENTS = [-1, -1, 0, 0, 2, 4]  # a 6-node tree: two roots' children, a branch of depth 4


def decoder_on(name, device="cpu", dtype=torch.float64):
    """A tiny decoder of architecture `name` (helpers.CONFIGS) on `device` in `dtype`."""
    _, dec = build_pair(name, "torch")
    dec.w = dec.w.to(device=device, dtype=dtype)
    dec.rope = dec.rope.to(device)
    return dec


def run_calls(dec, fwd, device, seed=0, capture=True):
    """The engine's decode-time call sequence through `fwd`; returns every output and the caches."""
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(0, dec.args.vocab_size, (n,), generator=g).to(device)  # noqa: E731
    ar = lambda a, b: torch.arange(a, b, device=device)  # noqa: E731
    cache, store = dec.new_cache(96), dec.new_cache(96)
    outs = []
    dec.forward_eager(ids(20), ar(0, 20), cache, CAUSAL, ForwardOptions(store=store))
    cache.advance(20)
    store.advance(20)
    for _ in range(2):  # the second round reuses every plan at a longer prefix
        L = cache.length
        outs.append(fwd(ids(1), ar(L, L + 1), cache, CAUSAL, ForwardOptions())[0])  # AR decode
        cache.advance(1)
        L = cache.length
        rows = torch.tensor([2], device=device)
        outs.append(fwd(ids(3), ar(L, L + 3), cache, CAUSAL, ForwardOptions(store=store, logits_rows=rows))[0])
        cache.advance(3)
        store.advance(3)
        L = cache.length
        depths = torch.tensor([0, 1, 1, 2, 2, 3, 4], device=device)
        logits, cap = fwd(ids(7), L + depths, cache, ancestor_mask(PARENTS, device),
                          ForwardOptions(capture_last=capture))
        outs += [logits, cap.q, cap.lse] if capture else [logits]
        cache.commit(torch.tensor([0, 1, 3]))
        L = cache.length
        # draft levels: 2 frontier nodes, then 2 more that see their parents among the staged keys
        outs.append(fwd(ids(2), torch.full((2,), L, device=device), cache,
                        torch.eye(2, dtype=torch.bool, device=device), ForwardOptions())[0])
        m2 = torch.tensor([[1, 0, 1, 0], [0, 1, 0, 1]], dtype=torch.bool, device=device)
        outs.append(fwd(ids(2), torch.full((2,), L + 1, device=device), cache, m2,
                        ForwardOptions(staged=2))[0])
        cache.advance(1)
    return outs, cache.data[:, :, :, :cache.length + 4].clone(), store.data[:, :, :, :store.length].clone()


def assert_same_run(ref, got, atol, rtol):
    for a, b in zip(ref[0], got[0]):
        torch.testing.assert_close(b, a, atol=atol, rtol=rtol)
    torch.testing.assert_close(got[1], ref[1], atol=atol, rtol=rtol)  # cache incl. staged slots
    torch.testing.assert_close(got[2], ref[2], atol=atol, rtol=rtol)  # retrieval store


@pytest.mark.parametrize("name", ["llama3", "qwen2", "qwen3"])
def test_segmented_forward_equals_eager(name):
    dec = decoder_on(name)
    twin = StepGraphs(dec, capture=False)
    ref = run_calls(dec, dec.forward_eager, "cpu")
    got = run_calls(dec, twin.forward, "cpu")
    assert_same_run(ref, got, atol=1e-10, rtol=1e-10)
    assert len(twin.plans) == 5  # one plan per shape, each used twice


def test_only_small_hybrid_forwards_are_graphed():
    _, dec = build_pair("llama3", "torch")
    gr = StepGraphs(dec, capture=False, max_tokens=8)
    cache = dec.new_cache(64)
    tree = torch.ones(2, 2, dtype=torch.bool)
    assert not gr.accepts(2, cache, tree, ForwardOptions())  # empty prefix: prefill
    cache.length = 10
    assert gr.accepts(1, cache, CAUSAL, ForwardOptions())
    assert gr.accepts(2, cache, tree, ForwardOptions(staged=3))
    assert not gr.accepts(9, cache, CAUSAL, ForwardOptions())  # a prefill chunk
    assert not gr.accepts(2, cache, tree, ForwardOptions(hybrid=False))  # plain masked baseline
    assert not gr.accepts(1, cache, CAUSAL, ForwardOptions(window=4))  # windowed draft prefill


RETRIEVAL = RetrievalConfig(enabled=True, chunk_size=8, top_k=4, every=2, draft_prefill_window=16)


@pytest.fixture(scope="module")
def twin_pair():
    """The tiny float64 pair with every decode-time forward through the segmented twin."""
    t = load_model("random:llama-tiny", dtype="float64", attention_backend="torch")
    d = load_model("random:llama-tiny-draft", role="draft", dtype="float64", attention_backend="torch",
                   vocab_size=t.args.vocab_size, target_weights=t.decoder.w)
    t.decoder.graphs = StepGraphs(t.decoder, capture=False)  # as load_model sets them on CUDA
    d.decoder.graphs = StepGraphs(d.decoder, capture=False)
    return t, d


@pytest.mark.parametrize("mode,kw", [("ar", {}), ("sd", dict(hybrid_attention=True)),
                                     ("specextend", dict(retrieval=RETRIEVAL))], ids=["ar", "sd+hta", "specextend"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_engine_through_twin_is_lossless(tiny_models, twin_pair, mode, kw, temperature):
    plain_t, _ = tiny_models("float64")
    ref_engine = Engine(EngineConfig(mode="ar"), plain_t, None)
    t, d = twin_pair
    engine = Engine(EngineConfig(mode=mode, tree=TreeConfig(12, 4, 3), tree_policy="fixed", **kw), t,
                    None if mode == "ar" else DraftWorker(d.decoder))
    prompt = torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(3)).tolist()
    params = SamplingParams(max_new_tokens=40, temperature=temperature, seed=11, ignore_eos=True)
    ref, _, _ = ref_engine.generate(prompt, params)
    out, _, stats = engine.generate(prompt, params)
    assert out == ref
    assert t.decoder.graphs.forwards  # the twins really ran
    if mode != "ar":
        assert d.decoder.graphs.forwards and stats.num_steps < 40


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_captured_graphs_equal_twin(dtype, tol):
    dec = decoder_on("qwen3", "cuda", dtype)
    graphs = StepGraphs(dec, capture=True)
    twin = StepGraphs(dec, capture=False)
    got = run_calls(dec, graphs.forward, "cuda")
    ref = run_calls(dec, twin.forward, "cuda")
    assert graphs.num_graphs == 5 * (dec.args.num_layers + 1)
    assert_same_run(ref, got, atol=tol, rtol=tol)


# Inductor on the CPU builds C++ (about a minute for one architecture on two cores): one
# architecture goes through Inductor, the other through Dynamo + AOTAutograd only (the same traced
# graphs, run by ATen), so both layer variants are traced and one is compiled in CI.
@pytest.mark.parametrize("name,backend", [("qwen3", "inductor"), ("llama3", "aot_eager")])
def test_compiled_segments_equal_twin(name, backend):
    """The segments compiled by torch.compile (graphs.py's fast path on CUDA) equal the plain ones
    for every call kind, with the plans' shape changes recompiling rather than mis-running."""
    from specextend.models.segments import Segments

    dec = decoder_on(name, "cpu", torch.float32)
    twin = StepGraphs(dec, capture=False)
    comp = StepGraphs(dec, capture=False)
    comp.seg = Segments(compile=True, backend=backend)
    with torch.inference_mode():
        ref = run_calls(dec, twin.forward, "cpu")
        got = run_calls(dec, comp.forward, "cpu")
    assert_same_run(ref, got, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("name", ["llama3", "qwen3"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_captured_compiled_graphs_equal_twin(name, dtype, tol):
    """Inductor-compiled segments captured in the CUDA graphs equal the plain twin."""
    dec = decoder_on(name, "cuda", dtype)
    graphs = StepGraphs(dec, capture=True, compile=True)
    got = run_calls(dec, graphs.forward, "cuda")
    ref = run_calls(dec, StepGraphs(dec, capture=False).forward, "cuda")
    assert graphs.num_graphs == 5 * (dec.args.num_layers + 1)
    assert_same_run(ref, got, atol=tol, rtol=tol)


@pytest.mark.parametrize("capture", [False, pytest.param(True, marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device"))])
def test_sessions_interleaved_through_shared_plans(capture):
    """Two sessions (own caches, different lengths) alternate decode and verify steps through one
    set of plans, as the replica's engine thread interleaves requests: each equals its eager run."""
    device = "cuda" if capture else "cpu"
    dec = decoder_on("llama3", device, torch.float32 if capture else torch.float64)
    graphs = StepGraphs(dec, capture=capture)
    tol = 1e-5 if capture else 1e-10

    def session(n, seed):
        ids = torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed)).to(device)
        caches = [dec.new_cache(96), dec.new_cache(96)]
        for c in caches:  # one cache for the graphed path, one for the eager reference
            dec.forward_eager(ids, torch.arange(n, device=device), c, CAUSAL, ForwardOptions())
            c.advance(n)
        return caches

    a, b = session(20, 1), session(33, 2)
    mask = ancestor_mask(PARENTS, device)
    depths = torch.tensor([0, 1, 1, 2, 2, 3, 4], device=device)
    for step in range(3):
        for s, (cg, ce) in enumerate((a, b)):
            tok = torch.tensor([5 + 7 * step + s], device=device)
            pos = torch.tensor([cg.length], device=device)
            got = graphs.forward(tok, pos, cg, CAUSAL, ForwardOptions())[0]
            ref = dec.forward_eager(tok, pos, ce, CAUSAL, ForwardOptions())[0]
            torch.testing.assert_close(got, ref, atol=tol, rtol=tol)
            cg.advance(1)
            ce.advance(1)
            tree = torch.arange(7, device=device) + step
            got = graphs.forward(tree, cg.length + depths, cg, mask, ForwardOptions())[0]
            ref = dec.forward_eager(tree, ce.length + depths, ce, mask, ForwardOptions())[0]
            torch.testing.assert_close(got, ref, atol=tol, rtol=tol)
            for c in (cg, ce):
                c.commit(torch.tensor([0, 2]))
    assert len(graphs.plans) == 2


@pytest.mark.parametrize("capture", [False, pytest.param(True, marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device"))])
def test_plans_serve_calls_in_and_out_of_inference_mode(capture):
    """The engine steps in torch.inference_mode, the draft's gRPC threads do not: a plan built by
    one must take the other's in-place input copies (H100, 2026-11-23: it raised, and every draft
    over gRPC fell back to plain decoding)."""
    device = "cuda" if capture else "cpu"
    dec = decoder_on("llama3", device, torch.float32 if capture else torch.float64)
    graphs = StepGraphs(dec, capture=capture)
    cache = dec.new_cache(64)
    ids = torch.arange(10, device=device) + 3
    dec.forward_eager(ids, torch.arange(10, device=device), cache, CAUSAL, ForwardOptions())
    cache.advance(10)
    tok, pos = torch.tensor([5], device=device), torch.tensor([10], device=device)
    with torch.inference_mode():
        inside = graphs.forward(tok, pos, cache, CAUSAL, ForwardOptions())[0]  # builds the plan
    outside = graphs.forward(tok, pos, cache, CAUSAL, ForwardOptions())[0]  # the same plan
    assert torch.equal(inside, outside) and len(graphs.plans) == 1
