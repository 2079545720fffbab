"""The draft side's own time on a step (DraftTree.server_s / queued_s) over every step transport and
in process, and the target's transport time derived from it (docs/architecture.md, "Wire
protocol")."""

from __future__ import annotations

import threading
import time

import pytest

from specextend.draft.base import DraftTree
from specextend.draft.jobs import SerialDraft
from specextend.stats import RequestStats
from specextend.rpc import DraftServerThread, GrpcDraftBackend
from specextend.rpc.convert import tree_from_proto, tree_to_proto
from test_rpc import PARAMS, TRANSPORTS, FakeDraft, expected_tree


def test_times_cross_the_wire_and_do_not_change_the_tree():
    tree = DraftTree(step=3, tokens=(5, 6), parents=(-1, 0), server_s=0.001234, queued_s=0.0005, flight_s=0.0003)
    back = tree_from_proto(tree_to_proto(tree))
    assert back.server_s == pytest.approx(0.001234) and back.queued_s == pytest.approx(0.0005)
    assert back.flight_s == pytest.approx(0.0003)
    assert back == DraftTree(step=3, tokens=(5, 6), parents=(-1, 0))  # timing is not the tree's identity
    old = tree_to_proto(DraftTree(step=3, tokens=(5,), parents=(-1,)))  # a server that does not measure
    assert tree_from_proto(old).server_s == 0.0


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_a_step_queued_behind_another_sessions_open_reports_it(transport):
    """Session b's step waits on the draft's thread behind session a's slow open: its tree says so
    (queued, within the draft's time), and the step's own work (0.05 s) is in the draft's time."""
    fake = FakeDraft()
    fake.step_delay_s = 0.05
    with DraftServerThread(fake) as server:
        client = GrpcDraftBackend(server.address, **TRANSPORTS[transport])
        client.open("b", [1, 2, 3], PARAMS)
        tree = client.step("b", 0, [3])
        assert tree == expected_tree("b", 0, [3])
        assert 0.05 <= tree.server_s < 5 and tree.queued_s < tree.server_s
        fake.open_delay_s = 0.4
        opening = threading.Thread(target=client.open, args=("a", [1, 2], PARAMS))
        opening.start()
        deadline = time.time() + 10
        while not fake.active:  # until a's open runs on the draft's thread (a fixed sleep raced a loaded host)
            assert time.time() < deadline, "a's open never started"
            time.sleep(0.001)
        t0 = time.perf_counter()
        tree = client.step("b", 1, [4])
        wait = time.perf_counter() - t0
        opening.join()
        assert tree == expected_tree("b", 1, [4])
        assert 0.2 <= tree.queued_s < tree.server_s <= wait  # behind a's open, then its own 0.05 s
        assert tree.server_s - tree.queued_s >= 0.05
        client.shutdown()


def test_in_process_steps_report_their_queueing_too():
    fake = FakeDraft()
    worker = SerialDraft(fake)
    worker.open("s", [1, 2], PARAMS)
    fake.step_delay_s = 0.02
    tree = worker.step("s", 0, [2])
    assert tree.server_s >= 0.02 and tree.queued_s <= tree.server_s
    worker.shutdown()


def test_transport_is_the_wait_beyond_the_draft_side():
    st = RequestStats(num_steps=3, wait_per_step=[0.004, 0.006, 0.003], server_per_step=[0.003, 0.004, 0.0],
                      queued_per_step=[0.001, 0.0005, 0.0])
    # the third step's draft did not report its time: left out of both
    assert st.transport_ms_per_step == pytest.approx(1.5)  # (1 + 2) / 2 ms
    assert st.draft_queue_ms_per_step == pytest.approx(0.75)
    assert RequestStats(num_steps=1, wait_per_step=[0.004], server_per_step=[0.0],
                        queued_per_step=[0.0]).transport_ms_per_step == 0.0


def test_unready_steps_are_split_like_the_trees_they_were_asked_as():
    """target_wait_ms_per_step counts every step that asked for a tree, unready ones too: so does
    the split, or a slow tree beside quick empty answers made the transport of the trees alone
    exceed the mean wait of all (the served app's test met 2.23 against 2.17 ms)."""
    st = RequestStats(num_steps=1, draft_s=0.003, wait_per_step=[0.003], server_per_step=[0.0005], queued_per_step=[0.0],
                      unready_steps=2, unready_wait_s=0.0006, unready_split=[(0.0003, 0.0002, 0.0001)] * 2)
    assert st.target_wait_ms_per_step == pytest.approx(1.2)  # (3 + 0.3 + 0.3) / 3
    assert st.transport_ms_per_step == pytest.approx((2.5 + 0.1 + 0.1) / 3)
    assert st.draft_queue_ms_per_step == pytest.approx(0.2 / 3)
    assert st.transport_ms_per_step < st.target_wait_ms_per_step


def test_engine_over_the_step_channel_splits_its_wait(tiny_models):
    """A real draft worker behind the server, stepped by the engine over ZeroMQ: every step's draft
    reported its time, the transport is the rest of the wait, and the output is plain decoding's."""
    from specextend.draft.worker import DraftWorker
    from test_rpc_stream import plain_and_speculative

    pair = tiny_models("float64")
    worker = DraftWorker(pair[1].decoder)
    with DraftServerThread(worker) as server:
        client = GrpcDraftBackend(server.address)
        ref, out, stats = plain_and_speculative(pair, client)
        client.shutdown()
    worker.shutdown()
    assert out == ref and stats.num_steps > 0
    assert all(s > 0 for s in stats.server_per_step) and len(stats.server_per_step) == stats.num_steps
    assert all(q <= s for q, s in zip(stats.queued_per_step, stats.server_per_step))
    assert 0 < stats.transport_ms_per_step < stats.target_wait_ms_per_step
    assert stats.summary()["transport_ms_per_step"] == stats.transport_ms_per_step


def test_metrics_and_response_carry_the_split():
    from specextend.serving.metrics import ReplicaMetrics
    from specextend.serving.protocol import SpeculativeDecoding
    from specextend.serving.protocol import spec_decoding

    st = RequestStats(num_steps=2, wait_per_step=[0.004, 0.006], server_per_step=[0.003, 0.004],
                      queued_per_step=[0.001, 0.0005], draft_s=0.010)
    m = ReplicaMetrics(use_ray=False)
    m.record_request(st, "length")
    text = m.exposition()
    assert "specextend_spec_decode_transport_seconds_total 0.003" in text
    assert "specextend_spec_decode_draft_queue_seconds_total 0.0015" in text
    spec = SpeculativeDecoding(**spec_decoding(st)).model_dump()
    assert spec["transport_ms_per_step"] == pytest.approx(1.5) and spec["draft_queue_ms_per_step"] == pytest.approx(0.75)
    assert spec["target_wait_ms_per_step"] == pytest.approx(5.0)


def test_wait_split_gives_the_ready_steps_draft_side_and_queueing():
    """The bench's wait split: medians over the ready steps only, of the target's wait, of the draft
    side's time and of its queueing for the draft's thread (ms)."""
    from types import SimpleNamespace

    from specextend.bench.e2e import wait_split

    st = SimpleNamespace(wait_per_step=[0.004, 0.001, 0.002, 0.010], ready_per_step=[False, True, True, False],
                         refresh_per_step=[False, False, True, False], server_per_step=[0.003, 0.0006, 0.0010, 0.009],
                         queued_per_step=[0.0, 0.0002, 0.0004, 0.001], prepared_per_step=[False, False, True, False])
    got = wait_split(st)
    assert got["wait_ready_ms"] == pytest.approx(1.5) and got["wait_drafted_ms"] == pytest.approx(7.0)
    assert got["ready_server_ms"] == pytest.approx(0.8) and got["ready_queued_ms"] == pytest.approx(0.3)
    assert got["wait_refresh_ms"] == pytest.approx(2.0) and got["wait_prepared_ms"] == pytest.approx(2.0)


def test_each_kind_of_step_splits_its_time_into_wait_forward_and_host(tiny_models):
    """stats.step_kinds: per kind, the steps' wall time, their wait for the draft's answer and their
    target forwards' time (docs/architecture.md, "Adaptive speculation"); the response and the
    bench's line carry the split."""
    from specextend.bench.e2e import kinds_line
    from specextend.config import EngineConfig, SamplingParams, TreeConfig
    from specextend.controller import TreeController
    from specextend.draft.worker import DraftWorker
    from specextend.engine import Engine
    from specextend.ladder import PLAIN, ladder
    from specextend.serving.protocol import SpeculativeDecoding, spec_decoding

    class Alternate(TreeController):  # a tree, then a plain step, and again
        def choose(self, sessions=1):
            super().choose(sessions)  # (its bookkeeping: the prefill's forwards are not the first step's)
            return self.top if (self.spec_steps + self.plain_steps) % 2 == 0 else PLAIN

    target, draft = tiny_models("float64")
    worker = DraftWorker(draft.decoder)
    engine = Engine(EngineConfig(mode="specextend", tree=TreeConfig(8, 3, 2), lookup_tokens=0), target, worker)
    engine.new_controller = lambda tree: Alternate(ladder(tree))
    _, _, st = engine.generate(list(range(3, 60)), SamplingParams(24, ignore_eos=True))
    worker.shutdown()
    tree, plain = st.step_kinds["tree"], st.step_kinds["plain"]  # [steps, tokens, s, wait s, forward s]
    assert tree[0] == st.num_steps > 0 and plain[0] == st.plain_steps > 0
    assert 0 < tree[3] and tree[3] == pytest.approx(sum(st.wait_per_step))  # each tree's wait, summed
    assert plain[3] == 0.0  # a plain step waits for nothing
    for steps, _, wall, wait, forward in (tree, plain):
        assert 0 < forward and wait + forward <= wall
    kinds = SpeculativeDecoding(**spec_decoding(st)).model_dump()["step_kinds"]
    assert kinds["tree"]["wait_ms"] == pytest.approx(1e3 * tree[3])
    assert kinds["plain"]["forward_ms"] == pytest.approx(1e3 * plain[4])
    line = kinds_line(dict(step_kinds=kinds, max_step_ms=1.0))
    assert f"tree {tree[0]} x " in line and "(wait " in line and ", forward " in line and ", host " in line
    # the phases split each kind's wall time (stats.PhaseClock): they add up to it, the tree's wait is its wait
    phases = st.phases
    assert list(phases["tree"]) == ["wait", "graft", "verify", "scoring", "verdict", "ask", "commit", "retrieval", "books"]
    assert list(phases["plain"]) == ["step", "books"]
    for kind, sums in (("tree", tree), ("plain", plain)):
        assert sum(phases[kind].values()) == pytest.approx(sums[2], rel=1e-9)  # (one read ends both)
    assert phases["tree"]["wait"] >= tree[3]
    assert phases["tree"]["verify"] >= tree[4] * 0.5  # (the forward's own timer runs inside the phase)
    assert st.between_s > 0
    got = SpeculativeDecoding(**spec_decoding(st)).model_dump()["phase_ms"]
    assert got["tree"]["verify"] == pytest.approx(1e3 * phases["tree"]["verify"] / tree[0])
    assert got["between"]["ms"] == pytest.approx(1e3 * st.between_s / (tree[0] + plain[0]))
    assert "; tree phases wait " in kinds_line(dict(step_kinds=kinds, phase_ms=got, max_step_ms=1.0))


def test_mode_lookup_steps_forward_time_is_their_own(tiny_models):
    """Mode lookup decides without the policy's choose(): its first step's forward time used to take
    in the prefill's forwards (a GPU run's lookup steps read 4.4 ms of forward in 3.5 ms steps)."""
    from specextend.config import EngineConfig, SamplingParams
    from specextend.engine import Engine

    target, _ = tiny_models("float64")
    engine = Engine(EngineConfig(mode="lookup", lookup_tokens=4), target)
    prompt = list(range(3, 40)) * 40  # long enough that the prefill far outweighs any step
    _, _, st = engine.generate(prompt, SamplingParams(12, ignore_eos=True))
    assert sum(k[0] for k in st.step_kinds.values()) > 0
    for steps, _, wall, wait, forward in st.step_kinds.values():
        assert wait == 0.0 and 0 < forward <= wall


def test_lookup_runs_phases_add_up_to_their_steps_wall_time(tiny_models):
    """A lookup run ahead of the host (lookup_ahead.py) splits its steps' time as the engine's own
    steps do: each kind's phases add up to its wall time (stats.phase_ms divides them by its steps)."""
    from specextend.config import EngineConfig, SamplingParams
    from specextend.engine import Engine

    target, _ = tiny_models("float64")
    engine = Engine(EngineConfig(mode="lookup", lookup_tokens=4), target)
    engine.lookup_ahead = True
    _, _, st = engine.generate(list(range(3, 20)) * 8, SamplingParams(24, ignore_eos=True))
    assert st.step_kinds and set(st.phases) == set(st.step_kinds)
    for kind, (steps, _, wall, _, _) in st.step_kinds.items():
        assert list(st.phases[kind]) == ["step", "books"]
        assert sum(st.phases[kind].values()) == pytest.approx(wall, rel=1e-9)
