"""The adaptive policy sees the chain a step without a tree would verify now (controller.chain_now,
from RequestLookup.peek): where the context has a strong chain it takes a lookup step, where it has
none a tree, from one step to the next; before, only the chains' average over recent steps priced
a plain step, so the choice lagged the text (docs/architecture.md, "Adaptive speculation")."""

from __future__ import annotations

import pytest

from specextend.config import TreeConfig
from specextend.controller import TreeController
from specextend.ladder import PLAIN, Rung, ladder
from specextend.lookup import ContextIndex, RequestLookup

RUNGS = ladder(TreeConfig(16, 6, 4))


def warmed() -> TreeController:
    """Past its warm-up: a plain forward 2.5 ms, 0.04 ms a row more, a draft level 0.5 ms; the full
    tree accepts 2 tokens a step; the chains of recent steps added little on average."""
    ctl = TreeController(list(RUNGS))
    for rows in (1, 17, 9, 1, 17):
        ctl.forward.add(rows, 2.5e-3 + 0.04e-3 * (rows - 1))
    ctl.draft.add(6, 3e-3)
    ctl.plain_forward, ctl.extra_plain, ctl.extra_spec = 2.5e-3, 0.3e-3, 0.3e-3
    ctl.accepted = {r: 2.0 for r in RUNGS[1:]}
    ctl.spec_steps, ctl.plain_steps, ctl.lookup_plain = 5, 5, 0.2
    return ctl


def test_a_strong_chain_now_takes_a_lookup_step_and_none_takes_a_tree():
    ctl = warmed()
    ctl.chain_now = (0, 0.0)  # nothing to copy here: a plain step would give one token
    assert not ctl.choose().plain
    ctl.chain_now = (8, 3.0)  # a chain expected to add three tokens for eight rows
    assert ctl.choose() == PLAIN
    assert ctl.rate(PLAIN) > ctl.rate(Rung(16, 6))
    ctl.chain_now = None  # no lookup: the average (0.2 tokens) prices a plain step, as before
    assert not ctl.choose().plain


def test_a_chains_rows_cost_a_plain_step_its_forward_line():
    ctl = warmed()
    ctl.chain_now = (0, 0.0)
    alone = ctl.step_seconds(PLAIN)
    ctl.chain_now = (8, 0.0)
    a, b = ctl.forward.line()
    assert ctl.step_seconds(PLAIN) - alone == pytest.approx(b * 8) and b > 0


def test_peek_is_what_the_next_step_without_a_tree_verifies_and_changes_nothing():
    ids = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3]  # "1 2 3" came before: "4 5 6 ..." followed it
    lookup = RequestLookup(ContextIndex(ids, 16), 4)
    nodes, gain = lookup.peek()
    assert nodes == 4 and 0 < gain <= 4 and gain == lookup.gate.gain(3)
    assert lookup.peek() == (nodes, gain) and lookup.chain() == [4, 5, 6, 7]
    assert RequestLookup(ContextIndex([1, 2, 3, 4], 16), 4).peek() == (0, 0.0)  # nothing repeats


def test_a_chain_alone_is_priced_by_the_steps_without_a_tree_not_by_the_trees():
    """The context lookup's gate prices a chain verified alone by the forwards of steps without a
    tree (`chains`), not by the line of every step, whose slope the trees' verifications set: on
    the tiny pair on a CPU that line priced a 9-row chain at 3.1 ms where chain steps took 2.2, and
    the speculative engine skipped every chain that mode lookup verified. Before chain steps tell a
    slope of their own, the line of every step lends its own; the line is carried to the engine's
    next session with the rest of the costs."""
    ctl = TreeController(list(RUNGS))
    for rows in (17, 33):  # two tree verifications, 0.2 ms a row
        ctl.record_forward(rows, 2.5e-3 + 0.2e-3 * (rows - 1))
        ctl.begin_step()
    ctl.record_forward(1, 2.5e-3)
    ctl.record_plain()
    assert ctl.chain_seconds(9) == pytest.approx(ctl.forward(9))  # one size seen: the steps' slope
    ctl.record_forward(9, 2.5e-3 + 0.02e-3 * 8)  # a chain step: 0.02 ms a row
    ctl.record_plain()
    assert ctl.chain_seconds(9) == pytest.approx(2.66e-3) and ctl.forward(9) > 3e-3
    lookup = RequestLookup(ContextIndex([1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3], 16), 8, cost=ctl.chain_seconds,
                           graft_cost=ctl.forward)
    lookup.gate.hit[3], lookup.gate.run[3] = 0.25, 1.0  # a chain expected to add a quarter of a token
    assert lookup.chain() == [4, 5, 6, 7, 8, 9, 1, 2]  # 1.25 x 2.5 ms >= 2.66 ms: it pays alone
    assert RequestLookup(lookup.index, 8, cost=ctl.forward, gate=lookup.gate).chain() == []  # (the trees' price)
    # until the chain steps' line has a slope of its own, the first chain found is verified anyway:
    # a slope lent by the trees must not keep chains out for good
    fresh = TreeController(list(RUNGS))
    fresh.forward = ctl.forward
    fresh.chains.prior = fresh.forward
    fresh.record_forward(1, 2.5e-3)
    fresh.record_plain()
    unpriced = RequestLookup(lookup.index, 8, cost=fresh.chain_seconds, gate=lookup.gate, cost_known=fresh.chains_priced)
    assert not fresh.chains_priced() and unpriced.chain() == [4, 5, 6, 7, 8, 9, 1, 2]
    assert lookup.skipped == 0 and unpriced.skipped == 0
    priced_out = RequestLookup(lookup.index, 8, cost=ctl.forward, gate=lookup.gate)
    assert priced_out.chain() == [] and priced_out.skipped == 1  # (a chain found, left out: counted)
    fresh.record_forward(9, 2.5e-3 + 0.02e-3 * 8)
    fresh.record_plain()
    assert fresh.chains_priced() and fresh.chain_seconds(9) == pytest.approx(2.66e-3)
    ctl.draft.add(6, 3e-3)
    ctl.plain_forward = 2.5e-3
    carried = TreeController(list(RUNGS))
    carried.start_from(ctl.costs())
    assert carried.chain_seconds(9) == pytest.approx(2.66e-3) and carried.chains.prior is carried.forward


def test_a_chain_steps_rows_do_not_make_the_plain_forward_dearer():
    """A chain step's forward costs its rows beyond the first at the line's slope (chain_now prices
    them), so the plain forward's average takes it less those rows."""
    ctl = TreeController(list(RUNGS))
    for rows in (1, 17, 9, 33):
        ctl.forward.add(rows, 2.5e-3 + 0.04e-3 * (rows - 1))
    ctl.record_forward(9, 2.5e-3 + 0.04e-3 * 8)  # a chain of eight verified
    ctl.record_plain(step_s=4e-3, lookup=3)
    assert ctl.plain_forward == pytest.approx(2.5e-3) and ctl.last_forward_s == pytest.approx(2.82e-3)
    ctl.record_forward(1, 2.4e-3)
    ctl.record_plain(step_s=2.8e-3)
    assert ctl.plain_forward == pytest.approx(0.7 * 2.5e-3 + 0.3 * 2.4e-3)


def test_a_tree_is_credited_chain_tokens_only_where_the_context_has_a_chain_now():
    """What grafted chains added beyond the draft's path (`lookup_spec`, averaged over the tree
    steps that had a chain to graft) is credited to a tree only where the index finds a chain now
    (RequestLookup.found): a plain step is priced from this step's chain, and a tree chosen where
    there is none cannot get chain tokens. Before, every tree was credited the average over all
    tree steps: on an H200 (2026-11-29, adaptive sweep, real pair at 16K) trees predicted at 556
    tok/s made 455 where `lookup`'s chain steps made 748 (Node.js docs), 389 against 297 on
    Shakespeare."""
    tree = Rung(16, 6)
    ctl = warmed()
    ctl.accepted = {r: 0.5 for r in RUNGS[1:]}  # a weak draft: its trees pay only with chains' tokens
    ctl.lookup_spec, ctl.chain_now = 2.0, (0, 0.0)
    ctl.chain_found = True  # a chain here, too short or unsure to pay alone: grafted onto a tree it may
    credited = ctl.rate(tree)
    assert not ctl.choose().plain
    ctl.chain_found = False  # nothing to copy here
    assert (credited - ctl.rate(tree)) * ctl.step_seconds(tree) == pytest.approx(2.0 * ctl.ready)
    assert ctl.choose() == PLAIN
    ctl.chain_found = False
    assert ctl.plain_still_best(1)
    ctl.chain_found = True
    assert not ctl.plain_still_best(1)
    # the average moves only on tree steps that had a chain
    ctl.record_spec(tree, 3e-3, {tree: 1}, lookup=None)
    assert ctl.lookup_spec == 2.0
    ctl.record_spec(tree, 3e-3, {tree: 1}, lookup=0)
    assert ctl.lookup_spec < 2.0


def test_the_lookup_says_whether_it_found_a_chain_at_its_last_peek_or_graft():
    lookup = RequestLookup(ContextIndex([1, 2, 3, 4, 5, 1, 2], 16), 4)
    lookup.peek()
    assert lookup.found
    alone = RequestLookup(ContextIndex([1, 2, 3, 4], 16), 4)  # nothing repeats
    assert alone.peek() == (0, 0.0) and not alone.found
    lookup.graft([9], [-1])
    assert lookup.found
    alone.graft([9], [-1])
    assert not alone.found


def test_a_trees_credit_for_a_chain_is_at_most_what_the_chain_gives_alone():
    """One chain, one price: what grafted chains added to recent trees (`lookup_spec`) credits a
    tree with no more than the gate expects of the chain found now alone (RequestLookup.gain_now,
    paying alone or not). A chain the gate expects little of no longer makes a tree beat the step
    that would verify it alone; one it expects much of makes both worth it, the cheaper one first."""
    tree = Rung(16, 6)
    ctl = warmed()
    ctl.accepted = {r: 0.3 for r in RUNGS[1:]}  # a weak draft
    ctl.lookup_spec, ctl.chain_found = 4.0, True  # the last trees' chains added four tokens each
    lookup = RequestLookup(ContextIndex([1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2], 16), 8)
    for _ in range(40):  # the gate has seen this order's chains miss
        lookup.gate.observe(2, 0)
    ctl.see_chain(lookup)
    assert lookup.found and 0.0 < ctl.chain_gain == lookup.gain_now < 0.1
    bounded = ctl.rate(tree)
    assert bounded * ctl.step_seconds(tree) == pytest.approx(1.0 + 0.3 + ctl.chain_gain)
    ctl.chain_gain = None  # (as before: the trees' average alone)
    assert ctl.rate(tree) * ctl.step_seconds(tree) == pytest.approx(1.0 + 0.3 + 4.0)
    assert not ctl.choose().plain  # credited four chain tokens, the tree wins
    ctl.see_chain(lookup)
    assert ctl.choose().plain  # credited what the chain gives alone, it does not
    for _ in range(60):  # now the gate expects much of this order's chains: a step verifies it alone
        lookup.gate.observe(2, 7)
    ctl.see_chain(lookup)
    assert ctl.chain_gain > 4.0 and ctl.rate(tree) * ctl.step_seconds(tree) == pytest.approx(5.3)
    assert ctl.choose() == PLAIN and ctl.chain_now[0] > 0
