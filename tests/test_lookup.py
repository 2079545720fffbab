"""Context lookup (specextend/lookup.py): the index against its scan twin, and grafting chains onto trees."""

from __future__ import annotations

import random

import pytest

from specextend.lookup import ContextIndex, RequestLookup, continuation_scan, graft
from specextend.lookup_gate import LookupGate
from specextend.tree import children_of


@pytest.mark.parametrize("seed", range(20))
def test_index_equals_scan_as_tokens_arrive(seed):
    rng = random.Random(seed)
    vocab = rng.choice([5, 50, 151936])
    ids = [rng.randrange(min(vocab, 6)) for _ in range(rng.randrange(0, 40))]
    idx = ContextIndex(ids, vocab, capacity=8)  # grows past its capacity below
    for _ in range(30):
        k = rng.randrange(0, 10)
        assert idx.continuation(k) == continuation_scan(ids, k)
        assert idx.match(k) == idx.match_vectorised(k)  # the dict against every key compared
        new = [rng.randrange(min(vocab, 6)) for _ in range(rng.randrange(1, 5))]
        ids += new
        idx.extend(new)
        assert idx.ids[:idx.length].tolist() == ids


@pytest.mark.parametrize("seed", range(10))
def test_short_extends_equal_the_numpy_path(seed):
    """ContextIndex.extend of a step's few tokens (Python ints, up to SHORT_EXTEND) leaves the same
    ids, keys and latest-start dicts as its numpy twin, the path of longer extends."""
    from specextend import lookup

    rng = random.Random(seed)
    vocab = rng.choice([5, 50, 151936])
    ids = [rng.randrange(min(vocab, 7)) for _ in range(rng.randrange(0, 30))]
    fast, slow = ContextIndex(ids, vocab, capacity=4), ContextIndex(ids, vocab, capacity=4)
    for _ in range(25):
        new = [rng.randrange(min(vocab, 7)) for _ in range(rng.randrange(1, lookup.SHORT_EXTEND + 1))]
        fast.extend(new)
        short, lookup.SHORT_EXTEND = lookup.SHORT_EXTEND, 0  # the numpy path
        try:
            slow.extend(new)
        finally:
            lookup.SHORT_EXTEND = short
        n = fast.length
        assert n == slow.length and fast.ids[:n].tolist() == slow.ids[:n].tolist()
        assert all(fast.keys[k][:n].tolist() == slow.keys[k][:n].tolist() for k in fast.ns)
        assert fast.latest == slow.latest


def test_continuation_copies_what_followed_the_latest_longest_match():
    # "1 2 3 4 5" then later "9 2 3 7" then the context ends with "... 1 2 3": the 3-gram 1 2 3 wins
    ids = [1, 2, 3, 4, 5, 6, 9, 2, 3, 7, 8, 1, 2, 3]
    assert ContextIndex(ids, 16).continuation(3) == [4, 5, 6]
    # only a 2-gram matches: the latest occurrence of "2 3"
    ids = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 0, 2, 3]
    assert ContextIndex(ids, 16).continuation(4) == [7, 8, 0, 2]
    assert ContextIndex([1, 2, 3, 4], 16).continuation(4) == []  # nothing repeats
    assert ContextIndex(ids, 16).continuation(0) == []


def test_match_names_the_order_and_falls_back_to_the_last_token():
    ids = [7, 1, 2, 3, 4, 5, 6, 9, 1, 2, 3]
    assert ContextIndex(ids, 16).match(2) == (3, [4, 5])
    assert ContextIndex([5, 8, 9, 3, 5], 16).match(3) == (1, [8, 9, 3])  # only the last token repeats
    assert ContextIndex([5, 8, 9, 3, 5], 16, ns=(3, 2)).match(3) == (0, [])
    assert continuation_scan([5, 8, 9, 3, 5], 3) == [8, 9, 3]


def _cost(a, b):
    return lambda rows: a + b * rows


def test_the_gate_prices_a_chain_by_its_rows_and_its_order_s_record():
    gate = LookupGate()
    assert gate.use(1, 8, _cost(0.0, 0.0)) and gate.use(1, 8, _cost(2.0, 0.0))  # no slope: a chain is free
    # prior: half the chains hit, two tokens each: worth up to 2x a one-row forward
    assert gate.use(1, 8, _cost(2.0, 0.1)) and not gate.use(1, 8, _cost(0.5, 0.5))
    for _ in range(40):  # unigram chains that keep missing (seen on plain steps), trigram ones that run
        gate.observe_skipped(1, False)
        gate.observe(3, 6)
    assert gate.gain(1) < 0.02 and gate.gain(3) > 5
    steep = _cost(2.34e-3, 0.036e-3)  # the 1.5B at 16K: a chain of 8 costs 12% more than one row
    assert not gate.use(1, 8, steep) and gate.use(3, 8, steep) and gate.use(2, 8, steep)  # 2: its prior
    gate.observe(2, 0)
    assert gate.hit[2] < gate.hit_prior and 2 not in gate.run  # a miss teaches the hit rate only


def test_the_gate_prices_a_chain_step_s_host_work_too():
    """A chain step's wall time beyond its forward (verification, commit, bookkeeping; the device
    idle) against a plain step's, learnt from the steps' wall times: a chain that pays by its rows
    alone does not when its step's host work costs more than its expected tokens bring. Served on
    two H200s (2026-11-27) steps without a tree averaged 3.2-3.5 ms against 2.35 for `ar`'s, and on
    Shakespeare 85 of them gave 20 tokens: 0.80x `ar`."""
    line = _cost(2.34e-3, 0.036e-3)
    ids = [4, 9, 1, 4, 9, 1, 4]  # the last trigram repeats: a chain [9, 1, 4] at every step
    lookup = RequestLookup(ContextIndex(ids, 16), 3, cost=line)
    for _ in range(8):  # chains that the target takes one token of, a third of the time
        lookup.gate.observe(3, 1)
        lookup.gate.observe(3, 0)
        lookup.gate.observe(3, 0)
    assert lookup.chain() == [9, 1, 4]  # by rows alone it pays (gain ~0.3 against 4% more time)
    lookup.commit([9, 1, 4, 9], step_s=line(4) + 0.9e-3)  # a chain step: 0.9 ms of host work
    lookup.index = ContextIndex(ids, 16)
    lookup.gate.run[3], lookup.gate.hit[3] = 1.0, 1 / 3
    lookup._step, lookup._rows = None, 1  # a plain step: 0.1 ms
    lookup.commit([9], step_s=line(1) + 0.1e-3)
    assert lookup.gate.host == {True: pytest.approx(0.9e-3), False: pytest.approx(0.1e-3)}
    assert lookup.chain() == []  # (1 + 0.33) x 2.48 ms < 2.45 + 0.9 ms: decode plainly
    # grafted onto a tree the same chain adds only its rows (the tree's step is verified anyway)
    assert lookup.gate.use(3, 3, line) and not lookup.gate.use(3, 3, line, alone=True)
    lookup.gate.host[True] = 0.2e-3  # cheap bookkeeping: the chain pays again
    assert lookup.chain() == [1, 4, 9]  # (the plain step's token extended the index)


def test_a_chain_step_s_host_work_that_prices_chains_out_is_rechecked():
    """Only a chain step measures a chain step's host work, so an average measured under contention
    (or carried from another request) that prices every chain out would never be corrected: every
    HOST_RECHECK-th chain that pays by its rows alone is verified anyway, its measurement replaces
    the average, and chains pay again. Runs of plain steps count their host-bound chains too, and
    end (could_pay) when the recheck is due."""
    from specextend.lookup_gate import HOST_RECHECK

    line, cycle = _cost(2.34e-3, 0.036e-3), [4, 9, 1]
    lookup = RequestLookup(ContextIndex(cycle * 3 + [4], 16), 3, cost=line)
    lookup.gate.host = {True: 2e-3, False: 0.15e-3}  # a chain step's 2 ms of host work, 0.2 in truth
    last, verified = 4, []
    for _ in range(2 * HOST_RECHECK):
        lookup.gate.hit[3], lookup.gate.run[3] = 1 / 3, 1.0  # gain 0.33: pays by rows, not at 2 ms
        chain = lookup.chain()
        verified.append(bool(chain))
        emitted = chain + [cycle[(cycle.index(chain[-1]) + 1) % 3]] if chain else [cycle[(cycle.index(last) + 1) % 3]]
        lookup.commit(emitted, step_s=line(len(chain) + 1) + (0.2e-3 if chain else 0.15e-3))
        last = emitted[-1]
    assert verified[:HOST_RECHECK] == [False] * (HOST_RECHECK - 1) + [True]  # the recheck
    assert lookup.gate.host[True] == pytest.approx(0.2e-3)  # replaced, not averaged in
    assert all(verified[HOST_RECHECK:])  # the chains pay from then on
    # a run of plain steps (no chain asked) counts the host-bound chains it skips
    run = RequestLookup(ContextIndex(cycle * 3 + [4], 16), 3, cost=line)
    run.gate.host = {True: 2e-3, False: 0.15e-3}
    for n in run.index.ns:
        run.gate.hit[n], run.gate.run[n] = 1 / 3, 1.0
    run.gate.alpha = 0.0  # (the rates as set: the run teaches them nothing here)
    assert not run.could_pay()
    run.commit_run([9, 1, 4] * 5)  # 15 chains skipped
    assert run.could_pay() and run.chain() == [9, 1, 4]  # the run ends, and the next step rechecks


def test_rechecks_that_still_price_chains_out_back_off_and_are_carried():
    """A recheck whose measurement still prices the chains out (their host work is really that
    slow: a chain step on the CPU costs 2.5 plain ones) doubles the interval to the next, carried to
    the next request's gate; one that lets them pay brings it back to HOST_RECHECK."""
    from specextend.lookup_gate import HOST_RECHECK

    line, cycle = _cost(2.34e-3, 0.036e-3), [4, 9, 1]

    def steps(lookup, n, chain_host_s):
        verified, last = [], 4
        for _ in range(n):
            lookup.gate.hit[3], lookup.gate.run[3] = 1 / 3, 1.0  # pays by rows, not at 2 ms of host work
            chain = lookup.chain()
            verified.append(bool(chain))
            nxt = cycle[(cycle.index(chain[-1] if chain else last) + 1) % 3]
            emitted = chain + [nxt]
            lookup.commit(emitted, step_s=line(len(chain) + 1) + (chain_host_s if chain else 0.15e-3))
            last = emitted[-1]
        return [i for i, v in enumerate(verified) if v]

    lookup = RequestLookup(ContextIndex(cycle * 3 + [4], 16), 3, cost=line)
    lookup.gate.host = {True: 2e-3, False: 0.15e-3}
    assert steps(lookup, 3 * HOST_RECHECK + 2, 2e-3) == [HOST_RECHECK - 1, 3 * HOST_RECHECK - 1]  # 16, then 32 later
    assert lookup.gate.recheck_every == 4 * HOST_RECHECK
    nxt = RequestLookup(ContextIndex(cycle * 3 + [4], 16), 3, cost=line, gate=lookup.gate.carried())
    assert nxt.gate.recheck_every == 4 * HOST_RECHECK  # carried: no recheck in the next request's first 64
    assert steps(nxt, 4 * HOST_RECHECK - 1, 2e-3) == []
    assert steps(nxt, 1, 0.2e-3) == [0] and nxt.gate.recheck_every == HOST_RECHECK  # the chains pay again


def test_a_request_s_lookup_skips_chains_that_do_not_pay_and_still_learns_from_them():
    ids = [4, 9, 1, 4]  # the last token repeats: a unigram chain [9, 1, 4]
    lookup = RequestLookup(ContextIndex(ids, 16), 3, cost=_cost(1.0, 1.0))  # rows cost as much as a forward
    assert lookup.chain() == []  # (1 + prior gain 1.0) * cost(1) = 4 < cost(4) = 5: decode plainly
    lookup.commit([9])  # the plain token was the chain's first: a hit for order 1
    assert lookup.gate.hit[1] > lookup.gate.hit_prior and lookup.index.length == 5
    free = RequestLookup(ContextIndex(ids, 16), 3)  # no cost line: every chain
    assert free.chain() == [9, 1, 4]
    free.commit([9, 1, 4, 7])
    assert free.gate.run[1] > free.gate.run_prior and free.index.ids[:8].tolist() == ids + [9, 1, 4, 7]
    # grafted onto a tree: the chain's new nodes are priced; those the tree has cost nothing
    tree = RequestLookup(ContextIndex(ids, 16), 3, cost=_cost(1.0, 1.0))
    assert tree.graft([9, 1, 4], [-1, 0, 1]) == ([9, 1, 4], [-1, 0, 1], 0)
    tree.commit([9, 1, 4, 2])  # the tree's nodes proposed the chain too: still the chain's three tokens
    assert tree.gate.hit[1] > tree.gate.hit_prior and tree.gate.run[1] > tree.gate.run_prior
    assert tree.graft([5], [-1]) == ([5], [-1], 0)  # 4 -> [9, 1, 4, 2]: three new rows do not pay here
    assert RequestLookup(ContextIndex(ids, 16), 3).graft([5], [-1]) == ([5, 9, 1, 4], [-1, -1, 1, 2], 3)


def test_vocabulary_too_wide_for_a_key_drops_that_n():
    idx = ContextIndex([1, 2, 3, 1, 2, 3], 1 << 40, ns=(3, 2))  # 40-bit ids: one per key at most
    assert idx.ns == ()
    assert idx.continuation(2) == []


def _paths(tokens, parents):
    """Every root-to-node token path of a tree."""
    out = []
    for i in range(len(tokens)):
        path, j = [], i
        while j != -1:
            path.append(tokens[j])
            j = parents[j]
        out.append(tuple(reversed(path)))
    return out


@pytest.mark.parametrize("seed", range(30))
def test_graft_keeps_the_tree_and_adds_the_chain_as_a_path(seed):
    rng = random.Random(seed)
    n = rng.randrange(0, 12)
    tokens, parents = [], []
    for _ in range(n):  # siblings carry distinct tokens, as a draft's do
        parent = rng.randrange(-1, len(tokens))
        free = sorted(set(range(4)) - {t for t, q in zip(tokens, parents) if q == parent})
        if free:
            parents.append(parent)
            tokens.append(rng.choice(free))
    n = len(tokens)
    chain = [rng.randrange(4) for _ in range(rng.randrange(0, 7))]
    t2, p2, new = graft(tokens, parents, chain)
    assert t2[:n] == tokens and p2[:n] == parents  # the draft's nodes keep their indices
    assert len(t2) == n + new
    assert all(p < i for i, p in enumerate(p2))  # parents first: a topological order
    assert tuple(chain) in _paths(t2, p2) or not chain  # the whole chain is a path from the root
    old = set(_paths(tokens, parents))
    assert new == sum(1 for path in _paths(t2, p2)[n:] if path not in old)  # new nodes: new paths only
    kids = children_of(p2)
    for row, ks in enumerate(kids):  # where the chain met the tree it did not add a second child
        seen = [t2[c] for c in ks]
        if row > n:
            assert len(set(seen)) == len(seen)


def test_graft_follows_the_tree_where_it_agrees():
    tokens, parents = [5, 6, 7, 8], [-1, -1, 0, 2]  # 5 -> 7 -> 8, and 6
    t, p, new = graft(tokens, parents, [5, 7, 9, 10])
    assert (t, p, new) == ([5, 6, 7, 8, 9, 10], [-1, -1, 0, 2, 2, 4], 2)
    assert graft(tokens, parents, [5, 7, 8]) == (tokens, parents, 0)
    assert graft([], [], [3, 4]) == ([3, 4], [-1, 0], 2)


def test_index_of_a_long_prompt_equals_its_twin():
    """A prompt (or a catch-up) of many tokens fills the dicts in one update; later tokens one by one."""
    rng = random.Random(7)
    ids = [rng.randrange(20) for _ in range(500)]
    idx = ContextIndex(ids[:300], 151936)
    idx.extend(ids[300:450])  # many at once
    for t in ids[450:]:
        assert idx.match(6) == idx.match_vectorised(6) and idx.match(6)[0] > 0
        idx.extend([t])


@pytest.mark.parametrize("seed", range(12))
def test_extend_matching_equals_match_then_extend_per_token(seed):
    """ContextIndex.extend_matching (a run's tokens, keys rolled in Python ints) answers, before
    each token, what match() answers (its order, the continuation's first token) and leaves the
    index as extend([t]) per token does: ids, keys, latest-start dicts; from an empty or short
    context too (fewer tokens than an order)."""
    rng = random.Random(seed)
    vocab = rng.choice([5, 50, 151936])
    ids = [rng.randrange(min(vocab, 6)) for _ in range(rng.randrange(0, 12))]
    fast, slow = ContextIndex(ids, vocab, capacity=4), ContextIndex(ids, vocab, capacity=4)
    firsts = []
    for i in range(12):
        new = [rng.randrange(min(vocab, 6)) for _ in range(rng.randrange(1, 12))]
        k = [0, 1, 4][i % 3]
        want = []
        for t in new:
            n, chain = slow.match(k)
            want.append((n, chain[0] if chain else None))
            slow.extend([t])
        assert fast.extend_matching(new, k) == want
        n = fast.length
        assert n == slow.length and fast.ids[:n].tolist() == slow.ids[:n].tolist()
        assert all(fast.keys[o][:n].tolist() == slow.keys[o][:n].tolist() for o in fast.ns)
        assert fast.latest == slow.latest
        firsts += [f for _, f in want]
    assert any(f is not None for f in firsts)  # (matches were found)


def test_a_run_teaches_the_gate_as_plain_steps_that_skip_their_chains_do():
    """RequestLookup.commit_run (a run of plain steps ahead): the index and the gate's hit rates
    end as after one plain step per token whose chain the gate skipped (chain(), then commit)."""
    rng = random.Random(3)
    prompt = [rng.randrange(6) for _ in range(60)]  # a small vocabulary: chains everywhere, some hit
    tokens = [rng.randrange(6) for _ in range(40)]

    class Skip(LookupGate):
        def use(self, *a, **k):
            return False

    run, steps = (RequestLookup(ContextIndex(prompt, 6), 4, cost=lambda rows: 1e-3, gate=Skip()) for _ in range(2))
    run.commit_run(tokens)
    for tok in tokens:
        assert steps.chain() == []  # skipped: a plain step
        steps.commit([tok])
    assert run.gate.hit == steps.gate.hit and run.gate.hit
    assert (run.skipped, run._host_skips) == (steps.skipped, steps._host_skips) and run.skipped
    assert run.index.ids[:run.index.length].tolist() == steps.index.ids[:steps.index.length].tolist() == prompt + tokens
    assert not run.priced  # (a run measures no host work)


def test_could_pay_asks_the_gate_for_a_chain_as_long_as_those_it_verifies():
    """RequestLookup.could_pay (runs of plain steps forgo chains only where none would be verified):
    a chain of max_tokens nodes of some order worth its rows by the gate's rates, whether or not one
    is found here. With a GPU-like line (a row 1.5% of a forward) and weak chains (gain 0.1), a
    one-node chain would pay and the chains the lookup finds, of 8 nodes, do not: no run was taken
    and no chain verified (the trap the one-node question set)."""
    line = _cost(2.34e-3, 0.036e-3)
    look = RequestLookup(ContextIndex([1, 2, 3], 8), 8, cost=line)  # (no chain here)
    assert look.could_pay()  # the prior: half of the chains hit, 2 tokens each -> gain 1
    for n in look.index.ns:
        look.gate.hit[n], look.gate.run[n] = 0.1, 1.0  # gain 0.1
    assert look.gate.use(1, 1, line, alone=True) and not look.gate.use(1, 8, line, alone=True)
    assert not look.could_pay()  # (8-node chains do not pay: a run forgoes nothing chain() would take)
    look.gate.hit[look.index.ns[-1]] = 0.9  # one order whose chains pay
    assert look.could_pay()


def test_a_chain_teaches_the_gate_what_it_would_have_given_alone():
    """chain_run: the chain's leading tokens the step emitted. On a tree step the draft's nodes may
    have proposed them too: the gate learns the chain's own worth (what a step without a tree would
    verify), not only what it added beyond the tree, so a good draft's request does not teach the
    next one's plain steps that chains never hit."""
    from specextend.lookup import chain_run

    assert chain_run([9, 1, 4], [9, 1, 4, 2]) == 3 and chain_run([9, 1, 4], [9, 1]) == 2
    assert chain_run([9, 1, 4], [9, 5, 4, 2]) == 1 and chain_run([9, 1, 4], [5]) == 0 and chain_run([], [5]) == 0
    ids = [4, 9, 1, 4]
    lookup = RequestLookup(ContextIndex(ids, 16), 3)  # no cost line: every chain is verified
    for _ in range(20):  # tree steps whose draft proposed the chain's tokens as well, every time
        lookup.index = ContextIndex(ids, 16)
        tokens, parents, new = lookup.graft([9, 1, 4], [-1, 0, 1])
        assert new == 0 and tokens == [9, 1, 4]
        lookup.commit([9, 1, 4, 2])
    assert lookup.gate.hit[1] > 0.9 and lookup.gate.run[1] > 2.8  # right every time, three tokens (was 0.5, 2)
    lookup.index = ContextIndex(ids, 16)
    assert lookup.peek() == (3, pytest.approx(lookup.gate.gain(1)))  # a plain step would verify it
