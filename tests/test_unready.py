"""Unready steps (overlap_miss=plain, docs/architecture.md "Overlapped drafting"): a draft that has no
tree ready answers an empty one and the target decodes that token plainly; lossless, counted, and
the adaptive policy stops asking a draft that is never ready."""

from __future__ import annotations

import pytest

from specextend.config import EngineConfig, SamplingParams, TreeConfig
from specextend.draft.base import DraftBackend, DraftTree
from specextend.engine import Engine

TREE = TreeConfig(8, 4, 3)


class NeverReady(DraftBackend):
    """Answers every step with an empty tree (an overlapping draft that is always behind)."""

    def __init__(self):
        self.bounds, self.steps = [], []

    def open(self, session_id, prompt_ids, params):
        pass

    def step(self, session_id, step, accepted_tokens, retrieval=None, bound=None):
        self.bounds.append(bound)
        self.steps.append((step, tuple(accepted_tokens)))
        return DraftTree(step=step, tokens=(), parents=())

    def close(self, session_id):
        pass


def prompt(n=40):
    return [(7 * i + 3) % 200 for i in range(n)]


@pytest.mark.parametrize("miss", ["plain", "draft"])
def test_empty_trees_decode_plainly_and_each_step_is_applied_once(tiny_models, miss):
    target = tiny_models("float64")[0]
    params = SamplingParams(24, ignore_eos=True)
    ref, _, _ = Engine(EngineConfig(mode="ar"), target).generate(prompt(), params)
    draft = NeverReady()
    cfg = EngineConfig(mode="sd", tree=TREE, tree_policy="fixed", overlap_miss=miss)
    out, _, stats = Engine(cfg, target, draft).generate(prompt(), params)
    assert out == ref
    assert stats.num_steps == 0 and stats.unready_steps == len(out) - 1 and stats.tree_ready_fraction == 0.0
    assert stats.target_wait_ms_per_step > 0 and stats.mean_acceptance_length == 1.0
    # step k carries the token of step k - 1's plain decode: the draft is never sent a token twice
    assert [s for s, _ in draft.steps] == list(range(len(out) - 1))
    assert [list(t) for _, t in draft.steps] == [[tok] for tok in out[:-1]]
    assert all(b.ready_only == (miss == "plain") for b in draft.bounds)


def test_the_adaptive_policy_stops_asking_a_draft_that_is_never_ready(tiny_models):
    target = tiny_models("float64")[0]
    params = SamplingParams(60, ignore_eos=True)
    ref, _, _ = Engine(EngineConfig(mode="ar"), target).generate(prompt(), params)
    cfg = EngineConfig(mode="sd", tree=TREE, tree_policy="adaptive")
    out, _, stats = Engine(cfg, target, NeverReady()).generate(prompt(), params)
    assert out == ref and stats.num_steps == 0
    assert stats.unready_steps > 0 and stats.plain_steps > 2 * stats.unready_steps
