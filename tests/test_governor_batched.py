"""The batch's governor (governor.py) through the batcher and real sessions: held rounds that take
no tree (or only trees), joiners of a batch held plain that open no draft, while every output equals
its solo run (float64). The governor's own measurements: tests/test_governor.py."""

import time

import torch

from specextend.config import SamplingParams, TreeConfig
from specextend.governor import FREE, PLAIN, TREES, Governor
from specextend.models.batch import forward_batch
from specextend.serving.metrics import ReplicaMetrics

from helpers import make_engine
from test_batch import run_batched


class Verdict(Governor):
    """A governor whose measurements always find `wins` best: each round reports tokens only in it
    (measured or held)."""

    wins = PLAIN

    def round_end(self, sessions, tokens, steady, now=None, **kw):
        super().round_end(sessions, 100 if self.regime() == self.wins else 1, steady, now, **kw)


class TreesWin(Verdict):
    wins = TREES


def _requests(n=4, tokens=48):
    gen = torch.Generator().manual_seed(3)
    return [(torch.randint(0, 256, (12,), generator=gen).tolist(), SamplingParams(max_new_tokens=tokens, ignore_eos=True),
             {}) for _ in range(n)]


def test_rounds_held_plain_take_no_tree_and_every_output_equals_its_solo_run(pair):
    """Through the batcher (its forwards made 20 ms slow, so that trees pay and free sessions take
    them) with a governor that finds plain steps best: once it has measured, the sessions decode
    plainly, every output still equals its solo run (float64), and the replica's metrics count the
    held rounds; without a governor the same sessions take a tree nearly every step."""
    target = pair[0]  # (the target as its own draft: every tree accepted whole)
    spec = lambda: make_engine((target, target), "sd", tree=TreeConfig(4, 4, 1), prefill_chunk=64,  # noqa: E731
                               tree_policy="adaptive")  # (a new engine each time: no costs carried)
    reqs = _requests(tokens=96)  # (long enough that the held rounds outnumber the measurement's)
    alone = [make_engine(pair, "ar").generate(p, params)[0] for p, params, _ in reqs]
    slow = lambda model, calls: time.sleep(0.02) or forward_batch(model, calls)  # noqa: E731
    free, _ = run_batched(spec(), reqs, max_batch=4, forward=slow)
    assert [tokens for tokens, _, _ in free] == alone
    gov, metrics = Verdict(window=2, hold=1000), ReplicaMetrics(use_ray=False)
    held, b = run_batched(spec(), reqs, max_batch=4, forward=slow, governor=gov, on_held=metrics.record_held_round)
    assert [tokens for tokens, _, _ in held] == alone
    assert gov.verdicts[4].regime == PLAIN and b.held_rounds[PLAIN] > 8
    text = metrics.exposition()
    assert f'specextend_rounds_held_total{{regime="plain"}} {float(b.held_rounds[PLAIN])}' in text
    trees = lambda got: sum(s.num_steps for _, _, s in got)  # noqa: E731
    assert trees(free) >= 4 * 16 and trees(held) <= trees(free) // 2


def test_sessions_that_end_too_soon_for_a_verdict_to_pay_are_not_measured(pair):
    """Requests of 24 tokens (fewer than the governor's `min_life` of 36 rounds): no round is held,
    none measured; each output equals its solo run (float64). Requests of 48 are measured."""
    spec = lambda: make_engine(pair, "sd", tree=TreeConfig(6, 3, 2), prefill_chunk=64,  # noqa: E731
                               tree_policy="adaptive")
    for tokens, measured in ((24, False), (48, True)):
        reqs = _requests(tokens=tokens)
        alone = [make_engine(pair, "ar").generate(p, params)[0] for p, params, _ in reqs]
        gov = TreesWin(window=2, hold=1000)
        got, b = run_batched(spec(), reqs, max_batch=4, governor=gov)
        assert [tokens for tokens, _, _ in got] == alone
        assert (sum(b.held_rounds.values()) > 0) == measured and bool(gov.verdicts) == measured


def test_rounds_held_to_trees_take_them_and_every_output_equals_its_solo_run(pair):
    """The tiny pair's sessions decode plainly on their own (the draft does not pay here); held to
    trees by a governor that finds trees best, they verify a tree at nearly every step, and every
    output still equals its solo run (float64)."""
    spec = lambda: make_engine(pair, "sd", tree=TreeConfig(6, 3, 2), prefill_chunk=64,  # noqa: E731
                               tree_policy="adaptive")
    reqs = _requests(tokens=40)
    alone = [make_engine(pair, "ar").generate(p, params)[0] for p, params, _ in reqs]
    free, _ = run_batched(spec(), reqs, max_batch=4)
    gov = TreesWin(window=2, hold=1000)
    held, b = run_batched(spec(), reqs, max_batch=4, governor=gov)
    assert [tokens for tokens, _, _ in free] == alone and [tokens for tokens, _, _ in held] == alone
    assert gov.verdicts[4].regime == TREES and b.held_rounds[TREES] > 4
    trees = lambda got: sum(s.num_steps for _, _, s in got)  # noqa: E731
    assert trees(held) >= trees(free) + 4 * 4


def test_lookup_sessions_held_plain_verify_no_chain_and_run_ahead_as_ar(tiny_models, monkeypatch):
    """Mode lookup, prompts that repeat themselves and every chain found verified: free, the batched
    sessions verify chains at most steps; held to plain steps by a governor that finds them best,
    they verify none once it has measured, and their steps run ahead as `ar`'s (one session's host
    step would make every round wait for its read); every output equals its solo run (float64)."""
    from specextend.lookup_gate import LookupGate

    monkeypatch.setattr(LookupGate, "use", lambda self, *a, **k: True)
    engine = make_engine(tiny_models("float64"), "lookup", tree_policy="adaptive")
    gen = torch.Generator().manual_seed(5)
    reqs = [((torch.randint(0, 256, (30,), generator=gen).tolist() * 4)[:110],
             SamplingParams(max_new_tokens=72, ignore_eos=True), {}) for _ in range(4)]
    alone = [engine.generate(p, params)[0] for p, params, _ in reqs]
    free, _ = run_batched(engine, reqs, max_batch=4)
    gov = Verdict(window=2, hold=1000)
    held, b = run_batched(engine, reqs, max_batch=4, governor=gov)
    assert [tokens for tokens, _, _ in free] == alone and [tokens for tokens, _, _ in held] == alone
    assert gov.verdicts[4].regime == PLAIN and b.held_rounds[PLAIN] > 8
    chains = lambda got: sum(st.lookup_steps for _, _, st in got)  # noqa: E731
    assert chains(free) >= 4 * 8 and chains(held) <= chains(free) // 2
    assert sum(st.ahead_steps for _, _, st in held) > sum(st.ahead_steps for _, _, st in free)


def test_sessions_that_join_a_batch_held_plain_open_no_draft(tiny_models):
    """Four sessions batched (their drafts opened at once: cold policies take warm-up trees), held to
    plain steps once a governor finds them best; two sessions that join meanwhile never open their
    draft (on one GPU an open is a prefill of the prompt beside the batch's forwards) while the batch
    stays held: not when they start, nor at their first steps, where a cold policy's open is due (both
    happened before). Every output equals its solo run (float64)."""
    from test_deferred_open import CountingWorker

    from specextend.config import EngineConfig
    from specextend.engine import Engine
    from specextend.scheduler import Batcher

    target, draft = tiny_models("float64")
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 256, (20,), generator=gen).tolist() for _ in range(6)]
    lengths = [96] * 4 + [24] * 2  # (the joiners end while the batch is still held)
    plain = Engine(EngineConfig(mode="ar"), target)
    alone = [plain.generate(p, SamplingParams(n, ignore_eos=True))[0] for p, n in zip(prompts, lengths)]
    worker = CountingWorker(draft.decoder)
    engine = Engine(EngineConfig(mode="sd", tree=TreeConfig(6, 3, 2), tree_policy="adaptive"), target, worker)
    gov = Verdict(window=2, hold=1000)
    b = Batcher(engine.target.decoder, 8, governor=gov)
    outs, ends, stats = [[] for _ in prompts], [], {}

    def add(i):
        def sink(item):
            if item is None or isinstance(item, BaseException):
                ends.append(item)
            else:
                outs[i].extend(item.token_ids)
                stats[i] = item.stats
            return True
        load = b.new_load()
        b.add(engine.session(prompts[i], SamplingParams(lengths[i], ignore_eos=True), session_id=f"s{i}",
                             load=load), sink, load)

    for i in range(4):
        add(i)
    while 4 not in gov.verdicts:
        b.run_round()
    assert gov.verdicts[4].regime == PLAIN and sorted(worker.opened) == ["s0", "s1", "s2", "s3"]
    add(4), add(5)
    while len(ends) < len(prompts):
        b.run_round()
    b.shutdown()
    worker.shutdown()
    assert ends == [None] * len(prompts) and outs == alone
    assert sorted(worker.opened) == ["s0", "s1", "s2", "s3"] and gov.verdicts[8].regime == PLAIN
    assert all(stats[i].draft_open_s == 0.0 and stats[i].num_steps == 0 for i in (4, 5))


def test_sessions_that_start_a_batch_whose_trees_lost_open_no_draft(tiny_models):
    """Four cold sessions added at once to a batcher whose governor found trees losing in a smaller
    batch: the batch's first round is held plain already (before, it was free, and each cold policy
    opened its draft at its start), its measurement is a plain window alone, and no session ever opens
    its draft; every output equals its solo run (float64)."""
    from test_deferred_open import CountingWorker

    from specextend.config import EngineConfig
    from specextend.engine import Engine

    target, draft = tiny_models("float64")
    reqs = _requests(tokens=40)
    alone = [make_engine((target, draft), "ar").generate(p, params)[0] for p, params, _ in reqs]
    worker = CountingWorker(draft.decoder)
    engine = Engine(EngineConfig(mode="sd", tree=TreeConfig(6, 3, 2), tree_policy="adaptive"), target, worker)
    gov = Verdict(window=2, hold=1000, trees_lost={2: True})
    got, b = run_batched(engine, reqs, max_batch=4, governor=gov)
    worker.shutdown()
    assert [tokens for tokens, _, _ in got] == alone
    assert gov.verdicts[4].regime == PLAIN and gov.history[-1]["rates"].keys() == {PLAIN}
    assert worker.opened == [] and b.held_rounds[PLAIN] > 0 and FREE not in b.held_rounds
