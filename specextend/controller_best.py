"""The adaptive policy's best rung in one pass (TreeController.best without overlap): the same
predicted rates as TreeController.rate, each line read once instead of once per rung and call.

A choice is made every speculative step, on the host, between the target's forwards: profiled on
an H200 host a choice cost ~0.11 ms of a 2.3 ms step (2026-11-29), most of it the same lines and
averages recomputed for every rung. The slow twin is TreeController.best_slow (rate() per rung);
tests/test_controller_best.py compares them on random states (docs/architecture.md, "Adaptive
speculation"). The arithmetic is the twin's, term for term, so the two agree to the bit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from specextend.ladder import Rung

if TYPE_CHECKING:
    from specextend.controller import TreeController


def best_rung(ctl: "TreeController") -> Rung:
    """The rung of the highest predicted tokens per second (the smaller one on a tie), as
    TreeController.best_slow, for a controller without overlap."""
    best, best_key = None, None
    for rung, value in zip(ctl.rungs, rung_values(ctl)):
        key = (value, -rung.nodes, -rung.depth)
        if best_key is None or key > best_key:
            best, best_key = rung, key
    return best


def rung_values(ctl: "TreeController") -> list[float]:
    """TreeController.value of every rung (without overlap: its rate), in one pass."""
    a, b = ctl.forward.line()
    sessions = ctl.sessions
    share = a / max(sessions, 1)
    if ctl.priced_by_prior:  # (draft_seconds: the prior's price of a level)
        one = ctl.plain_forward if ctl.plain_forward is not None else a + b
        ratio, ad, bd = ctl.draft_ratio, 0.0, 0.0
    else:
        one, ratio = 0.0, None
        ad, bd = ctl.draft.line()
    # a step without a tree (_verified_seconds of PLAIN: its own forward, a chain's rows)
    fwd = share + b * 1
    if ctl.plain_forward is not None and sessions <= 1:
        fwd = ctl.plain_forward
    rows = ctl.chain_now[0] if ctl.chain_now else 0
    plain_s = fwd + ctl.chains.line()[1] * rows + (ctl.extra_plain or 0.0)
    plain_tokens = 1.0 + (ctl.lookup_plain if ctl.chain_now is None else ctl.chain_now[1])
    chains = ctl.lookup_spec if ctl.chain_found else 0.0
    chains = chains if ctl.chain_gain is None else min(chains, ctl.chain_gain)
    extra_spec = ctl.extra_spec or 0.0
    catchup = ctl.catchup_seconds()  # (the draft behind on steps without a tree)
    ready = ctl.ready
    rungs, accepted = ctl.rungs, ctl.accepted
    values = []
    for i, rung in enumerate(rungs):
        if rung.plain:
            values.append(plain_tokens / max(plain_s, 1e-9))
            continue
        draft_s = ad + bd * rung.depth if ratio is None else rung.depth * ratio * one
        verified = ctl.forward_seconds(rung.nodes + 1, share, b) + draft_s + extra_spec + catchup
        t = verified if ready >= 1.0 else ready * verified + (1 - ready) * (draft_s + plain_s)
        acc = 0.0  # expected_accepted: the rung's average, else the largest rung's inside it
        for r in reversed(rungs[1:i + 1]):
            if r in accepted and r.depth <= rung.depth:
                acc = accepted[r]
                break
        values.append((ready * (1.0 + acc + chains) + (1 - ready) * plain_tokens) / max(t, 1e-9))
    return values
