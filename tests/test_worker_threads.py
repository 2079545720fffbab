"""On the CPU the draft worker's thread runs with its own intra-op thread count (draft/worker.py,
CPU_THREADS; docs/architecture.md, "Draft side"): OpenMP's count is per thread, and a second team
of threads beside the target's oversubscribed two cores (the tiny pair's `sd` at 193-210 tokens/s
against 312-320 with one thread for the draft, `specextend generate`, 2026-11-29)."""

import torch

from specextend.config import TreeConfig
from specextend.draft import worker as w
from specextend.draft.base import DraftSessionParams
from specextend.draft.worker import DraftWorker


def test_the_draft_drafts_with_its_own_thread_count_and_leaves_the_callers(tiny_models, monkeypatch):
    _, draft = tiny_models("float64")
    seen = []
    forward = draft.decoder.forward

    def spy(*args, **kw):
        seen.append(torch.get_num_threads())
        return forward(*args, **kw)

    monkeypatch.setattr(draft.decoder, "forward", spy)
    mine = torch.get_num_threads()
    worker = DraftWorker(draft.decoder)
    try:
        worker.open("s", list(range(3, 40)), DraftSessionParams(TreeConfig(4, 2, 2), max_new_tokens=8))
        tree = worker.step("s", 0, [40])
    finally:
        worker.shutdown()
    assert tree.tokens and seen and set(seen) == {w.CPU_THREADS}
    assert torch.get_num_threads() == mine  # the caller's thread keeps its own
