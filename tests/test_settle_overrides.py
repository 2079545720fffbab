"""Reference overrides beyond one rounding step are settled by the noise rule, as differing outputs
are: ok where the top-two gap is within twice the target's own rounding noise (bf16 against float32
logits of the same weights) at the override's position (near_tie.settle_overrides; the serve suite's
_settle and the e2e suite's check; docs/architecture.md, "Losslessness in finite precision")."""

from __future__ import annotations

import pytest
import torch

from specextend.models.decoder import Decoder
from specextend.near_tie import (check_line, float32_tie, overrides_of, reference_check, rounding_at, rounding_noise,
                                 settle_overrides, within_rounding)

PROMPT, REF = list(range(5, 30)), [7, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def decoders(tiny_models):
    """The tiny target in float32 and the same weights in bfloat16."""
    t, _ = tiny_models("float32")
    d = t.decoder
    return d, Decoder(d.args, d.w.to(dtype=torch.bfloat16), d.rope, d.backend)


@pytest.fixture(scope="module")
def noise(decoders):
    """The bf16 target's rounding noise after PROMPT + REF[:2] (an override at output position 2)."""
    return rounding_noise(decoders[1], PROMPT + REF[:2])


def test_an_override_within_twice_the_noise_at_its_position_is_a_near_tie(decoders, noise):
    _, bf = decoders
    assert noise > 0
    gap = 1.5 * noise  # beyond the tolerance and beyond one rounding step, within 2x the noise
    assert not within_rounding(gap, 3.0, 0.0)
    assert settle_overrides(bf, PROMPT, REF, [[2, gap, 3.0]], tol=0.0) == (True, noise, None)


def test_an_override_far_beyond_the_noise_is_a_divergence(decoders, noise):
    _, bf = decoders
    ok, *got = settle_overrides(bf, PROMPT, REF, [[2, 1.5 * noise, 3.0], [2, 10 * noise + 1.0, 40.0]], tol=0.0)
    assert not ok and got[0] == noise
    # the noise is measured where the override was: a gap within 2x one position's noise but not
    # another's is judged by its own
    other = rounding_noise(bf, PROMPT + REF[:4])
    assert other != noise
    gap = (2 * min(noise, other) + 2 * max(noise, other)) / 2
    at_small = 2 if noise < other else 4
    assert settle_overrides(bf, PROMPT, REF, [[at_small, gap, 3.0]], tol=0.0) == (False, min(noise, other), None)
    assert settle_overrides(bf, PROMPT, REF, [[6 - at_small, gap, 3.0]], tol=0.0) == (True, max(noise, other), None)


def test_an_override_with_the_target_s_token_is_judged_by_the_target_s_own_float32_logits(decoders, noise):
    """With the target's token (the response's fourth field) the override is a near-tie when the two
    tokens' float32 logits there are within twice the rounding noise, whatever the gap its own bf16
    path saw: the model itself cannot tell them apart beyond its rounding (near_tie.float32_tie)."""
    _, bf = decoders
    vocab = bf.args.vocab_size
    ids = PROMPT + REF[:2]
    got, logits = rounding_at(bf, ids, range(vocab))
    assert got == noise
    want = REF[2]
    others = sorted((abs(logits[t] - logits[want]), t) for t in range(vocab) if t != want)
    (near_gap, near), (far_gap, far) = others[0], others[-1]
    assert near_gap <= 2 * noise < far_gap  # (the tiny target's nearly flat logits have both)
    big = 10 * noise + 1.0  # the bf16 gap the path saw does not decide it
    assert settle_overrides(bf, PROMPT, REF, [[2, big, 40.0, near]], tol=0.0) == (True, noise, near_gap)
    assert settle_overrides(bf, PROMPT, REF, [[2, 0.5 * noise, 40.0, far]], tol=0.0) == (False, noise, far_gap)
    assert float32_tie(bf, ids, near, want) == (True, noise, near_gap)
    assert "float32 gap" in check_line(reference_check(bf, PROMPT, REF, list(REF), [[2, big, 40.0, far]], tol=0.0))


def test_within_rounding_measures_nothing_and_float32_or_no_position_settles_nothing(decoders, noise):
    f32, bf = decoders
    assert settle_overrides(bf, PROMPT, REF, [[2, 0.1, 2.0], [3, 0.25, 1.0]], tol=0.125) == (True, None, None)
    assert settle_overrides(f32, PROMPT, REF, [[2, 1.5 * noise, 3.0]], tol=0.0) == (False, None, None)
    assert settle_overrides(bf, PROMPT, REF, [[None, 1.5 * noise, 3.0]], tol=0.0) == (False, None, None)


def test_the_serve_suite_reads_overrides_with_the_target_s_token():
    """The suite's first look (near_tie.all_within_rounding) takes the response's four fields (a
    three-field unpacking of them had failed on every override)."""
    from specextend.near_tie import all_within_rounding

    r = dict(reference_overrides=2, reference_max_gap=0.25, reference_max_gap_steps=2.0,
             reference_override_at=[[4, 0.125, 1.0, 17], [7, 0.25, 2.0, 9]])
    assert not all_within_rounding(overrides_of(r), 0.125)  # the second: two steps, beyond the tolerance
    assert all_within_rounding(overrides_of(r)[:1], 0.125) and all_within_rounding([], 0.125)
    del r["reference_override_at"]
    assert not all_within_rounding(overrides_of(r), 0.125)  # an older app's largest gap alone


def test_overrides_of_a_result_with_and_without_positions():
    assert overrides_of({"reference_overrides": 0, "reference_max_gap": 0.0}) == []
    assert overrides_of({}) == []
    r = dict(reference_overrides=2, reference_max_gap=0.5, reference_max_gap_steps=2.0,
             reference_override_at=[[4, 0.25, 1.0], [7, 0.5, 2.0]])
    assert overrides_of(r) == [[4, 0.25, 1.0], [7, 0.5, 2.0]]
    del r["reference_override_at"]  # an app that reported no positions: its largest gap, nowhere to measure
    assert overrides_of(r) == [[None, 0.5, 2.0]]


def test_reference_check_joins_the_first_difference_and_the_overrides(decoders, noise):
    _, bf = decoders
    same = reference_check(bf, PROMPT, REF, list(REF), [[2, 1.5 * noise, 3.0]], tol=0.0)
    assert same["near_tie"] and not same["identical"] and same["rounding_noise"] == noise
    assert "near-tie" in check_line(same) and "rounding noise" in check_line(same)
    bad = reference_check(bf, PROMPT, REF, list(REF), [[2, 10 * noise + 1.0, 40.0]], tol=0.0)
    assert not bad["near_tie"] and check_line(bad).endswith("DIVERGED")
    plain = reference_check(bf, PROMPT, REF, list(REF), [], tol=0.0)
    assert plain["identical"] and plain["near_tie"] and plain["rounding_noise"] is None


def test_the_serve_suites_settle_takes_the_overrides(decoders, noise):
    """Served outputs equal to served ar's whose overrides are beyond one step go to _settle once the
    apps are gone, with their override lists: each judged by the noise at its position."""
    from specextend.bench.e2e import PAIRS
    from specextend.bench.serve import _settle

    _, bf = decoders
    pair = PAIRS["tiny"]

    def check(gap):
        return dict(pair="tiny", length=64, doc="python", mode="lookup", identical=False, near_tie=False,
                    overrides=1, max_gap=gap)

    near, far = check(1.5 * noise), check(10 * noise + 1.0)
    lines: list[str] = []
    _settle([(near, pair, PROMPT, REF, list(REF), [[2, near["max_gap"], 3.0]]),
             (far, pair, PROMPT, REF, list(REF), [[2, far["max_gap"], 40.0]])],
            progress=lines.append, loaded={pair.target: bf})
    assert near["near_tie"] is True and near["rounding_noise"] == noise
    assert far["near_tie"] is False and far["rounding_noise"] == noise
    assert lines[0].startswith("served tiny L=64 python lookup: 1 overrides") and lines[0].endswith("near-tie")
    assert f"rounding noise {noise:.4f}" in lines[0] and lines[1].endswith("DIVERGED")
