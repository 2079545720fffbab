"""Tree helpers and the verification rule, including a statistical test of the sampling path."""

import math

import pytest
import torch

from specextend.config import SamplingParams
from specextend.sampling import make_generator, target_probs
from specextend.tree import ancestor_mask, node_depths, select_best_nodes
from specextend.verify import verify_tree

PARENTS = [-1, -1, 0, 0, 1, 2]


def test_masks_and_depths():
    assert node_depths(PARENTS) == [1, 1, 2, 2, 2, 3]
    m = ancestor_mask(PARENTS)
    assert m[6].tolist() == [True, True, False, True, False, False, True]  # root, 0, 2, itself (5 -> row 6)
    with pytest.raises(ValueError):
        node_depths([1, -1])


def test_best_nodes_closed_under_ancestors_and_topological():
    depths = node_depths(PARENTS)
    sel = select_best_nodes([-0.1, -0.5, -0.2, -0.3, -0.9, -0.35], depths, PARENTS, 4)
    assert sel == [0, 2, 3, 5]
    with pytest.raises(ValueError):  # a child better than its parent breaks the invariant
        select_best_nodes([-0.9, -0.5, -0.1, -0.3, -0.9, -0.35], depths, PARENTS, 1)


def test_greedy_walk():
    v = 8
    tokens = [3, 4, 5, 6, 7, 1]
    logits = torch.zeros(len(tokens) + 1, v)
    logits[0, 3] = 1  # root -> node 0 (token 3)
    logits[1, 6] = 1  # node 0 -> node 3 (token 6)
    logits[4, 2] = 1  # node 3 has no child with token 2 -> bonus 2
    vd = verify_tree(logits, tokens, PARENTS, SamplingParams(), None)
    assert vd.accepted == [0, 3] and vd.tokens == [3, 6, 2] and vd.bonus_token == 2
    forced = verify_tree(logits, tokens, PARENTS, SamplingParams(), None, forced_length=5)
    assert forced.accepted == [0, 2, 5]  # first-child branch, as deep as the tree goes


def test_replayed_bonus_from_the_draft():
    """Replay with draft_bonus: where the forced path stops the bonus is the stopping node's second
    child (the draft's second choice); where it has none, the target's own token."""
    v = 8
    tokens = [3, 4, 5, 6, 7, 1]  # root's children 0 (3), 1 (4); node 0's children 2 (5), 3 (6)
    logits = torch.zeros(len(tokens) + 1, v)
    logits[:, 2] = 1  # the target's own choice everywhere: token 2, no node's
    one = verify_tree(logits, tokens, PARENTS, SamplingParams(), None, forced_length=1, draft_bonus=True)
    assert one.accepted == [0] and one.tokens == [3, 6]  # node 0 stops; its second child, node 3
    zero = verify_tree(logits, tokens, PARENTS, SamplingParams(), None, forced_length=0, draft_bonus=True)
    assert zero.accepted == [] and zero.tokens == [4]  # the root's second child, node 1
    leaf = verify_tree(logits, tokens, PARENTS, SamplingParams(), None, forced_length=5, draft_bonus=True)
    assert leaf.accepted == [0, 2, 5] and leaf.bonus_token == 2  # node 5 has no children: the target's
    own = verify_tree(logits, tokens, PARENTS, SamplingParams(), None, forced_length=1)
    assert own.tokens == [3, 2]


def chi2_critical(dof, z=3.719):  # Wilson-Hilferty, upper tail p ~ 1e-4
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 1.0, 5)])
def test_sampling_verification_follows_target_distribution(temperature, top_p, top_k):
    """First and second emitted tokens ~ the target's distributions, whatever the draft proposes."""
    v = 8
    gen = torch.Generator().manual_seed(0)
    tokens = [1, 2, 3, 4, 5, 6]  # root children 1, 2; node0's children 3, 4; node1's child 5; ...
    logits = torch.randn(len(tokens) + 1, v, generator=gen, dtype=torch.float64) * 1.5
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=2)
    probs = target_probs(logits, params)  # [N+1, V]
    rng = make_generator(123)
    n = 20000
    first = torch.zeros(v)
    second_after_1 = torch.zeros(v)
    for _ in range(n):
        vd = verify_tree(logits, tokens, PARENTS, params, rng)
        first[vd.tokens[0]] += 1
        if vd.tokens[0] == 1 and len(vd.tokens) > 1:
            second_after_1[vd.tokens[1]] += 1
    for counts, p in ((first, probs[0]), (second_after_1, probs[1])):
        support = p > 0
        assert counts[~support].sum() == 0  # never a token the target excludes
        expected = counts.sum() * p[support]
        chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
        assert chi2 < chi2_critical(int(support.sum()) - 1), (chi2, counts, expected)
    # acceptance at the root = target mass on the root's children (optimal for fixed candidates)
    accept_rate = (first[1] + first[2]) / n
    assert abs(accept_rate - float(probs[0, 1] + probs[0, 2])) < 0.02


def test_rounding_noise_is_zero_in_float64_and_positive_in_bf16(tiny_models):
    from specextend.models.decoder import Decoder
    from specextend.near_tie import rounding_noise

    t, _ = tiny_models("float64")
    ids = list(range(5, 40))
    assert rounding_noise(t.decoder, ids) == 0.0
    d = t.decoder
    bf = Decoder(d.args, d.w.to(dtype=torch.bfloat16), d.rope, d.backend)
    noise = rounding_noise(bf, ids)
    from specextend.attention.backends import CAUSAL

    logits, _ = d.forward(torch.tensor(ids, device=d.device), torch.arange(len(ids), device=d.device),
                          d.new_cache(64), CAUSAL)
    scale = float(logits[-1].abs().max())
    assert 0.0 < noise < 0.05 * scale, (noise, scale)  # bf16 moves the logits, but only by rounding


def test_lossless_check_measures_the_rounding_noise_only_for_reduced_precision_divergences(tiny_models):
    """A divergence past the fixed tolerance: float32 says no without measuring noise; bf16 measures
    its own rounding noise there and judges the two tokens' float32 logits against twice it."""
    from specextend.models.decoder import Decoder
    from specextend.near_tie import lossless_check, rounding_at, rounding_noise, top2_gap

    t, _ = tiny_models("float32")
    d = t.decoder
    prompt, ref = list(range(5, 30)), [7, 8, 9, 10]
    out = ref[:2] + [ref[2] + 1, 3]  # differs at position 2
    same = lossless_check(d, prompt, ref, list(ref), 1e-3)
    assert same["identical"] and same["near_tie"] and same["rounding_noise"] is None
    c = lossless_check(d, prompt, ref, out, tol=0.0)
    assert c["first_divergence"] == 2 and c["rounding_noise"] is None and not c["near_tie"]
    bf = Decoder(d.args, d.w.to(dtype=torch.bfloat16), d.rope, d.backend)
    c = lossless_check(bf, prompt, ref, out, tol=0.0)
    gap = top2_gap(bf, prompt + ref[:2])
    noise = rounding_noise(bf, prompt + ref[:2])
    assert c["top2_gap"] == gap and c["rounding_noise"] == noise > 0
    _, (la, lb) = rounding_at(bf, prompt + ref[:2], (ref[2], out[2]))  # the two tokens' float32 logits
    assert c["float32_gap"] == abs(la - lb) and c["near_tie"] == (abs(la - lb) <= 2 * noise)
    assert lossless_check(bf, prompt, ref, out, tol=gap)["rounding_noise"] is None  # within the fixed tolerance


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("temperature,top_p", [(1e-38, 1.0), (1e-46, 1.0), (1e-300, 1.0), (5e-324, 1.0),
                                               (1.0, 1e-46), (0.7, 1e-300)])
def test_target_probs_at_the_limits_is_the_argmax(dtype, temperature, top_p):
    """temperature -> 0 and top_p -> 0 tend to greedy: all mass on the argmax (ties share it,
    under top_p too: it keeps every token tied with the least likely one it keeps), never NaN
    (which inverse-CDF sampling turned into the last vocabulary id)."""
    logits = torch.tensor([[4.0, 9.5, -3.0, 7.0, 0.0], [2.0, 2.0, -1.0, 1.0, 2.0]], dtype=dtype) * 10
    probs = target_probs(logits, SamplingParams(temperature=temperature, top_p=top_p))
    assert torch.equal(probs[0], torch.tensor([0, 1, 0, 0, 0], dtype=dtype))
    assert torch.allclose(probs[1], torch.tensor([1, 1, 0, 0, 1], dtype=dtype) / 3)


@pytest.mark.parametrize("params", [SamplingParams(8, temperature=1.0), SamplingParams(8, temperature=0.7, top_p=0.9),
                                    SamplingParams(8, temperature=1.3, top_k=5, top_p=0.8)])
def test_rows_sampled_at_once_verify_as_one_after_another(params):
    """verify_tree on a GPU samples every row at once (one search over the rows, each with its
    depth's uniform) and then sets the generator to one draw per emitted token: its twin samples
    row after row along the path. The same verdicts, and the generators in the same state after, on random
    trees whose rows' distributions make the draft's children likely (long accepted paths)."""
    g = torch.Generator().manual_seed(5)
    for trial in range(60):
        n = int(torch.randint(1, 12, (1,), generator=g))
        parents = [-1] + [int(torch.randint(0, i + 1, (1,), generator=g)) - 1 for i in range(1, n)]
        tokens = [int(t) for t in torch.randint(0, 6, (n,), generator=g)]
        logits = torch.randn(n + 1, 6, generator=g, dtype=torch.float64) * 0.5  # flat: paths run deep
        a, b = make_generator(trial), make_generator(trial)
        for _ in range(3):  # the generator carries on from each verdict
            va = verify_tree(logits, tokens, parents, params, a, at_once=True)
            vb = verify_tree(logits, tokens, parents, params, b, at_once=False)
            assert (va.accepted, va.tokens) == (vb.accepted, vb.tokens)
        assert torch.equal(a.get_state(), b.get_state())
