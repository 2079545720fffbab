"""Context-lookup chains in the draft's overlap pool (specextend/draft/lookup_chains.py, Pool.add_chain;
docs/architecture.md "Context lookup"): the chain joins the pool, the background forwards it parents
first, and a verdict that runs through it is answered ready, with the caches a plain step leaves."""

from __future__ import annotations

import math

import pytest
import torch

from specextend.config import RetrievalConfig, TreeConfig
from specextend.draft.base import DraftSessionParams
from specextend.draft.lookup_chains import HIT_PRIOR, LookupChains
from specextend.draft.pool import Pool
from specextend.draft.session import DraftSession

from test_overlap import grow

TREE = TreeConfig(8, 4, 3)


def small_pool() -> Pool:
    # root -> a(0) b(1); a -> c(2); forwarded: a, b
    return Pool.from_expansion([10, 11, 12], [-0.1, -2.0, -0.3], [-1, -1, 0], [1, 1, 2], forwarded=[0, 1])


def test_a_chain_follows_the_pool_then_hangs_below_it():
    pool = small_pool()
    assert pool.add_chain([10, 12, 20, 21], math.log(0.5)) == 2  # a, c exist; 20, 21 are new
    assert pool.walk([10, 12, 20, 21]) == [0, 2, 3, 4]
    assert pool.parents[3:] == [2, 3] and pool.depths[3:] == [3, 4]
    assert pool.scores[3] == pytest.approx(-0.3 + math.log(0.5))
    assert pool.scores[4] == pytest.approx(pool.scores[3] + math.log(0.5))
    assert pool.add_chain([10, 12, 20, 21], math.log(0.5)) == 0  # all there now
    assert pool.add_chain([30], -1.0) == 1 and pool.parents[-1] == -1 and pool.depths[-1] == 1
    with pytest.raises(ValueError):
        pool.add_chain([1], 0.0)


def test_the_frontier_takes_a_chain_parents_first_and_each_node_once():
    pool = small_pool()
    pool.add_chain([10, 12, 20, 21, 22], -0.01)  # a chain the draft barely doubts
    nodes = pool.frontier(8, 10)
    assert len(nodes) == len(set(nodes))
    for k, n in enumerate(nodes):  # every node's unforwarded parent comes before it
        p = pool.parents[n]
        assert p < 0 or pool.slots[p] >= 0 or p in nodes[:k]
    pool.mask(nodes, pool.staged)  # raises if a parent were missing


def test_the_drafts_children_do_not_duplicate_a_chain_node_and_raise_its_score():
    pool = small_pool()
    pool.add_chain([10, 12, 20], math.log(0.1))  # 20 below c, scored low
    chained = pool.walk([10, 12, 20])[-1]
    old = pool.scores[chained]
    pool.mark_forwarded([2], pool.staged, 1)  # c forwarded: the draft's children of c arrive
    pool.add_children([2], torch.tensor([[20, 25]]), torch.tensor([[-0.05, -3.0]]))
    kids = pool.children(2)
    assert [pool.tokens[i] for i in kids] == [20, 25]  # 20 once: the chain's node
    assert pool.scores[chained] == pytest.approx(-0.3 - 0.05) and pool.scores[chained] > old
    assert pool.frontier(8, 10).count(chained) == 1  # its stale heap entry is skipped


def test_the_prior_follows_the_chains_hits():
    ch = LookupChains([1, 2, 3, 4, 1, 2, 3], 16, tokens=3)
    pool = small_pool()
    assert ch.seed(pool) == 3 and ch.last == [4, 1, 2]
    assert ch.logp == pytest.approx(math.log(HIT_PRIOR))
    ch.accepted([4, 1, 2])  # its first token was right
    assert ch.hit > HIT_PRIOR and ch.index.length == 10
    assert ch.seed(small_pool()) > 0 and ch.last == [3, 4, 1]
    before = ch.hit
    ch.accepted([7])  # wrong
    assert ch.hit < before and ch.order == 3
    # a chain found through the last token alone has a prior of its own: the trigram's record stays
    uni = LookupChains([5, 8, 9, 3, 5], 16, tokens=3)
    uni.hits[3] = 0.9
    assert uni.seed(small_pool()) == 3 and uni.order == 1 and uni.logp == pytest.approx(math.log(HIT_PRIOR))
    uni.accepted([6])
    assert uni.hits == {3: 0.9, 1: pytest.approx((1 - 0.2) * HIT_PRIOR)}


@pytest.fixture(scope="module")
def draft(tiny_models):
    return tiny_models("float64")[1].decoder


@pytest.mark.parametrize("retrieval,levels", [(False, 1), (True, 1), (False, 2)])
def test_a_verdict_through_the_chain_is_ready_with_the_caches_of_a_plain_step(draft, retrieval, levels):
    """A prompt that repeats itself: after the first answer the pool holds the chain the context
    suggests; once the background has forwarded it, a verdict that accepts the chain and takes one
    of the draft's children below it as the bonus is answered from the pool, and the committed K/V
    equal those of a session without chains that was sent the same tokens. With chained levels
    (`levels` 2) a level's pick that is a chain's node takes that node's id (Flight.bases by column)."""
    head = [(13 * i + 7) % 200 for i in range(20)]
    p = head * 3 + head[:5]  # the context's end occurred before: its continuation is head[5:]
    r = RetrievalConfig(enabled=retrieval, chunk_size=8, top_k=4, draft_prefill_window=0)
    with_chains = DraftSession(draft, p, DraftSessionParams(TREE, r, 64, lookup_tokens=6), overlap=True,
                               overlap_levels=levels)
    plain = DraftSession(draft, p, DraftSessionParams(TREE, r, 64), overlap=True)
    root = head[5]  # the step's bonus token continues the repetition
    with_chains.step(0, [root], None)
    plain.step(0, [root], None)
    assert with_chains.chains.last == head[6:12] and with_chains.chains.seeded > 0
    grow(with_chains)
    pool = with_chains.pool
    path = pool.walk(head[6:12])
    assert None not in path and all(pool.slots[n] >= 0 for n in path)  # forwarded, parents first
    bonus = next(i for i in pool.children(path[2]) if pool.slots[i] >= 0 and pool.tokens[i] != head[9])
    verdict = head[6:9] + [pool.tokens[bonus]]  # three chain tokens accepted, then a draft child
    hit = with_chains.step(1, verdict, None)
    plain.pool = None  # it drafts anew
    ref = plain.step(1, verdict, None)
    assert hit.ready and not ref.ready
    pool = with_chains.pool  # every (parent, token) once: no duplicate siblings
    assert len({(pool.parents[i], pool.tokens[i]) for i in range(len(pool))}) == len(pool)
    n = plain.work.length
    assert with_chains.work.length == n
    assert torch.allclose(with_chains.work.data[:, :, :, :n], plain.work.data[:, :, :, :n], atol=1e-9)
    assert max(with_chains.chains.hits.values()) > HIT_PRIOR  # that chain's first token was the verdict's


def test_params_carry_the_chain_length_over_the_wire():
    from specextend.rpc.convert import params_from_proto, params_to_proto

    params = DraftSessionParams(TREE, RetrievalConfig(enabled=False), 32, lookup_tokens=7)
    assert params_from_proto(params_to_proto(params)).lookup_tokens == 7
