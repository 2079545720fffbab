"""Losslessness (docs/architecture.md, "Losslessness in finite precision"): in float64, speculative output == autoregressive output, token for
token, over tree shapes, prompt lengths, seeds, stop positions, HTA/CMR on and off."""

import pytest
import torch

from specextend.config import RetrievalConfig, SamplingParams, TreeConfig
from specextend.draft.worker import DraftWorker

from helpers import make_engine

TREES = [TreeConfig(1, 1, 1), TreeConfig(5, 5, 1), TreeConfig(12, 4, 3), TreeConfig(24, 6, 4)]
RETRIEVAL = RetrievalConfig(enabled=True, chunk_size=8, top_k=4, every=2, draft_prefill_window=16)
MODES = {  # name -> engine kwargs
    "sd": dict(mode="sd"),
    "sd+hta": dict(mode="sd", hybrid_attention=True),
    "sd+cmr": dict(mode="sd", retrieval=RETRIEVAL),
    "specextend": dict(mode="specextend", retrieval=RETRIEVAL),
}
PROMPT_LENS = [3, 30, 150]  # below and above the 32-token retrieval budget


def prompt(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("tree", TREES, ids=lambda t: f"n{t.nodes}d{t.depth}k{t.topk}")
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("n", PROMPT_LENS)
def test_greedy_equals_autoregressive(pair, ar_engine, tree, mode, n):
    for seed in (0, 1):
        p = prompt(n, seed)
        params = SamplingParams(max_new_tokens=40, ignore_eos=True)
        ref, ref_finish, _ = ar_engine.generate(p, params)
        out, finish, stats = make_engine(pair, tree=tree, **MODES[mode]).generate(p, params)
        assert out == ref and finish == ref_finish == "length"
        assert stats.num_steps > 0 and not stats.fallback


@pytest.mark.parametrize("mode", ["sd", "specextend"])
@pytest.mark.parametrize("max_new", [1, 2, 7, 33])
def test_stops_exactly_where_autoregressive_stops(pair, ar_engine, mode, max_new):
    p = prompt(20, 5)
    free, _, _ = ar_engine.generate(p, SamplingParams(max_new_tokens=60, ignore_eos=True))
    for stop_at in (0, 3, 11, 25):  # a stop token first appearing at several positions
        stop = free[stop_at]
        params = SamplingParams(max_new_tokens=max_new, ignore_eos=True, stop_token_ids=(stop,))
        ref, ref_finish, _ = ar_engine.generate(p, params)
        first = free.index(stop)
        assert ref == free[:min(first + 1, max_new)]
        out, finish, _ = make_engine(pair, tree=TreeConfig(16, 6, 3), **MODES[mode]).generate(p, params)
        assert (out, finish) == (ref, ref_finish)


def test_draft_equal_to_target_accepts_everything(pair):
    target, _ = pair
    tree = TreeConfig(nodes=15, depth=5, topk=3)
    eng = make_engine(pair, "sd", draft_backend=DraftWorker(target.decoder), tree=tree)
    out, _, stats = eng.generate(prompt(30, 2), SamplingParams(max_new_tokens=61, ignore_eos=True))
    assert stats.accepted_per_step == [tree.depth] * stats.num_steps
    assert stats.mean_acceptance_length == tree.depth + 1


def test_correlated_draft_exercises_every_acceptance_length(pair):
    tree = TreeConfig(nodes=12, depth=5, topk=3)
    seen = set()
    for seed in range(4):
        _, _, stats = make_engine(pair, tree=tree).generate(prompt(25, seed),
                                                            SamplingParams(max_new_tokens=80, ignore_eos=True))
        seen |= set(stats.accepted_per_step)
    assert seen == set(range(tree.depth + 1))


@pytest.mark.parametrize("mode", ["sd", "specextend"])
def test_sampling_same_seed_same_output(pair, ar_engine, mode):
    """One uniform draw per emitted token: with one seed, speculative == autoregressive sampling."""
    p = prompt(40, 3)
    for seed in range(3):
        params = SamplingParams(max_new_tokens=30, temperature=0.8, top_p=0.95, top_k=50, seed=seed,
                                ignore_eos=True)
        ref, _, _ = ar_engine.generate(p, params)
        out, _, stats = make_engine(pair, tree=TreeConfig(12, 4, 3), **MODES[mode]).generate(p, params)
        assert out == ref
        assert sum(stats.accepted_per_step) > 0


def test_eos_in_accepted_path_stops(pair, ar_engine):
    target, _ = pair
    eos = target.args.eos_token_ids[0]
    p = prompt(10, 9)
    params = SamplingParams(max_new_tokens=50, stop_token_ids=(eos,))
    ref, ref_finish, _ = ar_engine.generate(p, params)
    out, finish, _ = make_engine(pair, tree=TreeConfig(12, 4, 3)).generate(p, params)
    assert (out, finish) == (ref, ref_finish)


@pytest.mark.parametrize("mode", ["ar", "sd", "specextend"])
def test_tiny_temperature_and_top_p_are_greedy(tiny_models, mode):
    """The limits temperature -> 0 and top_p -> 0 are greedy decoding, in float32 too (where
    logits / 1e-38 overflows and top_p=1e-46 rounds to 0), plain and speculative."""
    pair = tiny_models("float32")
    p = prompt(40, 5)
    greedy, _, _ = make_engine(pair, "ar").generate(p, SamplingParams(max_new_tokens=20, ignore_eos=True))
    kw = {"ar": {}, **MODES}[mode]
    engine = make_engine(pair, **({"mode": "ar"} if mode == "ar" else {"tree": TreeConfig(12, 4, 3), **kw}))
    for temperature, top_p in ((1e-38, 1.0), (5e-324, 1.0), (1.0, 1e-46), (0.8, 1e-300)):
        params = SamplingParams(max_new_tokens=20, temperature=temperature, top_p=top_p, seed=7, ignore_eos=True)
        assert engine.generate(p, params)[0] == greedy, (temperature, top_p)
