"""The pool's indexed queries (draft/pool.py: children index, heap frontier, numpy best-n in
tree.py) against their slow twins, plain scans over the node lists, on random pools grown and
re-rooted the way overlapped drafting does."""

import random

import pytest
import torch

from specextend.draft.pool import Pool
from specextend.tree import select_best_nodes


def frontier_scan(pool, rows, max_depth):
    todo = [i for i, s in enumerate(pool.slots) if s < 0 and pool.depths[i] < max_depth]
    todo.sort(key=lambda i: (-pool.scores[i], pool.depths[i], i))
    return todo[:rows]


def walk_scan(pool, tokens):
    out, node = [], -1
    for tok in tokens:
        nxt = None
        if node is not None:
            nxt = next((i for i, p in enumerate(pool.parents) if p == node and pool.tokens[i] == tok), None)
        out.append(nxt)
        node = nxt
    return out


def reroot_scan(pool, path):
    root = path[-1]
    keep, new = {root: -1}, Pool()
    for i in range(root + 1, len(pool.tokens)):
        p = pool.parents[i]
        if p in keep and (p == root or pool.slots[p] >= 0):
            keep[i] = len(new.tokens)
            new.tokens.append(pool.tokens[i])
            new.scores.append(pool.scores[i] - pool.scores[root])
            new.parents.append(keep[p])
            new.depths.append(pool.depths[i] - pool.depths[root])
            new.slots.append(-1)
    old_ids = sorted((i for i in keep if i != root and pool.slots[i] >= 0), key=lambda i: pool.slots[i])
    staged = []
    for slot, old in enumerate(old_ids):
        new.slots[keep[old]] = slot
        staged.append(pool.slots[old])
    new.staged = len(staged)
    return new, [pool.slots[i] for i in path], staged, keep


def best_scan(scores, depths, n):
    return sorted(range(len(scores)), key=lambda i: (-scores[i], depths[i], i))[:n]


def fields(pool):
    return pool.tokens, pool.scores, pool.parents, pool.depths, pool.slots, pool.staged


@pytest.mark.parametrize("seed", range(6))
def test_indexed_queries_equal_their_scans_on_grown_and_rerooted_pools(seed):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    w = 8
    # scores rounded to a few values so that ties (broken by depth, then id) really occur
    logp = lambda f: -torch.randint(0, 6, (f, w), generator=gen).double() / 4  # noqa: E731

    def fresh():
        return Pool(list(range(w)), sorted(logp(1)[0].tolist(), reverse=True), [-1] * w, [1] * w, [-1] * w, 0)

    pool = fresh()
    checked = 0
    for step in range(60):
        if not pool.frontier(1, 12):
            pool = fresh()
        nodes = pool.frontier(rng.choice([1, 4, 8]), 12)
        assert nodes == frontier_scan(pool, len(nodes) if nodes else 8, 12)
        if nodes:
            pool.mark_forwarded(nodes, pool.staged, len(nodes))
            pool.add_children(nodes, torch.randint(0, 50, (len(nodes), w), generator=gen), logp(len(nodes)))
        for rows in (1, 8, 64):
            assert pool.frontier(rows, 5) == frontier_scan(pool, rows, 5)
        for n in (1, 16, 200):
            assert select_best_nodes(pool.scores, pool.depths, pool.parents, n) == best_scan(pool.scores, pool.depths, n)
        fwd = [i for i in range(len(pool)) if pool.slots[i] >= 0]
        if fwd and rng.random() < 0.3:  # a verdict along a forwarded path, then its bonus (a child)
            node = rng.choice(fwd)
            path = pool.ancestors(node)
            kids = pool.children(node)
            assert kids == [i for i, p in enumerate(pool.parents) if p == node]
            if kids:  # the bonus token: a forwarded child where there is one (a deeper pool kept)
                path.append(rng.choice([k for k in kids if pool.slots[k] >= 0] or kids))
            toks = [pool.tokens[i] for i in path] + [999]
            assert pool.walk(toks) == walk_scan(pool, toks)
            want = reroot_scan(pool, path)
            got = pool.reroot_ids(path)
            assert fields(got[0]) == fields(want[0]) and got[1:] == want[1:]
            pool = got[0]
            assert pool.frontier(8, 12) == frontier_scan(pool, 8, 12)
            checked += 1
        if rng.random() < 0.1:
            slots = list(pool.slots)
            order = pool.unstage()
            assert order == sorted((i for i, s in enumerate(slots) if s >= 0), key=lambda i: slots[i])
            assert pool.frontier(8, 12) == frontier_scan(pool, 8, 12)
    assert checked > 3


@pytest.mark.parametrize("seed", range(4))
def test_outcome_trees_equal_reroot_then_best_tree(seed):
    """Each prepared outcome (overlap's next tree for a likely verdict, built by a heap from its new
    root) equals the re-root at that verdict followed by best_tree; the verdicts are the forwarded
    nodes whose children joined the pool, likeliest first (ties by depth, then id)."""
    gen = torch.Generator().manual_seed(seed)
    w = 6
    logp = lambda f: -torch.randint(0, 6, (f, w), generator=gen).double() / 4  # noqa: E731
    pool = Pool(list(range(w)), sorted(logp(1)[0].tolist(), reverse=True), [-1] * w, [1] * w, [-1] * w, 0)
    for _ in range(12):
        nodes = pool.frontier(4, 12)
        pool.mark_forwarded(nodes, pool.staged, len(nodes))
        if len(nodes) > 1:  # the last one in flight: forwarded, its children not yet in the pool
            pool.add_children(nodes[:-1], torch.randint(0, 50, (len(nodes) - 1, w), generator=gen), logp(len(nodes) - 1))
    ready = sorted((i for i in range(len(pool)) if pool.slots[i] >= 0 and pool.children(i)),
                   key=lambda i: (-pool.scores[i], pool.depths[i], i))
    for m, n in ((1, 4), (8, 16), (100, 40)):
        got = pool.outcome_trees(m, n)
        assert len(got) == min(m, len(ready))
        for b, (verdict, tokens, parents) in zip(ready, got):
            path = pool.ancestors(b)
            assert verdict == tuple(pool.tokens[i] for i in path)
            new = pool.reroot(path)[0]
            assert (tokens, parents) == tuple(new.best_tree(n)) and tokens
