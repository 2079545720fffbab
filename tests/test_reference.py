"""Benchmarks' reference tokens (verify.Reference): every mode emits the reference's text, the target's
own choice overridden only where it differs, each such place's top-two gap kept, so that a real
divergence is still seen (docs/architecture.md, "Baselines")."""

from __future__ import annotations

import pytest

from specextend.config import SamplingParams
from specextend.request_limits import RequestError

from helpers import make_engine

PROMPT = list(range(3, 40)) * 3


@pytest.mark.parametrize("mode,lookup", [("ar", 0), ("specextend", 0), ("specextend", 8), ("lookup", 8)])
def test_every_mode_emits_the_reference_and_keeps_the_gap_where_it_overrode_the_target(pair, mode, lookup):
    params = SamplingParams(30, ignore_eos=True)
    ref, _, _ = make_engine(pair, "ar").generate(PROMPT, params)
    engine = make_engine(pair, mode, lookup_tokens=lookup)
    out, _, st = engine.generate(PROMPT, params, reference=ref)
    assert out == ref and st.reference_gaps == []  # the target's own text: nothing overridden
    other = list(ref)
    other[5] = (ref[5] + 1) % pair[0].args.vocab_size  # not the target's choice there
    out, _, st = engine.generate(PROMPT, params, reference=other)
    assert out == other
    assert st.reference_gaps and st.reference_gaps[0] > 0  # the target's own token scored higher
    assert st.reference_positions[0] == 5 and len(st.reference_positions) == len(st.reference_gaps)
    assert st.reference_chosen[0] == ref[5]  # the target's own choice where `other` overrode it
    plain, _, _ = make_engine(pair, mode, lookup_tokens=lookup).generate(PROMPT, params)
    assert plain == ref  # (without a reference: the target's own output, lossless)


def test_a_reference_needs_greedy_decoding(pair):
    with pytest.raises(RequestError, match="greedy"):
        make_engine(pair, "ar").generate(PROMPT, SamplingParams(5, temperature=0.7, seed=1), reference=[1, 2])


def test_a_reference_shorter_than_the_answer_leaves_the_rest_to_the_target(pair):
    params = SamplingParams(20, ignore_eos=True)
    ref, _, _ = make_engine(pair, "ar").generate(PROMPT, params)
    short = ref[:4] + [(ref[4] + 1) % pair[0].args.vocab_size]
    out, _, st = make_engine(pair, "specextend").generate(PROMPT, params, reference=short)
    assert out[:5] == short and len(out) == 20 and len(st.reference_gaps) == 1


def test_an_override_is_measured_in_rounding_steps_of_the_logits_magnitude():
    """A bfloat16 logit near 40 can only move in steps of 0.25: an override at a gap of 0.25 there
    is one rounding step, a near-tie (the fixed 0.125 tolerance is half a step at that size), one at
    0.5 is not; the response and the benchmarks' checks carry it (docs/architecture.md, "Baselines")."""
    import torch

    from specextend.near_tie import within_rounding
    from specextend.serving.protocol import SpeculativeDecoding, spec_decoding
    from specextend.stats import RequestStats
    from specextend.verify import Reference, rounding_step

    assert rounding_step(40.0, torch.bfloat16) == 0.25 and rounding_step(-20.0, torch.bfloat16) == 0.125
    assert rounding_step(1.5, torch.float32) == 2.0 ** -23 and rounding_step(0.0, torch.bfloat16) > 0
    logits = torch.full((1, 8), -5.0, dtype=torch.bfloat16)
    logits[0, 2], logits[0, 3], logits[0, 4] = 40.25, 40.0, 39.75
    ref = Reference([3, 4], dtype=torch.bfloat16)
    assert ref.pick(logits, 0, 2, 0) == 3 and ref.pick(logits, 0, 2, 1) == 4
    assert ref.gaps == [0.25, 0.5] and ref.steps == [0.25, 0.25]
    st = RequestStats()
    st.reference_gaps, st.reference_steps = ref.gaps, ref.steps
    assert st.reference_summary == dict(reference_overrides=2, reference_max_gap=0.5, reference_max_gap_steps=2.0)
    got = SpeculativeDecoding(**spec_decoding(st)).model_dump()
    assert got["reference_max_gap_steps"] == 2.0
    assert "reference_override_at" not in got  # (no positions: excluded like its neighbours)
    assert within_rounding(0.25, 1.0, 0.125) and not within_rounding(0.5, 2.0, 0.125)
    assert within_rounding(0.1, None, 0.125) and not within_rounding(0.25, None, 0.125)


def test_the_engine_measures_its_overrides_in_its_dtypes_steps(pair):
    params = SamplingParams(12, ignore_eos=True)
    ref, _, _ = make_engine(pair, "ar").generate(PROMPT, params)
    other = list(ref)
    other[3] = (ref[3] + 1) % pair[0].args.vocab_size
    _, _, st = make_engine(pair, "specextend").generate(PROMPT, params, reference=other)
    assert len(st.reference_steps) == len(st.reference_gaps) >= 1  # (the text after it is ar's no more)
    assert all(0 < s < 1e-10 for s in st.reference_steps)  # float64's steps at the logits' size


def test_each_override_keeps_its_output_position_and_the_response_lists_them():
    """The benchmarks settle an override beyond one rounding step by the target's rounding noise at its
    position (near_tie.settle_overrides): Reference keeps each one's output position beside its gap and
    step, and the response lists them, [position, gap, gap in steps] (docs/architecture.md, "Baselines")."""
    import json

    import torch

    from specextend.serving.protocol import SpeculativeDecoding, spec_decoding
    from specextend.stats import RequestStats
    from specextend.verify import Reference

    logits = torch.full((2, 8), -5.0, dtype=torch.bfloat16)
    logits[0, 2], logits[0, 3] = 40.25, 40.0
    logits[1, 5], logits[1, 6] = 40.5, 40.0
    ref = Reference([1, 1, 1, 1, 3, 1, 1, 6], dtype=torch.bfloat16)
    assert ref.pick(logits, 0, 1, 3) == 1  # the target's own choice: nothing kept
    assert ref.pick(logits, 0, 2, 4) == 3 and ref.pick(logits, 1, 5, 7) == 6
    assert ref.pick(logits, 1, 5, 9) == 5  # past the reference's end: the target's
    assert ref.positions == [4, 7] and ref.gaps == [0.25, 0.5] and ref.steps == [0.25, 0.25]
    assert ref.chosen == [2, 5]  # the target's own tokens there
    st = RequestStats()
    st.reference_gaps, st.reference_steps, st.reference_positions = ref.gaps, ref.steps, ref.positions
    st.reference_chosen = ref.chosen
    assert st.reference_summary["reference_override_at"] == [[4, 0.25, 1.0, 2], [7, 0.5, 2.0, 5]]
    body = json.loads(SpeculativeDecoding(**spec_decoding(st)).model_dump_json())
    assert body["reference_override_at"] == [[4, 0.25, 1.0, 2], [7, 0.5, 2.0, 5]] and body["reference_overrides"] == 2
    st.reference_steps = st.reference_chosen = None  # (no steps: none passes by steps; no tokens)
    assert st.reference_summary["reference_override_at"] == [[4, 0.25, None, None], [7, 0.5, None, None]]
