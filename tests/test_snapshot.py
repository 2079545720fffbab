"""Pool snapshots (docs/architecture.md, "Pool snapshots"): every step's tokens go to the overlapping
draft at once, each answer is the best nodes of its pool, and a tree step walks the latest one to
its own position instead of calling the draft. The walk against its scan twin, the feed's
one-call-at-a-time order, and the engine lossless (float64: exactly) with trees taken from
snapshots, every token sent once and in order, the close after the last call, and a failing call
leaving plain decoding."""

from __future__ import annotations

import random
import time
from concurrent.futures import Future

import pytest

from specextend.config import SamplingParams
from specextend.draft.base import DraftBackend, DraftError, DraftTree
from specextend.draft.worker import DraftWorker
from specextend.ladder import ladder
from specextend.snapshot import GIVE_UP_TREES, MIN_TREES, PROBE_EVERY, SNAPSHOT_BOUND, DraftFeed, SnapshotChoice, subtree_at, subtree_at_scan

from test_told import Recorder, Runs, TreesOnly, assert_calls_in_order, engine_for, prompt, recorded_run


def best_first_tree(rng, m, vocab=6):
    """A random tree in best-first order: each node's parent comes before it, siblings distinct."""
    tokens, parents = [], []
    for i in range(m):
        p = rng.randrange(-1, i) if i else -1
        used = {tokens[j] for j in range(i) if parents[j] == p}
        free = [t for t in range(vocab) if t not in used]
        if not free:
            p, free = -1, [t for t in range(vocab, 2 * vocab) if t not in {tokens[j] for j in range(i) if parents[j] == -1}]
        tokens.append(rng.choice(free))
        parents.append(p)
    return tokens, parents


def test_the_walk_and_the_subtree_match_the_scan_twin():
    rng = random.Random(0)
    hits = 0
    for _ in range(400):
        tokens, parents = best_first_tree(rng, rng.randrange(0, 40))
        path = [rng.randrange(0, 8) for _ in range(rng.randrange(0, 4))]
        if tokens and rng.random() < 0.6:  # a path that exists: some node's chain of tokens
            i = rng.randrange(len(tokens))
            path = []
            while i >= 0:
                path.append(tokens[i])
                i = parents[i]
            path = path[::-1][:rng.randrange(0, len(path) + 1)]
        n = rng.randrange(1, 12)
        got = subtree_at(tokens, parents, path, n)
        assert got == subtree_at_scan(tokens, parents, path, n)
        if got is not None:
            hits += 1
            t, p = got
            assert len(t) <= n and all(-1 <= q < k for k, q in enumerate(p))  # a tree, parents first
    assert hits > 100


def test_the_subtree_keeps_the_snapshots_order_below_the_walks_end():
    tokens = [5, 6, 7, 8, 9, 4]  # 5 -> (7, 8 -> 4), 6 -> 9
    parents = [-1, -1, 0, 0, 1, 3]
    assert subtree_at(tokens, parents, [], 3) == ([5, 6, 7], [-1, -1, 0])  # at the root: the first n
    assert subtree_at(tokens, parents, [5], 9) == ([7, 8, 4], [-1, -1, 1])
    assert subtree_at(tokens, parents, [5, 8], 9) == ([4], [-1])
    assert subtree_at(tokens, parents, [5, 7], 9) is None  # nothing below
    assert subtree_at(tokens, parents, [6, 1], 9) is None  # the walk leaves the snapshot


class Calls:
    def __init__(self):
        self.sent, self.futures = [], []

    def __call__(self, n, tokens, retrieval):
        self.sent.append((n, list(tokens), retrieval))
        fut = Future()
        self.futures.append(fut)
        return fut


def test_the_feed_sends_one_call_at_a_time_and_walks_its_latest_answer():
    calls = Calls()
    feed = DraftFeed(calls, length=10)
    feed.commit([1], retrieval="r0")
    assert feed.send() is not None and calls.sent == [(0, [1], "r0")]
    assert feed.current() is calls.futures[0]
    feed.commit([2, 3])
    assert feed.send() is None and feed.current() is None  # in flight: the tokens wait
    assert feed.tree(4) is None  # no answer yet
    calls.futures[0].set_result(DraftTree(0, (2, 9, 3), (-1, -1, 0)))  # rooted after token 1
    assert feed.tree(4) is None  # walked along 2, 3: nothing below 3
    feed.send()
    assert calls.sent[1] == (1, [2, 3], None)
    calls.futures[1].set_result(DraftTree(1, (4, 5, 6), (-1, 0, 1)))
    assert feed.tree(2) == ([4, 5], [-1, 0])  # rooted here: its first nodes
    feed.commit([4])
    assert feed.tree(5) == ([5, 6], [-1, 0])  # one token past it: the walk
    feed.send()
    calls.futures[2].set_exception(DraftError("gone"))
    assert feed.tree(5) is None and isinstance(feed.error, DraftError)
    feed.commit([7])
    assert feed.send() is None and len(calls.sent) == 3  # nothing after a failure


@pytest.mark.parametrize("sampling", [False, True])
@pytest.mark.parametrize("lookup", [0, 8])
@pytest.mark.parametrize("policy", [Runs, TreesOnly])
def test_snapshot_trees_are_lossless_and_every_token_reaches_the_draft_once_in_order(pair, sampling, lookup, policy):
    params = SamplingParams(40, ignore_eos=True, temperature=0.8 if sampling else 0.0, seed=7)
    # the background grows the pool meanwhile
    ref, out, stats, draft = recorded_run(pair, policy, params, 0.004, lookup_tokens=lookup, draft_snapshots=True)
    assert out == ref
    assert stats.num_steps + stats.unready_steps > 0  # trees asked
    # one call at a time, every token sent once and in order, but those committed while the last call
    # was in flight (a loaded host's calls may outlast many steps: no bound on how many)
    assert_calls_in_order(draft, out, unsent=len(out) - 1)
    assert all(b == SNAPSHOT_BOUND for _, _, b in draft.calls)


class Oracle(DraftBackend):
    """Knows the target's greedy answer: each snapshot is its next `depth` tokens as a path, with a
    wrong sibling at every level, so that the target's next verdicts walk it."""

    def __init__(self, answer, prompt_len, depth=12, delay_s=0.002):
        self.answer, self.prompt_len, self.depth, self.delay_s = answer, prompt_len, depth, delay_s
        self.seen = {}
        self.calls = []
        self.bounds = []  # each call's TreeBound

    def open(self, session_id, prompt_ids, params):
        self.seen[session_id] = len(prompt_ids)

    def step(self, session_id, step, accepted_tokens, retrieval=None, bound=None):
        time.sleep(self.delay_s)
        self.calls.append((step, tuple(accepted_tokens)))
        self.bounds.append(bound)
        self.seen[session_id] += len(accepted_tokens)
        i = self.seen[session_id] - self.prompt_len  # the answer's tokens the target has committed
        nxt = self.answer[i:i + self.depth]
        tokens, parents = [], []
        for k, tok in enumerate(nxt):
            parent = 2 * k - 2 if k else -1  # the path's previous node
            tokens += [tok, (tok + 1) % 256]  # the right token, then a wrong sibling
            parents += [parent, parent]
        return DraftTree(step, tuple(self.wrong(tokens)), tuple(parents), ready=True)

    def wrong(self, tokens):
        return tokens

    def close(self, session_id):
        self.seen.pop(session_id, None)


class Misleading(Oracle):
    """Its paths never hold the target's next token, and it answers after the target's next step
    (slower than a CPU step of the tiny pair): no snapshot is walked past a verdict, every tree waits."""

    def __init__(self, answer, prompt_len, depth=12):
        super().__init__(answer, prompt_len, depth, delay_s=0.03)

    def wrong(self, tokens):
        return [(t + 2) % 256 for t in tokens]


def test_a_tree_step_walks_the_latest_snapshot_without_a_call(pair):
    """With a draft whose snapshots hold the target's next tokens, most tree steps take their tree
    from a snapshot walked past the verdicts it has not answered yet: no wait, and lossless."""
    from helpers import make_engine

    params = SamplingParams(48, ignore_eos=True)
    ref, _, _ = make_engine(pair, "ar").generate(prompt(), params)
    draft = Oracle(ref, len(prompt()))
    engine = engine_for(pair, draft, draft_snapshots=True)
    engine.new_controller = lambda tree: TreesOnly(ladder(tree))
    out, _, stats = engine.generate(prompt(), params)
    assert out == ref
    assert stats.snapshot_trees > stats.asked_steps and stats.snapshot_trees >= 3
    assert stats.mean_acceptance_length > 2  # the walked trees hold the answer's next tokens
    sent = [t for _, tokens in draft.calls for t in tokens]  # (the last verdict's tokens past the
    assert sent[:len(out)] == out[:len(sent)]  # request's end may go too: committed, not emitted)
    assert [s for s, _ in draft.calls] == list(range(len(draft.calls)))


def test_a_draft_failing_on_a_snapshot_call_leaves_plain_decoding(pair):
    from helpers import make_engine

    params = SamplingParams(30, ignore_eos=True)
    ref, _, _ = make_engine(pair, "ar").generate(prompt(), params)
    worker = DraftWorker(pair[1].decoder, overlap=True)
    draft = Recorder(worker, fail_at=2)
    engine = engine_for(pair, draft, draft_snapshots=True)
    engine.new_controller = lambda tree: TreesOnly(ladder(tree))
    out, _, stats = engine.generate(prompt(), params)
    worker.shutdown()
    assert out == ref and stats.fallback
    assert max(s for s, _, _ in draft.calls) <= 2  # nothing sent after the failure surfaced


def test_the_snapshot_choice_keeps_what_held_and_probes_after_a_miss():
    from types import SimpleNamespace

    def ended(trees, walked):  # a request's RequestStats, as far as the choice reads them
        return SimpleNamespace(num_steps=trees - 1, unready_steps=1, snapshot_trees=walked)

    assert SnapshotChoice("on").use() and not SnapshotChoice("off").use()
    off = SnapshotChoice("off")
    off.record(ended(100, 100))  # a fixed setting learns nothing
    assert not off.use()
    with pytest.raises(ValueError):
        SnapshotChoice("sometimes")
    c = SnapshotChoice("auto")
    assert c.use()  # starts on
    c.record(ended(MIN_TREES - 1, 0))  # too few trees to decide
    assert c.use()
    c.record(ended(20, 9))  # under half of them walked: off ...
    assert [c.use() for _ in range(2 * PROBE_EVERY)] == ([False] * (PROBE_EVERY - 1) + [True]) * 2  # ... but probed
    c.record(ended(20, 10))  # a probe in which they held: on again
    assert all(c.use() for _ in range(PROBE_EVERY + 1))


@pytest.mark.parametrize("draft_cls, holds", [(Oracle, True), (Misleading, False)])
def test_auto_snapshots_stay_on_where_they_hold_and_give_way_to_early_asks_where_not(pair, draft_cls, holds):
    """draft_snapshots=auto (the default): the first request walks snapshots; one where under half
    of the trees came from them makes the next request ask early instead. Lossless either way."""
    from helpers import make_engine

    params = SamplingParams(64, ignore_eos=True)
    ref, _, _ = make_engine(pair, "ar").generate(prompt(), params)
    draft = draft_cls(ref, len(prompt()), depth=64)  # (deep: a snapshot verdicts old still holds the path)
    engine = engine_for(pair, draft, draft_snapshots="auto")
    engine.new_controller = lambda tree: TreesOnly(ladder(tree))
    out1, _, first = engine.generate(prompt(), params)
    calls = len(draft.bounds)
    snapped = [b == SNAPSHOT_BOUND for b in draft.bounds]
    trees = first.num_steps + first.unready_steps  # tree steps (an unready one: no tree at hand)
    assert trees >= (MIN_TREES if holds else GIVE_UP_TREES)  # enough to decide (and to give up within it)
    assert (2 * first.snapshot_trees >= trees) == holds
    if holds:
        assert calls and all(snapped)  # every call a snapshot's
    else:  # given up within the request: snapshot calls, then asks (calls in order, numbered on)
        k = snapped.index(False)
        assert k > 0 and not any(snapped[k:]) and first.asked_steps > 0
        assert [s for s, _ in draft.calls] == list(range(calls))
    out2, _, second = engine.generate(prompt(), params)
    assert out1 == out2 == ref
    assert engine.snapshots.holds == holds
    later = draft.bounds[calls:]
    assert later and all((b == SNAPSHOT_BOUND) == holds for b in later)
    assert (second.snapshot_trees > 0) == holds
    if not holds:
        assert second.asked_steps > 0  # early asks instead


class _OracleSelections(Oracle):
    """Also records each call's retrieval selection."""

    def __init__(self, answer, prompt_len):
        super().__init__(answer, prompt_len, depth=64)
        self.selections = []

    def step(self, session_id, step, accepted_tokens, retrieval=None, bound=None):
        self.selections.append(retrieval)
        return super().step(session_id, step, accepted_tokens, retrieval, bound)


@pytest.mark.parametrize("policy", [TreesOnly, Runs])
def test_with_snapshots_a_selection_goes_with_the_verdict_after_the_one_it_was_made_at(pair, policy, monkeypatch):
    """A retrieval selection made at a verdict is scored in the next forward's shadow and sent with
    the verdict after it (or a later one: a newer selection supersedes one not yet sent while a
    call is in flight), not launched on its own verdict's path; each sent once, in the order made
    (docs/architecture.md, "Pool snapshots")."""
    from helpers import make_engine
    from specextend.config import RetrievalConfig
    from specextend.target import TargetSession

    events = []  # ("made", selection) at each verdict, ("push", selection) for each verdict's push
    made, push = TargetSession.timed_selection, DraftFeed.push
    monkeypatch.setattr(TargetSession, "timed_selection",
                        lambda self, *a: (lambda r: events.append(("made", r)) or r)(made(self, *a)))
    monkeypatch.setattr(DraftFeed, "push",
                        lambda self, tokens, retrieval=None, send=True: events.append(("push", retrieval))
                        or push(self, tokens, retrieval, send))
    params = SamplingParams(40, ignore_eos=True)
    ref, _, _ = make_engine(pair, "ar").generate(prompt(), params)
    draft = _OracleSelections(ref, len(prompt()))
    engine = engine_for(pair, draft, draft_snapshots="on", retrieval=RetrievalConfig(chunk_size=8, top_k=6, every=1))
    engine.new_controller = lambda tree: policy(ladder(tree))
    out, _, stats = engine.generate(prompt(), params)
    assert out == ref and stats.snapshot_trees > 3 and stats.retrieval_refreshes > 3
    order = [r for kind, r in events if kind == "made" and r is not None]
    pushed = [r for kind, r in events if kind == "push" and r is not None]
    assert pushed == order[1:len(pushed) + 1] and len(pushed) >= len(order) - 2  # each handed to the feed
    # once, in order, by the next push whatever its step (the prefill's went with the feed's start)
    for (k0, made_here), (k1, r) in zip(events, events[1:]):
        if k0 == "made" and k1 == "push":  # a verdict's own push
            assert r is None or r is not made_here  # never the selection made at this very verdict
    sent = [r for r in draft.selections if r is not None]
    assert sent[0] is order[0]  # the prefill's with the first call (later ones: newer supersede older in flight)
    assert all(order.index(a) < order.index(b) for a, b in zip(sent, sent[1:]))  # in order, each once


@pytest.mark.parametrize("retrieval_every", [1, 4])
def test_a_request_that_gives_snapshots_up_midway_stays_lossless_when_sampling(pair, retrieval_every):
    """The hand-over from snapshots to early asks within a request (DraftFeed.handover): sampled
    output equal to `ar`'s with the same seed, the calls numbered on in order."""
    from helpers import make_engine
    from specextend.config import RetrievalConfig

    params = SamplingParams(64, ignore_eos=True, temperature=0.8, seed=11)
    ref, _, _ = make_engine(pair, "ar").generate(prompt(), params)
    draft = Misleading(ref, len(prompt()))
    engine = engine_for(pair, draft, draft_snapshots="auto",
                        retrieval=RetrievalConfig(chunk_size=8, top_k=6, every=retrieval_every))
    engine.new_controller = lambda tree: TreesOnly(ladder(tree))
    out, _, stats = engine.generate(prompt(), params)
    assert out == ref
    snapped = [b == SNAPSHOT_BOUND for b in draft.bounds]
    assert snapped[0] and not snapped[-1] and stats.asked_steps > 0
    assert [s for s, _ in draft.calls] == list(range(len(draft.calls)))
