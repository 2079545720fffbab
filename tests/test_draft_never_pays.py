"""A draft that can never pay (docs/architecture.md, "Adaptive speculation"): one whose forward
multiplies by SLOW_DRAFT times the target's weights or more costs at least that many target forwards
a tree level, so no tree beats a plain step whatever it accepts. With the adaptive policy its
sessions are not opened at all (no draft prefill beside the target's), the request decodes plainly
with context lookup, and the output is the target's; the fixed policy drafts anyway."""

from __future__ import annotations

import dataclasses

import torch

from specextend.builder import read_pair
from specextend.config import EngineConfig, SamplingParams
from specextend.controller import SLOW_DRAFT
from specextend.draft.worker import DraftWorker
from specextend.engine import Engine


def prompt(n=60):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(5)).tolist()


class Opens(DraftWorker):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.opens = 0

    def open(self, session_id, prompt_ids, params):
        self.opens += 1
        return super().open(session_id, prompt_ids, params)


def heavy(args, factor):
    """`args` with its layers multiplied: a draft `factor` times as many weights a forward."""
    return dataclasses.replace(args, num_layers=args.num_layers * factor)


def test_decode_weights_of_known_pairs():
    t, d = read_pair(EngineConfig(target="random:llama-tiny", draft="random:llama-68m", device="cpu"))
    assert d.args.decode_weights() / t.args.decode_weights() > 100  # the useless draft
    t, d = read_pair(EngineConfig(target="random:llama-tiny", draft="random:llama-tiny-draft", device="cpu"))
    assert d.args.decode_weights() / t.args.decode_weights() < SLOW_DRAFT  # the tests' pair speculates
    assert t.args.decode_weights() < t.args.num_params()  # the embedding table is a gather, not a product


def test_a_draft_that_never_pays_is_never_opened_and_the_output_is_the_targets(pair):
    target, draft = pair
    params = SamplingParams(30, ignore_eos=True)
    ref, _, _ = Engine(EngineConfig(mode="ar"), target).generate(prompt(), params)
    worker = Opens(draft.decoder)
    big = heavy(draft.args, 8)
    engine = Engine(EngineConfig(mode="specextend", tree_policy="adaptive"), target, worker, draft_args=big)
    assert engine.draft_never_pays and engine.draft_weight_ratio >= SLOW_DRAFT
    out, _, stats = engine.generate(prompt(), params)
    assert out == ref and worker.opens == 0 and stats.num_steps == 0 and not stats.fallback
    # the fixed policy (every step drafted) is what it asks for; a light draft is opened as always
    fixed = Engine(EngineConfig(mode="specextend", tree_policy="fixed"), target, worker, draft_args=big)
    assert not fixed.draft_never_pays
    light = Engine(EngineConfig(mode="specextend", tree_policy="adaptive"), target, worker, draft_args=draft.args)
    assert not light.draft_never_pays
    out, _, _ = light.generate(prompt(), params)
    assert out == ref and worker.opens == 1
    worker.shutdown()


def test_context_lookup_still_runs_without_the_draft(pair):
    """A prompt that repeats itself: the chains are verified (lookup steps) though no draft is opened."""
    target, draft = pair
    params = SamplingParams(40, ignore_eos=True)
    p = prompt(20) * 4
    ref, _, _ = Engine(EngineConfig(mode="ar"), target).generate(p, params)
    worker = Opens(draft.decoder)
    engine = Engine(EngineConfig(mode="specextend", tree_policy="adaptive", lookup_tokens=8), target, worker,
                    draft_args=heavy(draft.args, 8))
    out, _, stats = engine.generate(p, params)
    worker.shutdown()
    assert out == ref and worker.opens == 0
    assert stats.lookup_steps > 0 and stats.num_steps == 0  # chains verified, no tree
