"""The adaptive policy in the engine (controller.py, docs/architecture.md, "Adaptive speculation"):
lossless whatever it chooses (the tree switched every step, sessions batched), the default
policy, per-request control, its metrics and response fields, and what a step's draft wait
charges it. The policy's choices on simulated costs are test_controller.py's."""

import pytest
import torch

from specextend.config import EngineConfig, RetrievalConfig, SamplingParams, TreeConfig
from specextend.controller import TreeController
from specextend.ladder import PLAIN, ladder
from specextend.draft.worker import DraftWorker
from specextend.session_calls import Load

from helpers import make_engine


class Rigged(TreeController):
    """Switches the tree every step, through every rung, plain included (the worst case for the
    draft's state and for the trees' bounds)."""

    def choose(self, sessions=1):
        self.heard.append(sessions)
        steps = self.spec_steps + self.plain_steps + self.unready_steps
        trees = self.rungs[1:]
        return trees[(steps // 2) % len(trees)] if steps % 2 == 0 else self.rungs[0]  # plain every other step

    def record_forward(self, rows, seconds):
        self.rows.append(rows)
        super().record_forward(rows, seconds)

    def record_prefill(self, rows, seconds):
        self.rows.append(rows)
        super().record_prefill(rows, seconds)


def _rig(engine, monkeypatch):
    """The engine's sessions get Rigged controllers (listed, with what each heard of the batch)."""
    made = []

    def make(tree):
        made.append(Rigged(ladder(tree)))
        made[-1].heard, made[-1].rows = [], []
        return made[-1]

    monkeypatch.setattr(engine, "new_controller", make)
    return made


@pytest.mark.parametrize("mode,overlap", [("sd", False), ("specextend", False), ("specextend", True)])
@pytest.mark.parametrize("sampling", [False, True])
def test_switching_the_tree_every_step_is_lossless(tiny_models, monkeypatch, mode, overlap, sampling):
    pair = tiny_models("float64")
    prompt = torch.randint(0, 256, (80,), generator=torch.Generator().manual_seed(5)).tolist()
    params = SamplingParams(40, ignore_eos=True, temperature=0.8 if sampling else 0.0, seed=11)
    ref, _, _ = make_engine(pair, "ar").generate(prompt, params)
    engine = make_engine(pair, mode, draft_backend=DraftWorker(pair[1].decoder, overlap=overlap),
                         tree=TreeConfig(16, 5, 3), tree_policy="adaptive", lookup_tokens=0,
                         retrieval=RetrievalConfig(chunk_size=8, top_k=12, every=2))
    _rig(engine, monkeypatch)
    out, _, stats = engine.generate(prompt, params)
    assert out == ref
    assert stats.num_steps > 3 and stats.plain_steps > 3  # both kinds of step really ran
    sizes = set(stats.nodes_per_step)  # ... and trees of several sizes (with overlap a missed step
    assert 4 in sizes and len(sizes) > 1 and (overlap or 8 in sizes)  # answers one level: 2k nodes)
    assert max(stats.nodes_per_step) <= 16 and stats.mean_tree_nodes == pytest.approx(
        sum(stats.nodes_per_step) / stats.num_steps)
    engine.draft.shutdown()


def test_batched_sessions_hear_the_batch_and_stay_lossless(tiny_models, monkeypatch):
    from test_batch import run_batched

    pair = tiny_models("float64")
    engine = make_engine(pair, "sd", tree=TreeConfig(16, 5, 3), tree_policy="adaptive", lookup_tokens=0)
    made = _rig(engine, monkeypatch)
    reqs = [(torch.randint(0, 256, (30 + 7 * i,), generator=torch.Generator().manual_seed(i)).tolist(),
             SamplingParams(20, ignore_eos=True, **({"temperature": 0.9, "seed": i} if i % 2 else {})), {})
            for i in range(3)]
    alone = [engine.generate(p, params) for p, params, _ in reqs]
    assert all(set(c.heard) == {1} for c in made)  # alone, nobody shares a forward
    del made[:]
    got, _ = run_batched(engine, [(p, params, {"load": Load()}) for p, params, _ in reqs])
    assert [g[0] for g in got] == [a[0] for a in alone]
    assert len(made) == 3 and all(max(c.heard) == 3 for c in made)  # they heard the batch
    prompts = sum(len(p) for p, _, _ in reqs)
    assert all(prompts in c.rows for c in made)  # ... and the shared forwards' rows (the prefills met)


def test_adaptive_is_the_default_and_fixed_speculates_every_step(tiny_models):
    assert EngineConfig().tree_policy == "adaptive"
    pair = tiny_models("float64")
    prompt = list(range(1, 60))
    _, _, stats = make_engine(pair, "sd", tree_policy="fixed", lookup_tokens=0).generate(prompt, SamplingParams(30, ignore_eos=True))
    assert stats.plain_steps == 0 and stats.probe_steps == 0
    assert stats.nodes_per_step == [EngineConfig().tree.nodes] * stats.num_steps


def test_adaptive_engine_runs_its_policy(tiny_models):
    """The real controller in the engine: warm-up on the smallest tree and a plain step, then its
    own choices, lossless."""
    pair = tiny_models("float64")
    prompt = list(range(3, 90))
    params = SamplingParams(40, ignore_eos=True)
    ref, _, _ = make_engine(pair, "ar").generate(prompt, params)
    out, _, stats = make_engine(pair, "sd", tree=TreeConfig(8, 4, 3), tree_policy="adaptive",
                                   lookup_tokens=0).generate(prompt, params)
    assert out == ref and stats.nodes_per_step[0] == 4  # warm-up: the smallest tree first
    assert stats.plain_steps >= 1  # then a plain step (the full tree next only where it may pay: costs)
    assert stats.num_steps + stats.plain_steps >= 40 / 5


def test_per_request_control_in_the_engine(tiny_models):
    """speculate=False is plain decoding (no draft session, no steps); max_tree_nodes bounds every
    tree of that request."""
    pair = tiny_models("float64")
    prompt = list(range(3, 70))
    params = SamplingParams(30, ignore_eos=True)
    ref, _, _ = make_engine(pair, "ar").generate(prompt, params)
    engine = make_engine(pair, "sd", tree=TreeConfig(8, 4, 3), lookup_tokens=0)
    off, _, stats = engine.generate(prompt, params, speculate=False)
    assert off == ref and stats.num_steps == 0 and stats.draft_tokens == 0
    small, _, stats = engine.generate(prompt, params, max_tree_nodes=2)
    assert small == ref and 0 < stats.draft_tokens <= 2 * stats.num_steps


def test_policy_metrics_and_response_fields():
    """/metrics: the chosen tree sizes (a histogram), plain and probe steps; the response's
    speculative_decoding object: mean_tree_nodes, plain_steps, probe_steps."""
    from specextend.stats import RequestStats
    from specextend.serving.metrics import ReplicaMetrics
    from specextend.serving.protocol import SpeculativeDecoding
    from specextend.serving.protocol import spec_decoding

    stats = RequestStats(num_steps=3, accepted_per_step=[2, 0, 1], nodes_per_step=[16, 4, 4], draft_tokens=24,
                         plain_steps=5, probe_steps=1, num_generated=11, lookup_steps=2, lookup_accepted=7,
                         told_steps=4, open_steps=6, draft_open_s=0.25, asked_steps=2, snapshot_trees=1,
                         ahead_steps=9)
    m = ReplicaMetrics(use_ray=False)
    m.record_request(stats, "length")
    text = m.exposition()
    assert 'specextend_spec_decode_tree_nodes_bucket{le="4.0"} 2.0' in text
    assert 'specextend_spec_decode_tree_nodes_bucket{le="16.0"} 3.0' in text
    assert "specextend_spec_decode_tree_nodes_sum 24.0" in text
    assert "specextend_spec_decode_num_plain_steps_total 5.0" in text
    assert "specextend_spec_decode_num_probe_steps_total 1.0" in text
    assert "specextend_spec_decode_num_lookup_steps_total 2.0" in text
    assert "specextend_spec_decode_num_lookup_accepted_tokens_total 7.0" in text
    assert "specextend_spec_decode_num_told_steps_total 4.0" in text
    assert "specextend_spec_decode_num_ahead_steps_total 9.0" in text
    assert "specextend_spec_decode_num_open_steps_total 6.0" in text
    assert "specextend_spec_decode_num_asked_steps_total 2.0" in text
    assert "specextend_spec_decode_num_snapshot_trees_total 1.0" in text
    assert "specextend_spec_decode_draft_open_seconds_total 0.25" in text
    spec = SpeculativeDecoding(**spec_decoding(stats)).model_dump()
    assert (spec["mean_tree_nodes"], spec["plain_steps"], spec["probe_steps"]) == (8.0, 5, 1)
    assert spec["told_steps"] == 4 and spec["open_steps"] == 6 and spec["draft_open_ms"] == 250.0
    assert spec["asked_steps"] == 2 and spec["snapshot_trees"] == 1 and spec["ahead_steps"] == 9


def test_the_drafts_catch_up_after_plain_steps_is_not_charged_to_speculation(tiny_models, monkeypatch):
    """After a run of plain steps the next speculative step's draft call also forwards those steps'
    tokens: a one-off of switching. Its wait must not enter the draft's cost line, or a probe would
    look dearer than speculating is and the controller would stay plain (H200, 2026-11-23: 8B +
    68M replayed, adaptive 0.94x `ar` with 481 plain steps of 496, fixed 1.39x)."""
    pair = tiny_models("float64")

    class Runs(TreeController):  # three plain steps, then two speculative ones, and again
        def choose(self, sessions=1):
            return self.top if (self.spec_steps + self.plain_steps) % 5 >= 3 else PLAIN

    waits = []

    class Spy(Runs):
        def record_spec(self, rung, draft_s, accepts, **kw):
            waits.append(draft_s)
            super().record_spec(rung, draft_s, accepts, **kw)

    engine = make_engine(pair, "sd", tree=TreeConfig(8, 3, 2), tree_policy="adaptive", lookup_tokens=0)
    monkeypatch.setattr(engine, "new_controller", lambda tree: Spy(ladder(tree)))
    _, _, stats = engine.generate(list(range(3, 60)), SamplingParams(30, ignore_eos=True))
    assert stats.plain_steps >= 6 and stats.num_steps >= 4
    assert waits[0] is None and waits[1] is not None  # after 3 plain steps: a catch-up, then a plain wait
    assert None in waits[2:] and all(w is None or w > 0 for w in waits)
