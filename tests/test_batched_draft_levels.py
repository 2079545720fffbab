"""The draft's tree levels of several sessions batched through full-step graphs (draft/batch.py
with `batch_levels`; docs/architecture.md, "Batched steps"): a level attends to the levels staged
before it, so only levels after the same number of staged keys share a forward, and the draft
worker's warm-up captures each level's batched shape. On the CPU the graphs' twin runs the Triton
kernels in Triton's interpreter."""

import pytest
import torch

pytest.importorskip("triton")  # a dev dependency: present in CI

from specextend.config import RetrievalConfig, TreeConfig
from specextend.draft.base import DraftSessionParams
from specextend.draft.worker import DraftWorker
from specextend.models.full_graphs import FullStepGraphs
from specextend.models.loader import load_model

from test_batched_graphs import float32_pair
from test_draft_batch import lockstep
from test_draft_expand import RETRIEVAL


@pytest.mark.parametrize("overlap", [False, True])
def test_draft_levels_batch_through_the_graphs(overlap):
    """Four draft sessions' steps driven together (draft/batch.drive_batch) with the draft's
    forwards on full-step graphs (the twin on the CPU): their tree levels, which attend to the
    levels staged before them, run as batched forwards, and every tree equals the step alone."""
    draft = float32_pair()[1].decoder
    draft.graphs = FullStepGraphs(draft, capture=torch.cuda.is_available())
    assert len(list(lockstep(draft, RETRIEVAL, overlap, 4, tol=1e-4, batch_levels=True))) == 4
    batched_plans = [k for k in draft.graphs.plans if k.sessions > 1]
    assert batched_plans, "no level batched"
    if not overlap:  # (with overlap a miss drafts two levels here: the second has nothing staged before it)
        assert [k for k in batched_plans if k.staged > 0], "no level batched after staged keys"


def test_draft_worker_warms_batched_levels():
    """The draft worker's warm-up captures every tree level's batched forward (after 0, k, 2k, ...
    staged keys, k = tree_topk) for 2..max_batch sessions, and from then on those shapes batch."""
    draft = load_model("random:llama-tiny-draft", dtype="float32", attention_backend="torch").decoder
    draft.graphs = FullStepGraphs(draft, capture=False)
    params = DraftSessionParams(TreeConfig(12, 4, 3), RetrievalConfig(), max_new_tokens=16)
    worker = DraftWorker(draft, max_batch=4)  # by default whole trees, never levels, of several sessions
    try:
        worker.warm_up(params)
    finally:
        worker.stop()
    assert not draft.graphs.batch_shapes
    worker = DraftWorker(draft, max_batch=4, batch_levels=True)
    try:
        worker.warm_up(params)
    finally:
        worker.stop()
    assert draft.graphs.batch_shapes == frozenset({(0, 3), (3, 3), (6, 3)})
    assert {(k.staged // k.sessions, k.t // k.sessions, k.sessions) for k in draft.graphs.plans if k.sessions > 1} == {
        (s, 3, n) for s in (0, 3, 6) for n in (2, 4)}
