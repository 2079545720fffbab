"""The probe schedule of the adaptive policy (controller.py, docs/architecture.md, "Adaptive
speculation"): after a probe, the next comes twice as late, and never sooner than what the costs
measured by then say a probe could win (costs.probe_interval), and never later than a few seconds
of steps (costs.probe_cap)."""

import math

from specextend.controller import TreeController
from specextend.ladder import PLAIN

from tests.test_controller import FIXED, LEVEL, PROFILES, ROW, RUNGS


def drive(ctl, steps, lookup):
    """Steps of the synthetic costs (test_controller's) where trees accept nearly nothing and each
    plain step's context-lookup chain adds `lookup` tokens (its forward `lookup` rows wider)."""
    useless, chosen = dict(zip(RUNGS[1:], PROFILES["useless"])), []
    for _ in range(steps):
        r = ctl.choose()
        rows = r.nodes + 1 + (lookup if r.plain else 0)
        ctl.record_forward(rows, FIXED + ROW * rows)
        if r.plain:
            ctl.record_plain(lookup=lookup)
        else:
            covered = [q for q in ctl.rungs[1:] if q.nodes <= r.nodes and q.depth <= r.depth]
            ctl.record_spec(r, LEVEL * r.depth, {q: useless[q] for q in covered})
        chosen.append(r)
    return chosen


def test_probes_stop_once_plain_steps_outrun_any_trees_best_case():
    """Plain steps whose lookup chains come to yield 8 more tokens a step outrun every tree even
    fully accepted (the real pair at 16K on an H200: lookup runs of 1.9 tokens a 2 ms step against
    full trees of ~11 ms): a probe could win nothing, so after the first probe that measured it
    the next is max_probe steps away, not twice the last gap (which spent five ~11 ms probes on
    256 tokens, 2026-12-01). Before it, while trees could pay, the gaps double. (No cap in seconds
    here: the next test's.)"""
    ctl = TreeController(list(RUNGS), probe_every_s=math.inf)
    before = drive(ctl, 200, lookup=0)
    probes = [i for i, r in enumerate(before) if not r.plain][2:]  # (after the warm-up's two)
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert len(gaps) >= 2 and all(g2 == 2 * g1 - 1 for g1, g2 in zip(gaps, gaps[1:]))
    after = drive(ctl, 3 * ctl.max_probe, lookup=8)
    assert ctl.best() == PLAIN
    late = [i for i, r in enumerate(after) if not r.plain]
    assert late and late[0] < 2 * gaps[-1]  # the probe already due
    assert all(b - a > ctl.max_probe for a, b in zip(late, late[1:]))
    assert len(late) <= 3


def test_probes_come_back_within_seconds_of_steps_but_cost_at_most_a_fiftieth():
    """The same plain steps that outrun every tree, with the cap in seconds (the default, 2 s): the
    probes do not stop; they come back at least every 2 s of the predicted plain steps (a batch that
    shrank, or costs carried from a loaded session, are found out within seconds: issue 14's trap of
    up to 1,024 steps), and never so often that they take more than a fiftieth of the time."""
    ctl = TreeController(list(RUNGS))
    drive(ctl, 200, lookup=0)
    after = drive(ctl, 3 * ctl.max_probe, lookup=8)
    assert ctl.best() == PLAIN
    late = [i for i, r in enumerate(after) if not r.plain]
    t_plain = ctl.step_seconds(PLAIN)  # (~10 ms: test_controller's synthetic costs)
    cap = math.ceil(ctl.probe_every_s / t_plain)
    assert cap < ctl.max_probe
    gaps = [b - a for a, b in zip(late, late[1:])]
    assert len(late) >= 3 * ctl.max_probe // (cap + 1) and max(gaps) <= cap + 1, (gaps, cap)
    probe_s = sum(ctl.step_seconds(r) for r in after if not r.plain)
    assert probe_s <= sum(ctl.step_seconds(r) for r in after) / 50
