"""The adaptive policy's one-pass choice (controller_best.best_rung) against its slow twin
(TreeController.best_slow, value() of every rung) on random controller states: the same rung, every
time (the arithmetic is the twin's, term for term)."""

import random

import pytest

from specextend.config import TreeConfig
from specextend.controller import TreeController
from specextend.controller_best import best_rung, rung_values
from specextend.ladder import ladder


def random_state(rng: random.Random, tree: TreeConfig) -> TreeController:
    ctl = TreeController(ladder(tree))
    for _ in range(rng.randrange(0, 6)):  # the steps' line (0 points: the prefill's prior, or flat)
        rows = rng.choice([1, 5, 9, 17, 33])
        ctl.forward.add(rows, rng.uniform(1e-3, 3e-3) + rows * rng.uniform(0, 1e-4))
    for _ in range(rng.randrange(0, 3)):
        ctl.prefill.add(rng.choice([100, 2048]), rng.uniform(5e-3, 0.2))
    for _ in range(rng.randrange(0, 4)):  # the chain steps' own line
        rows = rng.choice([1, 9])
        ctl.chains.add(rows, rng.uniform(1e-3, 3e-3) + rows * rng.uniform(0, 1e-4))
    if rng.random() < 0.2:  # only the prior prices the draft
        ctl.draft_ratio = rng.uniform(2, 20)
    else:
        for _ in range(rng.randrange(1, 4)):
            ctl.draft.add(rng.randrange(1, 7), rng.uniform(1e-3, 1e-2))
    rungs = ctl.rungs[1:]
    ctl.accepted = {r: rng.uniform(0, r.depth) for r in rng.sample(rungs, rng.randrange(0, len(rungs) + 1))}
    ctl.plain_forward = rng.choice([None, rng.uniform(1e-3, 3e-3)])
    ctl.extra_plain = rng.choice([None, rng.uniform(0, 5e-4)])
    ctl.extra_spec = rng.choice([None, rng.uniform(0, 5e-4)])
    ctl.sessions = rng.choice([1, 1, 2, 4])
    ctl.ready = rng.choice([1.0, rng.uniform(0.2, 1.0)])
    ctl.lookup_plain = rng.uniform(0, 1)
    ctl.lookup_spec = rng.uniform(0, 2)
    ctl.chain_now = rng.choice([None, (0, 0.0), (rng.randrange(1, 9), rng.uniform(0, 3))])
    ctl.chain_found = rng.random() < 0.5
    ctl.chain_gain = rng.choice([None, rng.uniform(0, 3)])
    for _ in range(rng.randrange(0, 3)):  # the draft's catch-up on steps without a tree
        ctl.catchup.add(rng.randrange(2, 60), rng.uniform(0, 5e-3))
    ctl.behind = rng.choice([0, rng.randrange(1, 60)])
    for rows in rng.sample([5, 9, 17, 33], rng.randrange(0, 4)):  # row counts' own prices (some not yet in use)
        ctl.rows_price[rows] = [rng.uniform(-1e-3, 1e-3), rng.randrange(1, 4)]  # (residuals over the line)
    return ctl


@pytest.mark.parametrize("tree", [TreeConfig(16, 6, 4), TreeConfig(32, 6, 4), TreeConfig(8, 3, 4)])
def test_the_one_pass_choice_is_the_twins(tree):
    rng = random.Random(hash(tree) & 0xFFFF)
    chosen = set()
    for _ in range(1500):
        ctl = random_state(rng, tree)
        assert rung_values(ctl) == [ctl.value(r) for r in ctl.rungs]  # to the bit
        assert ctl.best() == best_rung(ctl) == ctl.best_slow()
        chosen.add(ctl.best())
    assert len(chosen) >= 3  # (the states reach plain steps and several trees)


def test_a_tie_goes_to_the_smaller_rung_in_both():
    ctl = TreeController(ladder(TreeConfig(16, 6, 4)))  # nothing measured: every cost 0, every tree alike
    ctl.draft_ratio = None
    assert best_rung(ctl) == ctl.best_slow()
