"""What the adaptive policy expected of each kind of step (controller.choose_noted), beside what
those steps did (stats.step_kinds): docs/architecture.md, "Adaptive speculation"."""

import pytest

from specextend.config import SamplingParams, TreeConfig
from specextend.controller import TreeController
from specextend.ladder import ladder

from helpers import make_engine
from test_controller import FIXED, LEVEL, PROFILES, ROW, simulate, true_rate


def test_the_policy_notes_what_it_expected_of_each_kind_of_step_beside_what_they_did(tiny_models):
    """choose_noted: once the warm-up has measured the costs, each choice's predicted tokens/s goes
    into `predicted` by kind (the synthetic costs' true rates, here); the engine's stats and the
    response carry the means beside step_kinds, and the bench's line prints them."""
    from specextend.bench.e2e import kinds_line
    from specextend.serving.protocol import SpeculativeDecoding, spec_decoding

    ctl = TreeController(ladder(TreeConfig(16, 6, 4)))
    accepted = dict(zip(ctl.rungs[1:], PROFILES["easy"]))
    for _ in range(3):  # the warm-up: nothing noted before the costs are measured
        r = ctl.choose_noted()
        ctl.record_forward(r.nodes + 1, FIXED + ROW * (r.nodes + 1))
        if r.plain:
            ctl.record_plain()
        else:
            ctl.record_spec(r, LEVEL * r.depth, {q: accepted[q] for q in ctl.rungs[1:]
                                                 if q.nodes <= r.nodes and q.depth <= r.depth})
    noted = sum(n for _, n in ctl.predicted.values())
    assert noted <= 2 and not (noted and ctl.plain_steps == 0)
    simulate(ctl, accepted, 20)  # (simulate calls choose: nothing noted)
    before = {k: n for k, (_, n) in ctl.predicted.items()}
    best = ctl.choose_noted()  # the easy profile: a tree, and one more noted for it
    assert not best.plain and ctl.predicted["tree"][1] == before.get("tree", 0) + 1
    assert ctl.rate(best) == pytest.approx(true_rate(best, accepted), rel=0.2)  # what it expects: near the truth

    pair = tiny_models("float64")
    engine = make_engine(pair, "sd", tree=TreeConfig(8, 4, 3), tree_policy="adaptive", lookup_tokens=0)
    # acceptance replayed at 3: trees after trees, which measure the draft (a tree after plain steps
    # does not), so that the policy's predictions begin whatever the random pair accepts
    _, _, stats = engine.generate(list(range(3, 90)), SamplingParams(40, ignore_eos=True), replay=[3])
    means = stats.predicted_tok_per_s
    assert means and set(means) <= {"tree", "plain"} and all(v > 0 for v in means.values())
    assert sum(n for _, n in stats.predicted.values()) <= stats.num_steps + stats.plain_steps + stats.unready_steps
    spec = SpeculativeDecoding(**spec_decoding(stats)).model_dump()
    assert spec["predicted_tok_per_s"] == pytest.approx(means)
    assert "; predicted " in kinds_line(dict(step_kinds=spec["step_kinds"], predicted_tok_per_s=means))
