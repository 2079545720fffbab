"""The draft worker's own CUDA stream (docs/architecture.md, "Overlapped drafting", one GPU): on the
target's GPU its kernels run beside the target's. Nothing crosses the two threads on the device
but a retrieval selection, read after an event; an engine with overlap whose draft shares the
target's GPU must decode what the target alone decodes."""

from __future__ import annotations

import pytest
import torch

from specextend.config import SamplingParams

CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))


def _prompt(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("own", [True, False])
@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_the_worker_thread_queues_on_a_stream_of_its_own(device, own):
    """Beside a target in its process, the worker's thread queues on a stream of its own; alone on
    its GPU (a draft actor: own_stream=False) on the default stream, as before."""
    from specextend.builder import load_pair
    from specextend.config import EngineConfig
    from specextend.draft.jobs import Close, Job
    from specextend.draft.worker import DraftWorker

    _, draft = load_pair(EngineConfig(target="random:llama-tiny", draft="random:llama-tiny-draft", device=device,
                                      dtype="float32"))
    seen = {}

    class Probe(DraftWorker):
        def _do(self, job: Job):
            if device == "cuda":
                seen["stream"] = torch.cuda.current_stream()
            return None

    w = Probe(draft.decoder, own_stream=own)
    try:
        w.submit(Close("probe")).result(timeout=30)
    finally:
        w.shutdown()
    if device == "cpu" or not own:
        assert w.stream is None
    if device == "cuda" and own:
        assert w.stream is not None and seen["stream"] == w.stream
        assert seen["stream"] != torch.cuda.default_stream()  # the target's (this thread's) stream
    elif device == "cuda":
        assert seen["stream"] == torch.cuda.default_stream()


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_overlap_beside_the_target_on_its_device_decodes_what_the_target_does(device):
    """An engine as the CLI builds it with overlap on and both models on one device: greedy
    output equals `ar`'s (float32: any difference must sit at a near-tie of the target's logits),
    with trees verified from the overlap pool."""
    from dataclasses import replace

    from specextend.builder import build_engine
    from specextend.config import EngineConfig, TreeConfig
    from specextend.near_tie import lossless_check

    cfg = EngineConfig(target="random:llama-tiny", draft="random:llama-tiny-draft", mode="specextend",
                       device=device, dtype="float32", prefill_chunk=64, draft_overlap=True, tree_policy="fixed",
                       tree=TreeConfig(nodes=8, depth=3, topk=2), lookup_tokens=0)
    engine = build_engine(cfg)
    ar = replace(cfg, mode="ar")
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    ready = verified = 0
    try:
        for i, n in enumerate([30, 200]):
            prompt = _prompt(n, i)
            engine.config = ar
            want = engine.generate(prompt, params)[0]
            engine.config = cfg
            got, _, stats = engine.generate(prompt, params)
            check = lossless_check(engine.target.decoder, prompt, want, got, 1e-3)
            assert check["near_tie"], check
            ready += stats.ready_steps
            verified += stats.num_steps
    finally:
        engine.draft.shutdown()
    assert verified > 0 and ready > 0  # the pool answered some steps


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("asked", [None, False, True])
def test_an_in_process_engine_overlaps_only_when_asked(device, asked):
    """Unset, overlap is off in process, on a GPU too (sharing it, overlap pays for some pairs and
    loses for others: docs/architecture.md); set, as set."""
    from specextend.builder import build_engine
    from specextend.config import EngineConfig

    engine = build_engine(EngineConfig(target="random:llama-tiny", draft="random:llama-tiny-draft", mode="sd",
                                       device=device, dtype="float32", draft_overlap=asked))
    try:
        assert engine.config.overlap is bool(asked) and engine.draft.overlap is bool(asked)
    finally:
        engine.draft.shutdown()
