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
