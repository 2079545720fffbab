"""The cross-model signal may arrive late, twice, or never; the draft may be remote: the output
never changes (float64, exact)."""

import pytest
import torch

from specextend.config import RetrievalConfig, SamplingParams, TreeConfig
from specextend.draft.base import DraftSessionParams, Retrieval
from specextend.draft.chaos import Chaos, ChaosDraft
from specextend.draft.worker import DraftWorker
from specextend.rpc import DraftServerThread, GrpcDraftBackend

from helpers import make_engine

RETRIEVAL = RetrievalConfig(enabled=True, chunk_size=8, top_k=4, every=2, draft_prefill_window=16)
TREE = TreeConfig(12, 4, 3)
PARAMS = SamplingParams(max_new_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tiny_models):
    pair = tiny_models("float64")
    prompt = torch.randint(0, 256, (120,), generator=torch.Generator().manual_seed(4)).tolist()
    ref, _, _ = make_engine(pair, "ar").generate(prompt, PARAMS)
    return pair, prompt, ref


@pytest.fixture(scope="module")
def remote(setup):
    pair = setup[0]
    server = DraftServerThread(DraftWorker(pair[1].decoder), "127.0.0.1", 0)
    client = GrpcDraftBackend(server.address)
    yield client
    client.shutdown()
    server.stop()


@pytest.mark.parametrize("chaos", [
    Chaos(), Chaos(delay_steps=1), Chaos(delay_steps=5), Chaos(drop_rate=0.5, seed=1), Chaos(drop_rate=1.0),
    Chaos(duplicate=True), Chaos(delay_steps=2, drop_rate=0.3, duplicate=True, seed=2),
], ids=str)
def test_perturbed_signal_over_grpc_keeps_output(setup, remote, chaos):
    pair, prompt, ref = setup
    draft = ChaosDraft(remote, chaos)
    out, _, stats = make_engine(pair, "specextend", draft_backend=draft, tree=TREE, retrieval=RETRIEVAL).generate(
        prompt, PARAMS)
    assert out == ref and not stats.fallback and stats.retrieval_refreshes > 0


def test_grpc_and_in_process_identical(setup, remote):
    pair, prompt, _ = setup
    local = make_engine(pair, "specextend", tree=TREE, retrieval=RETRIEVAL).generate(prompt, PARAMS)
    over = make_engine(pair, "specextend", draft_backend=remote, tree=TREE, retrieval=RETRIEVAL).generate(prompt, PARAMS)
    assert over[0] == local[0]
    assert over[2].accepted_per_step == local[2].accepted_per_step
    assert over[2].draft_cache_tokens == local[2].draft_cache_tokens


def test_retried_step_is_applied_once(setup):
    pair, prompt, _ = setup
    draft = DraftWorker(pair[1].decoder)
    draft.open("s", prompt, DraftSessionParams(TREE, RETRIEVAL, 16))
    first = draft.step("s", 0, [7], None)
    length = draft.session("s").work.length
    again = draft.step("s", 0, [7], Retrieval((0, 1), 8))  # a retry carries nothing new
    assert again == first and draft.session("s").work.length == length
    assert draft.refreshes("s") == 1  # the initial selection only
    draft.close("s")
