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


def test_recency_window_sends_sink_and_recent_chunks_and_keeps_output(setup, remote):
    """`retrieval_select=recency` (a baseline): the ids are the sink and most recent chunks of the
    committed context, never scored; the output is plain decoding's."""
    from dataclasses import replace

    from specextend.retrieval import initial_chunks

    pair, prompt, ref = setup
    recency = replace(RETRIEVAL, select="recency")

    class Recorder(ChaosDraft):
        def step(self, session_id, step, accepted_tokens, retrieval=None, bound=None):
            if retrieval is not None:
                self.sent.append(retrieval.chunk_ids)
            return super().step(session_id, step, accepted_tokens, retrieval, bound)

    draft = Recorder(remote, Chaos())
    draft.sent = []
    out, _, stats = make_engine(pair, "specextend", draft_backend=draft, tree=TREE, retrieval=recency).generate(
        prompt, PARAMS)
    assert out == ref and not stats.fallback and stats.retrieval_refreshes > 2
    assert len(draft.sent) in (stats.retrieval_refreshes, stats.retrieval_refreshes - 1)  # the last may be unsent
    assert draft.sent[0] == tuple(initial_chunks(len(prompt), recency))
    for ids in draft.sent[1:]:  # sink, then a run of the most recent chunks, as the context grows
        assert ids[0] == 0 and list(ids[1:]) == list(range(ids[1], ids[1] + recency.top_k - 1))
    assert draft.sent[-1][-1] > draft.sent[0][-1] and draft.counters.delivered == len(draft.sent)
