"""The adaptive policy (controller.py): speculate while it pays, plain steps with backed-off probes
while it does not; lossless whatever it chooses, with the draft catching up lazily."""

import pytest
import torch

from specextend.config import RetrievalConfig, SamplingParams, TreeConfig
from specextend.controller import TreeController

from helpers import make_engine


def drive(ctl, spec_s, spec_tokens, plain_s, steps):
    kinds = []
    for _ in range(steps):
        spec = ctl.speculate()
        kinds.append("S" if spec else "p")
        if spec:
            ctl.record_spec(spec_s, spec_tokens)
        else:
            ctl.record_plain(plain_s)
    return "".join(kinds)


def test_speculates_while_it_pays():
    ctl = TreeController()
    kinds = drive(ctl, spec_s=0.010, spec_tokens=4, plain_s=0.004, steps=40)  # 400 vs 250 tok/s
    assert kinds[:3] == "SSp" and kinds[3:] == "S" * 37  # warm-up, one plain measurement, then on


def test_goes_plain_when_it_does_not_pay_and_probes_with_backoff():
    ctl = TreeController()
    kinds = drive(ctl, spec_s=0.010, spec_tokens=2, plain_s=0.004, steps=200)  # 200 vs 250 tok/s
    assert kinds.startswith("SSp")
    probes = [i for i, k in enumerate(kinds) if k == "S"][2:]
    gaps = [b - a - 1 for a, b in zip([1] + probes, probes)]  # plain steps before each probe
    # the first probe after 10 speculative steps' worth of plain time (25 steps), then doubling
    assert gaps[:3] == [25, 50, 100] and len(gaps) >= 3
    assert ctl.probe_steps == len(probes) and ctl.plain_steps == kinds.count("p")


def test_comes_back_when_speculation_pays_again():
    ctl = TreeController()
    drive(ctl, spec_s=0.010, spec_tokens=1.5, plain_s=0.004, steps=30)
    kinds = drive(ctl, spec_s=0.010, spec_tokens=6, plain_s=0.004, steps=120)  # the text got easy
    assert kinds.endswith("S" * 40) and "p" in kinds  # the next probe found it, and it stayed on


class Alternating:
    """A policy that switches every step (the losslessness test's worst case for the draft's state)."""

    spec_steps = plain_steps = probe_steps = 0

    def __init__(self):
        self.n = 0

    def speculate(self):
        self.n += 1
        return self.n % 2 == 1 or self.n % 7 == 0

    def record_spec(self, seconds, tokens):
        pass

    def record_plain(self, seconds):
        pass


@pytest.mark.parametrize("mode", ["sd", "specextend"])
@pytest.mark.parametrize("sampling", [False, True])
def test_switching_every_step_is_lossless(tiny_models, monkeypatch, mode, sampling):
    pair = tiny_models("float64")
    prompt = torch.randint(0, 256, (80,), generator=torch.Generator().manual_seed(5)).tolist()
    params = SamplingParams(40, ignore_eos=True, temperature=0.8 if sampling else 0.0, seed=11)
    ref, _, _ = make_engine(pair, "ar").generate(prompt, params)
    engine = make_engine(pair, mode, tree=TreeConfig(8, 4, 3), tree_policy="adaptive",
                         retrieval=RetrievalConfig(chunk_size=8, top_k=12, every=2))
    monkeypatch.setattr(engine, "new_controller", Alternating)
    out, _, stats = engine.generate(prompt, params)
    assert out == ref
    assert stats.num_steps > 3 and stats.plain_steps > 3  # both kinds of step really ran


def test_adaptive_is_the_default_and_fixed_speculates_every_step(tiny_models):
    from specextend.config import EngineConfig

    assert EngineConfig().tree_policy == "adaptive"
    pair = tiny_models("float64")
    prompt = list(range(1, 60))
    _, _, stats = make_engine(pair, "sd", tree_policy="fixed").generate(prompt, SamplingParams(30, ignore_eos=True))
    assert stats.plain_steps == 0


def test_per_request_control_in_the_engine(tiny_models):
    """speculate=False is plain decoding (no draft session, no steps); max_tree_nodes bounds every
    tree of that request."""
    pair = tiny_models("float64")
    prompt = list(range(3, 70))
    params = SamplingParams(30, ignore_eos=True)
    ref, _, _ = make_engine(pair, "ar").generate(prompt, params)
    engine = make_engine(pair, "sd", tree=TreeConfig(8, 4, 3))
    off, _, stats = engine.generate(prompt, params, speculate=False)
    assert off == ref and stats.num_steps == 0 and stats.draft_tokens == 0
    small, _, stats = engine.generate(prompt, params, max_tree_nodes=2)
    assert small == ref and 0 < stats.draft_tokens <= 2 * stats.num_steps
