"""The batch's check on its sessions' choices (governor.py; docs/architecture.md, "Adaptive
speculation"): steady rounds measured with trees allowed and held to plain steps, the better regime
held and its hold doubled when confirmed; and, through the batcher, held rounds that take no tree
and leave every output equal to its solo run."""

import pytest
import torch

from specextend.config import SamplingParams, TreeConfig
from specextend.governor import FREE, PLAIN, Governor, bucket

from helpers import make_engine
from test_batch import run_batched


def rounds(g: Governor, n: int, sessions: int, rate: dict, t: list, steady: bool = True) -> list[bool]:
    """n rounds of `sessions`, each 10 ms emitting what `rate` (tokens a round by regime) says for
    the regime held; returns whether each round was held."""
    out = []
    for _ in range(n):
        held = g.held()
        out.append(held)
        t[0] += 0.010
        g.round_end(sessions, rate[PLAIN if held else FREE], steady, now=t[0])
    return out


def test_plain_steps_that_decode_more_hold_the_batch_then_confirmed_longer():
    g, t = Governor(window=4, hold=8), [0.0]
    # a free window (its first round left out), then a plain one: plain emits 16 a round against 12
    got = rounds(g, 10, 16, {FREE: 12, PLAIN: 16}, t)
    assert got == [False] * 5 + [True] * 5
    assert g.measured == pytest.approx({FREE: 1200.0, PLAIN: 1600.0}) and g.verdicts[16].regime == PLAIN
    assert rounds(g, 8, 16, {FREE: 12, PLAIN: 16}, t) == [True] * 8  # held for 8 rounds
    rounds(g, 11, 16, {FREE: 12, PLAIN: 16}, t)  # measured again (after the hold, a round left out): confirmed
    assert g.verdicts[16].hold == 16 and g.summary()[16]["regime"] == PLAIN


def test_trees_that_decode_more_or_about_as_much_stay_free():
    for plain in (10, 12):  # (12 = 12: within the margin, the sessions' own choice)
        g, t = Governor(window=4, hold=8), [0.0]
        got = rounds(g, 10, 8, {FREE: 12, PLAIN: plain}, t)
        assert got == [False] * 5 + [True] * 5 and g.verdicts[8].regime == FREE
        assert rounds(g, 8, 8, {FREE: 12, PLAIN: plain}, t) == [False] * 8


def test_a_one_off_slow_round_does_not_decide():
    """The free window's median rate decides: one round of a session's first tree (or the draft's
    catch-up after a hold), 10 times slower, does not make plain steps look better."""
    g, t = Governor(window=4, hold=8), [0.0]
    for seconds, tokens in [(0.01, 0), (0.01, 12), (0.10, 12), (0.01, 12), (0.01, 12), (0.01, 12)]:
        t[0] += seconds
        g.round_end(8, tokens, True, now=t[0])  # (the first starts the free window, the second is left out)
    assert g.measured[FREE] == pytest.approx(1200.0) and g.held()
    rounds(g, 5, 8, {FREE: 12, PLAIN: 11}, t)
    assert g.verdicts[8].regime == FREE


def test_few_sessions_unsteady_rounds_and_another_batch_size():
    g, t = Governor(window=4, hold=8), [0.0]
    assert rounds(g, 20, 3, {FREE: 1, PLAIN: 9}, t) == [False] * 20 and not g.verdicts  # below min_sessions
    rounds(g, 5, 8, {FREE: 12, PLAIN: 16}, t)  # the free window of 8 sessions
    assert rounds(g, 3, 8, {FREE: 12, PLAIN: 16}, t, steady=False) == [True] * 3  # a chunk, a join: restarted
    assert FREE in g.measured and not g.verdicts
    rounds(g, 5, 8, {FREE: 12, PLAIN: 16}, t)
    assert g.verdicts[8].regime == PLAIN
    assert rounds(g, 1, 16, {FREE: 12, PLAIN: 16}, t) == [True]  # (decided before the round ended)
    assert not g.held() and g.phase == FREE  # 16 sessions: a size of its own, measured anew
    assert [bucket(n) for n in (4, 5, 8, 9, 16)] == [4, 8, 8, 16, 16]


def test_held_rounds_take_no_tree_and_every_output_equals_its_solo_run(pair):
    """Through the batcher (its forwards made 20 ms slow, so that trees pay and free sessions take
    them) with a governor that always finds plain steps better: once it has measured, the sessions
    decode plainly, and every output still equals its solo run (float64), and the replica's metrics count the held
    rounds; without a governor the same sessions take a tree nearly every step."""
    import time

    from specextend.models.batch import forward_batch
    from specextend.serving.metrics import ReplicaMetrics

    target = pair[0]  # (the target as its own draft: every tree accepted whole)
    spec = lambda: make_engine((target, target), "sd", tree=TreeConfig(4, 4, 1), prefill_chunk=64,  # noqa: E731
                               tree_policy="adaptive")  # (a new engine each time: no costs carried)
    gen = torch.Generator().manual_seed(3)
    reqs = [(torch.randint(0, 256, (12,), generator=gen).tolist(), SamplingParams(max_new_tokens=48, ignore_eos=True),
             {}) for _ in range(4)]
    alone = [make_engine(pair, "ar").generate(p, params)[0] for p, params, _ in reqs]
    slow = lambda model, calls: time.sleep(0.02) or forward_batch(model, calls)  # noqa: E731
    free, _ = run_batched(spec(), reqs, max_batch=4, forward=slow)
    assert [tokens for tokens, _, _ in free] == alone
    gov = Governor(window=2, hold=1000, margin=-1.0)  # (margin -1: plain always wins)
    metrics = ReplicaMetrics(use_ray=False)
    held, b = run_batched(spec(), reqs, max_batch=4, forward=slow, governor=gov, on_held=metrics.record_held_round)
    assert [tokens for tokens, _, _ in held] == alone
    assert gov.verdicts[4].regime == PLAIN and b.held_rounds > 8
    assert f"specextend_rounds_held_plain_total {float(b.held_rounds)}" in metrics.exposition()
    trees = lambda got: sum(s.num_steps for _, _, s in got)  # noqa: E731
    assert trees(free) >= 4 * 8 and trees(held) <= trees(free) // 2
