"""The batch's check on its sessions' choices (governor.py; docs/architecture.md, "Adaptive
speculation"): steady rounds measured held to plain steps, held to trees and with the sessions'
choices free, the best regime held and its hold doubled when confirmed. Through the batcher and real
sessions: tests/test_governor_batched.py."""

import pytest

from specextend.governor import FREE, PLAIN, TREES, Governor, bucket

# window 4: the round that starts the measurement (the batch's own choices), then each regime's skipped
# round and four: plain steps first, so that a batch still forming decodes as `ar`'s does
MEASURE = [FREE] + [PLAIN] * 5 + [TREES] * 5 + [FREE] * 5
AGAIN = [PLAIN] * 4 + [TREES] * 5 + [FREE] * 5  # measured again after a plain hold (no round to skip)


def rounds(g: Governor, n: int, sessions: int, rate: dict, t: list, steady: bool = True, life=None) -> list[str]:
    """n rounds of `sessions`, each 10 ms emitting what `rate` (tokens a round by regime) says for
    the regime of the round (`life`: the rounds the batch has ahead); returns each round's regime."""
    out = []
    for _ in range(n):
        r = g.regime()
        out.append(r)
        t[0] += 0.010
        g.round_end(sessions, rate[r], steady, now=t[0], life=life)
    return out


def test_plain_steps_that_decode_more_hold_the_batch_then_confirmed_longer():
    g, t = Governor(window=4, hold=8, budget=1.0), [0.0]
    rate = {FREE: 12, PLAIN: 16, TREES: 10}
    assert rounds(g, 16, 16, rate, t) == MEASURE
    assert g.measured == pytest.approx({FREE: 1200.0, PLAIN: 1600.0, TREES: 1000.0})
    assert g.verdicts[16].regime == PLAIN and g.held()
    assert rounds(g, 8, 16, rate, t) == [PLAIN] * 8  # held for 8 rounds
    assert rounds(g, 14, 16, rate, t) == AGAIN  # measured again, right after the hold: confirmed
    assert g.verdicts[16].hold == 16 and g.summary()[16]["regime"] == PLAIN
    assert g.summary()["history"][-1] == dict(size=16, rates={FREE: 1200.0, PLAIN: 1600.0, TREES: 1000.0},
                                              regime=PLAIN, hold=16)


def test_a_batch_that_will_not_last_is_not_measured_and_a_verdict_holds_on_while_it_lasts():
    g, t = Governor(window=4, hold=8, budget=1.0), [0.0]
    rate = {FREE: 12, PLAIN: 16, TREES: 10}
    assert g.min_life == 4 * 3 * 5  # (four measurements of three windows, each a skipped round and four)
    assert rounds(g, 10, 16, rate, t, life=59) == [FREE] * 10 and not g.measured and not g.verdicts
    assert rounds(g, 16, 16, rate, t, life=60) == MEASURE and g.verdicts[16].regime == PLAIN
    assert rounds(g, 7, 16, rate, t, life=1000) == [PLAIN] * 7  # (one round of the hold left)
    assert rounds(g, 5, 16, rate, t, life=20) == [PLAIN] * 5  # its end: held on, not measured
    assert g.phase is None and len(g.history) == 1
    assert rounds(g, 15, 16, rate, t, life=1000) == [PLAIN] + AGAIN  # (the held round, then measured again)
    assert len(g.history) == 2


def test_a_trees_window_whose_draft_opens_the_batch_cannot_pay_for_is_skipped():
    """After the plain window, the trees window (and the free one) would open every session's
    deferred draft (Batcher.opens_s: on one GPU the rounds wait for them): where those seconds, in
    plain rounds, with the windows left, exceed the batch's life over life_factor, the measurement
    ends with its plain window (the verdict plain, its hold as any); with opens it can pay for, or
    none deferred, the windows follow as before."""
    def run(life, opens_s):
        g, t, out = Governor(window=4, hold=8, budget=1.0), [0.0], []
        for _ in range(16):
            r = g.regime()
            out.append(r)
            t[0] += 0.010  # a plain round of 16 sessions in 10 ms: 1,600 tokens/s
            g.round_end(16, {FREE: 12, PLAIN: 16, TREES: 10}[r], True, now=t[0], life=life, opens_s=opens_s)
        return g, out

    # 0.2 s of opens = 20 plain rounds; with the two windows left (10 rounds), 4 x 30 = 120 rounds needed
    g, out = run(life=119, opens_s=0.2)
    assert out[:6] == [FREE] + [PLAIN] * 5 and TREES not in out
    assert g.verdicts[16].regime == PLAIN and g.verdicts[16].hold == 8 and g.history[-1]["rates"] == {PLAIN: 1600.0}
    assert g.history[-1]["skipped_opens_s"] == 0.2 and 16 not in g.trees_lost
    for life, opens_s in ((120, 0.2), (119, 0.0), (None, 0.2)):
        g, out = run(life, opens_s)
        assert out == MEASURE and set(g.measured) == {PLAIN, TREES, FREE}
        assert "skipped_opens_s" not in g.history[-1]


def test_trees_that_lost_in_a_smaller_batch_are_not_measured_in_a_larger_one_nor_free_choices():
    g, t = Governor(window=4, hold=8, budget=1.0), [0.0]
    rate = {FREE: 12, PLAIN: 16, TREES: 10}
    assert rounds(g, 16, 4, rate, t) == MEASURE and g.trees_lost == {4: True}
    # (the first round: the 4-session batch's hold; then plain steps alone, no trees nor free window)
    assert rounds(g, 6, 8, rate, t) == [PLAIN] + [PLAIN] * 5
    assert g.verdicts[8].regime == PLAIN and g.history[-1]["rates"] == {PLAIN: 1600.0}
    assert rounds(g, 8, 8, rate, t) == [PLAIN] * 8
    assert rounds(g, 6, 16, rate, t, life=10) == [PLAIN] * 6  # (plain alone: measured however short its life)
    assert g.verdicts[16].regime == PLAIN
    won, t = Governor(window=4, hold=8, budget=1.0), [0.0]  # (trees that won at 4 are measured at 8)
    rate = {FREE: 12, PLAIN: 11, TREES: 15}
    assert rounds(won, 16, 4, rate, t) == MEASURE and won.trees_lost == {4: False}
    assert rounds(won, 16, 8, rate, t) == [TREES] + MEASURE[1:] and won.verdicts[8].regime == TREES


def test_rounds_held_while_drafts_open_count_in_the_measurements_cost():
    def measure(opening_rounds: int) -> Governor:
        g, t = Governor(window=4, hold=8, budget=0.1), [0.0]
        rate = {FREE: 12, PLAIN: 16, TREES: 10}
        opened = 0
        while not g.verdicts:
            r = g.regime()
            t[0] += 0.010
            if r == TREES and opened < opening_rounds:  # (sessions step plainly while drafts open: slow)
                opened += 1
                g.round_end(16, 2, False, now=t[0], opening=True)
            else:
                g.round_end(16, rate[r], True, now=t[0])
        return g
    # lost: 5 x (1 - 10/16) + 5 x (1 - 12/16) = 3.125 rounds, and 3 x (1 - 2/16) more while opening
    assert measure(0).verdicts[16].hold == 32 - 15
    g = measure(3)
    assert g.verdicts[16].hold == 58 - 15 - 3 and g.history[-1]["opening"] == 3


def test_each_verdict_is_logged_with_the_rates_it_came_from(caplog):
    g, t = Governor(window=4, hold=8, budget=1.0), [0.0]
    with caplog.at_level("INFO", logger="specextend.governor"):
        rounds(g, 16, 16, {FREE: 12, PLAIN: 16, TREES: 10}, t)
    assert "16 sessions decoded plain 1600 / trees 1000 / free 1200 tokens/s -> plain for 8 rounds" in caplog.text


def test_trees_that_decode_more_hold_the_batch():
    g, t = Governor(window=4, hold=8, budget=1.0), [0.0]
    rate = {FREE: 12, PLAIN: 11, TREES: 15}  # (sessions that stay plain where trees pay)
    assert rounds(g, 16, 8, rate, t) == MEASURE
    assert g.verdicts[8].regime == TREES
    assert rounds(g, 8, 8, rate, t) == [TREES] * 8


def test_free_choices_stay_free_only_where_they_decode_more_than_either_held_regime():
    """Free sessions mix trees and plain steps in a round (each probe a tree the round waits for):
    they stay free where they beat the better held regime by the margin; about as much, and the
    batch is held to that regime (uniform rounds)."""
    g, t = Governor(window=4, hold=8, budget=1.0), [0.0]
    rate = {FREE: 12, PLAIN: 10, TREES: 11}
    rounds(g, 16, 8, rate, t)
    assert g.verdicts[8].regime == FREE and not g.held()
    assert rounds(g, 8, 8, rate, t) == [FREE] * 8
    for rate, held in (({FREE: 12, PLAIN: 12, TREES: 11.8}, PLAIN), ({FREE: 12.3, PLAIN: 11, TREES: 12}, TREES)):
        g, t = Governor(window=4, hold=8, budget=1.0), [0.0]  # (within the margin)
        rounds(g, 16, 8, rate, t)
        assert g.verdicts[8].regime == held and g.held()
        assert rounds(g, 8, 8, rate, t) == [held] * 8


def test_a_one_off_slow_round_does_not_decide():
    """A window's median rate decides: one round of a session's first tree (or the draft's catch-up
    after a hold), 10 times slower, does not make another regime look better (with the window's
    mean, plain steps would read 930 tokens/s and trees would win)."""
    g, t = Governor(window=4, hold=8, budget=1.0), [0.0]
    for seconds, tokens in [(0.01, 0), (0.01, 12), (0.01, 12), (0.10, 12), (0.01, 12), (0.01, 12)]:
        t[0] += seconds
        g.round_end(8, tokens, True, now=t[0])  # (the first starts the measurement, the second is skipped)
    assert g.measured[PLAIN] == pytest.approx(1200.0) and g.regime() == TREES
    rounds(g, 10, 8, {FREE: 11, PLAIN: 11, TREES: 11}, t)
    assert g.verdicts[8].regime == PLAIN


def test_few_sessions_unsteady_rounds_and_another_batch_size():
    g, t = Governor(window=4, hold=8, budget=1.0), [0.0]
    rate = {FREE: 12, PLAIN: 16, TREES: 10}
    assert rounds(g, 20, 3, {FREE: 1, PLAIN: 9, TREES: 9}, t) == [FREE] * 20 and not g.verdicts  # too few sessions
    assert rounds(g, 6, 8, rate, t) == [FREE] + [PLAIN] * 5  # 8 sessions: their plain window at once
    assert rounds(g, 3, 8, rate, t, steady=False) == [TREES] * 3  # a chunk, a join: the window restarted
    assert PLAIN in g.measured and not g.verdicts
    rounds(g, 10, 8, rate, t)
    assert g.verdicts[8].regime == PLAIN
    assert rounds(g, 1, 16, rate, t) == [PLAIN]  # (decided before the round ended)
    assert g.phase == PLAIN and 16 not in g.verdicts  # 16 sessions: a size of its own, measured anew
    assert [bucket(n) for n in (4, 5, 8, 9, 16)] == [4, 8, 8, 16, 16]


def test_a_measurement_that_costs_much_is_paid_for_by_a_longer_hold():
    """Trees at half the plain rate and free choices at 3/4 of it: the measurement's losing windows
    cost 5 x (1/2 + 1/4) = 3.75 rounds, so with a budget of 5% the verdict holds 75 - 15 = 60 rounds
    (not 8); confirmed, it doubles from there; with every regime alike, the hold is the first one."""
    g, t = Governor(window=4, hold=8, budget=0.05), [0.0]
    rate = {FREE: 12, PLAIN: 16, TREES: 8}
    rounds(g, 16, 16, rate, t)
    assert g.verdicts[16].regime == PLAIN and g.verdicts[16].hold == 60
    assert rounds(g, 60, 16, rate, t) == [PLAIN] * 60
    assert rounds(g, 14, 16, rate, t) == AGAIN  # measured again: confirmed, its hold doubled
    assert g.verdicts[16].hold == 120
    g, t = Governor(window=4, hold=8, budget=0.05), [0.0]
    rounds(g, 16, 16, {FREE: 12, PLAIN: 12, TREES: 12}, t)
    assert g.verdicts[16].regime in (PLAIN, TREES) and g.verdicts[16].hold == 8  # (held: uniform rounds)


def test_a_hold_whose_rounds_decode_less_than_the_other_regime_measured_gives_way_to_it():
    """Trees measured best (15 against 12 plain), then held: once the hold's own latest 2 x window
    rounds decode less than plain steps' measured rate by the margin, plain steps hold instead (the
    first hold's length), and the history says which hold was revised; a hold that keeps its rate
    is not revised."""
    g, t = Governor(window=4, hold=64, budget=1.0), [0.0]
    rounds(g, 16, 8, {FREE: 11, PLAIN: 12, TREES: 15}, t)
    assert g.verdicts[8].regime == TREES
    later = {FREE: 11, PLAIN: 12, TREES: 10}  # (the sessions' trees grew: their rounds now decode less)
    assert rounds(g, 1 + 8, 8, later, t) == [TREES] * 9  # (the hold's first round left out, then eight)
    assert g.verdicts[8].regime == PLAIN and g.verdicts[8].hold == 64
    assert g.history[-1]["revised"] == TREES and g.history[-1]["rates"][TREES] == pytest.approx(1000.0)
    assert rounds(g, 64, 8, later, t) == [PLAIN] * 64
    g, t = Governor(window=4, hold=64, budget=1.0), [0.0]
    rate = {FREE: 11, PLAIN: 12, TREES: 12.5}  # (within the margin of plain's rate: the hold stands)
    rounds(g, 16, 8, rate, t)
    assert g.verdicts[8].regime == TREES and rounds(g, 64, 8, rate, t) == [TREES] * 64
    g, t = Governor(window=4, hold=64, budget=1.0), [0.0]
    rounds(g, 16, 8, {FREE: 12.1, PLAIN: 12, TREES: 15}, t)  # (free within the margin of plain steps)
    rounds(g, 1 + 8, 8, {FREE: 12.1, PLAIN: 12, TREES: 10}, t)
    assert g.verdicts[8].regime == PLAIN  # (a held regime, as a measurement's verdict would be)
    g, t = Governor(window=4, hold=64, budget=1.0), [0.0]
    rounds(g, 16, 8, {FREE: 12, PLAIN: 12.3, TREES: 7}, t)  # (plain held; free within the margin)
    assert g.verdicts[8].regime == PLAIN
    assert rounds(g, 40, 8, {FREE: 12, PLAIN: 11.5, TREES: 7}, t) == [PLAIN] * 40  # (never to the free choices)


def test_a_round_that_brings_the_batch_to_a_new_size_is_held_as_its_next_rounds():
    """regime(sessions, life): the regime of a round whose sessions make another batch size than the
    last round's is what round_end then gives that size's rounds: FREE below min_sessions, its verdict
    while it holds, a measurement's first regime (plain), plain alone where a smaller batch's trees
    lost, and the verdict or FREE where the batch will not last a measurement."""
    g, t = Governor(window=2, hold=100), [0.0]
    assert g.regime(2) == FREE and g.regime(4) == PLAIN and g.regime(4, life=10) == FREE
    rounds(g, 12, 4, {FREE: 8, PLAIN: 6, TREES: 4}, t)  # (4: trees lost; the free choices hold)
    assert g.verdicts[4].regime == FREE and g.trees_lost[4]
    assert g.regime(4) == FREE == g.regime() and g.regime(3) == FREE
    assert g.regime(8) == PLAIN == g.regime(8, life=10)  # (trees lost at 4: plain alone, however short)
    rounds(g, 6, 8, {FREE: 8, PLAIN: 12, TREES: 4}, t)
    assert g.verdicts[8].regime == PLAIN and g.regime(5) == PLAIN and g.regime(4) == FREE  # (5: bucket 8)
    g.trees_lost.clear()
    g.verdicts[4].left = 0
    assert g.regime(4) == PLAIN and g.regime(4, life=10) == FREE  # (the verdict spent: measured, unless short)
