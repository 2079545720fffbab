"""A draft's open is done when its prefill has run on the device, not when its kernels are queued
(docs/architecture.md, "Draft side"): the engine joins a done open and asks for a tree at once,
which would otherwise wait behind the queued prefill. On an H200 (2026-12-01) this test passed, and
failed with the open's synchronise taken out."""

from __future__ import annotations

import pytest
import torch

from specextend.config import RetrievalConfig, TreeConfig
from specextend.draft.base import DraftSessionParams
from specextend.draft.worker import DraftWorker
from specextend.models.loader import load_model


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a device's queue of kernels: CUDA only (a CPU "
                    "runs each op as it is called)")
def test_an_open_returns_once_its_prefill_has_run_on_the_device():
    """The real draft's geometry (random weights, bf16) prefilling 16K tokens: its launches take a
    fraction of its device time, so without the open's synchronise its stream is still busy when
    the open returns."""
    draft = load_model("random:qwen2.5-0.5b", role="draft", dtype="bfloat16", device="cuda")
    worker = DraftWorker(draft.decoder)
    params = DraftSessionParams(TreeConfig(16, 6, 4), RetrievalConfig(), max_new_tokens=64)
    prompt = [(13 * i + 7) % 151_000 for i in range(16_384)]
    try:
        for k in range(3):  # (the first open compiles and warms; every one must end on an idle stream)
            worker.open(f"s{k}", prompt, params)
            assert worker.stream is not None and worker.stream.query(), f"open {k}: its prefill still queued"
            worker.close(f"s{k}")
    finally:
        worker.shutdown()
