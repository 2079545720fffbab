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
