"""A batched round's waits for draft steps (docs/architecture.md, "Batched steps" and "Adaptive
speculation", under load): what each session is charged for them, and chunk-first rounds, whose
prompt chunks do not wait for a neighbour's draft."""

from __future__ import annotations

import threading
import time

import pytest

from specextend.config import SamplingParams, TreeConfig
from specextend.draft.chaos import Chaos, ChaosDraft
from specextend.draft.worker import DraftWorker
from specextend.models.batch import forward_batch
from specextend.scheduler import Batcher

from helpers import make_engine
from test_batch import _prompt, run_batched


def test_load_wall_takes_the_waits_for_other_sessions_draft_steps():
    from specextend.session_calls import Load

    load = Load()
    load.others_wait_s = 0.03
    t0 = time.perf_counter() - 0.05
    assert 0.015 < load.wall(t0) < 0.05 and load.others_wait_s == 0.0  # taken once
    assert load.wall(time.perf_counter() + 1.0) == 0.0  # never negative


def test_sessions_that_wait_together_for_their_draft_steps_are_each_charged_a_share():
    """Three sessions' draft steps waited for in one round (batched on the draft worker): each
    session's step is priced at a third of the wait (Load.take_shared), the rest kept apart as
    others' wait (Load.wall), as a shared forward's fixed cost is split (docs/architecture.md,
    "Adaptive speculation")."""
    from types import SimpleNamespace

    from specextend.session_calls import Load

    loads = [Load(), Load(), Load()]
    askers = [SimpleNamespace(load=x) for x in loads] + [SimpleNamespace(load=None)]
    Batcher._charge(askers, askers, 0.04)
    assert [x.shared_s for x in loads] == pytest.approx([0.03] * 3)  # four askers: three quarters others'
    assert loads[0].take_shared() == pytest.approx(0.03) and loads[0].take_shared() == 0.0  # taken once
    t0 = time.perf_counter() - 0.05
    assert 0.005 < loads[1].wall(t0) < 0.03 and loads[1].shared_s == 0.0  # a step's wall drops what it did not take


def test_a_round_charges_its_draft_wait_to_the_sessions_that_did_not_ask(tiny_models):
    """Under load a plain session's step shares the round's wait for another session's draft step;
    its Load keeps that wait apart (Load.wall), so that its policy does not see plain steps as
    costly as trees because others speculate (docs/architecture.md, "Adaptive speculation")."""
    from specextend.session_calls import Load

    pair = tiny_models("float64")
    engine = make_engine(pair, "sd", draft_backend=ChaosDraft(DraftWorker(pair[1].decoder), Chaos(latency_s=0.02)))
    asker, plain = Load(), Load()
    taken = []  # what the asking session's steps took: its own waits are not others'
    wall = asker.wall
    asker.wall = lambda t0: taken.append(asker.others_wait_s) or wall(t0)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    got, _ = run_batched(engine, [(_prompt(30, 1), params, {"load": asker}),
                                  (_prompt(30, 2), params, {"load": plain, "speculate": False})])
    trees = got[0][2].num_steps
    assert trees >= 2
    assert plain.others_wait_s >= 0.9 * 0.02 * trees  # (never taken: a plain request records no steps)
    assert taken and max(taken) < 0.01


class ChunkGatedSteps(ChaosDraft):
    """Once armed, each step waits (up to `patience_s`) for a prompt chunk's forward to start, and
    records whether one did."""

    def __init__(self, inner, chunk_ran: threading.Event, patience_s: float = 3.0):
        super().__init__(inner, Chaos())
        self.chunk_ran, self.patience_s = chunk_ran, patience_s
        self.armed, self.saw_chunk = False, []
        self.stepped = threading.Event()  # an armed step is done

    def step(self, session_id, step, accepted_tokens, retrieval=None, bound=None):
        armed = self.armed
        if armed:
            self.saw_chunk.append(self.chunk_ran.wait(self.patience_s))
        tree = super().step(session_id, step, accepted_tokens, retrieval, bound)
        if armed:
            self.stepped.set()
        return tree


def test_a_prompt_chunk_runs_while_the_rounds_draft_steps_do(tiny_models):
    """A round that carries a waiting prompt chunk issues that forward before it waits for its draft
    steps, whose verifications follow in a forward of their own: a session's prefill does not wait
    for a neighbour's draft, and the drafting session's output stays its solo one
    (docs/architecture.md, "Batched steps")."""
    pair = tiny_models("float64")
    chunk_ran = threading.Event()
    draft = ChunkGatedSteps(DraftWorker(pair[1].decoder), chunk_ran)
    engine = make_engine(pair, "sd", draft_backend=draft, tree=TreeConfig(12, 4, 3), prefill_chunk=16)
    ar = make_engine(pair, "ar", prefill_chunk=16)
    chunk_rows = []

    def forward(model, calls):
        if any(c.prompt for c in calls):
            chunk_rows.append(sum(c.ids.shape[0] for c in calls if c.prompt))
            armed, draft.armed = draft.armed, sum(chunk_rows) < 80  # (b's last chunk: a's later steps wait for none)
            chunk_ran.set()
            if armed:  # the step ends within this forward: the round then waits for no step of its own
                draft.stepped.wait(3.0)
                draft.stepped.clear()
                time.sleep(0.05)  # (its future completes once step returns)
        return forward_batch(model, calls)

    b = Batcher(engine.target.decoder, 8, forward=forward, max_tokens=16)
    out = {"a": [], "b": []}
    ends = {}

    def sink_for(name):
        def sink(item):
            if item is None or isinstance(item, BaseException):
                ends[name] = item
            else:
                out[name].extend(item.token_ids)
            return True
        return sink

    pa, pb = _prompt(12, 1), _prompt(80, 2)  # b's prompt: five chunks of 16
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)  # (a steps through all five)
    load = b.new_load()
    shared = []  # what a's draft waits left out of its draft's price (Load.take_shared)
    take = load.take_shared
    load.take_shared = lambda: shared.append(take()) or shared[-1]
    b.add(engine.session(pa, params, load=load), sink_for("a"), load)
    while len(out["a"]) < 2:  # a decodes: its first token, then a tree verified (its draft open, its steps under
        b.run_round()  # way; an open still running when b arrived left b's first chunks no step to arm: 3 armed, CI)
    chunk_rows.clear()  # (a's own prompt)
    draft.armed = True
    chunk_ran.clear()
    b.add(engine.session(pb, params, speculate=False), sink_for("b"))
    for _ in range(200):
        if len(ends) == 2:
            break
        b.run_round()
        chunk_ran.clear()
    assert ends == {"a": None, "b": None}
    assert len(draft.saw_chunk) >= 4 and all(draft.saw_chunk), "a draft step held the prompt chunk's forward back"
    assert sum(chunk_rows) == 80 and max(chunk_rows) == 16  # every chunk once, one a round (the budget)
    # the steps that ended within a chunk's forward: the rest of that forward (some 50 ms) is not their price
    assert sum(x >= 0.02 for x in shared) >= 3
    assert out["a"] == ar.generate(pa, params)[0] and out["b"] == ar.generate(pb, params)[0]
    b.shutdown()
