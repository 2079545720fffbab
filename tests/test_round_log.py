"""The batcher's round log (specextend/round_log.py): off without SPECEXTEND_ROUND_LOG, and with it one
line a round that accounts for every forward, call, row, prompt chunk held back and draft step
(docs/architecture.md, "Batched steps")."""

from __future__ import annotations

import threading

import torch

from specextend import round_log
from specextend.config import SamplingParams, TreeConfig
from specextend.scheduler import Batcher

from helpers import make_engine


def _prompt(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(engine, prompts, **batcher) -> Batcher:
    b = Batcher(engine.target.decoder, 4, **batcher)
    done, ends = threading.Event(), []

    def sink(item):
        if item is None or isinstance(item, BaseException):
            ends.append(item)
            if len(ends) == len(prompts):
                done.set()
        return True

    for i, p in enumerate(prompts):
        load = b.new_load()
        b.add(engine.session(p, SamplingParams(max_new_tokens=6 + i, ignore_eos=True), load=load), sink, load)
    while not done.is_set():
        b.run_round()
    assert ends == [None] * len(prompts)
    b.shutdown()
    b.run()  # (closing: it returns at once, the log closed)
    assert b.round_log._file is None
    return b


def test_off_without_the_variable(tiny_models, monkeypatch, tmp_path):
    monkeypatch.delenv(round_log.ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    b = _run(make_engine(tiny_models("float64"), "ar"), [_prompt(10, 0), _prompt(12, 1)])
    assert not b.round_log.on and not list(tmp_path.iterdir())


def test_each_round_accounts_for_the_batchers_forwards(tiny_models, monkeypatch, tmp_path):
    monkeypatch.setenv(round_log.ENV, str(tmp_path))
    monkeypatch.setenv(round_log.SYNC_ENV, "1")  # (a CPU model: nothing to synchronise, no sync_s)
    engine = make_engine(tiny_models("float64"), "sd", tree=TreeConfig(6, 3, 2), prefill_chunk=16)
    # prompts of several chunks under a budget of 24 rows a round: chunks are held for later rounds
    b = _run(engine, [_prompt(40, 0), _prompt(33, 1), _prompt(9, 2)], max_tokens=24)
    rounds = round_log.read(str(tmp_path))
    forwards = [f for r in rounds for f in r["forwards"]]
    assert len(forwards) == b.forwards and sum(f[0] for f in forwards) == b.calls
    assert sum(r["held"] for r in rounds) == b.held_chunks > 0
    assert any(f[2] for f in forwards) and any(r["drafts"] for r in rounds)
    assert all(f[1] <= 24 or f[2] == 1 for f in forwards)  # (a round takes one chunk whatever the budget)
    assert [r["t"] for r in rounds] == sorted(r["t"] for r in rounds) and all(r["s"] >= 0 for r in rounds)
    assert all(0 <= r["advance_s"] <= r["s"] for r in rounds) and not any("sync_s" in r for r in rounds)
    assert sum(r["advance_s"] for r in rounds) > 0  # (the sessions' own host work between forwards)
    s = round_log.summary(rounds)
    assert s["rounds"] == len(rounds) and s["chunk_rounds"] == sum(any(f[2] for f in r["forwards"]) for r in rounds)
    assert round_log.read(str(tmp_path), since=rounds[-1]["t"] + 1) == []
    assert s["regimes"] == {} == s["by_regime"]  # (no governor)
    assert s["tokens"] == sum(r["tokens"] for r in rounds) == (6 + 7 + 8)  # (every token a round emitted)


def test_rounds_name_the_governors_regime(tiny_models, monkeypatch, tmp_path):
    """With the batch's governor, each round records its regime, and the summary counts them."""
    from specextend.governor import FREE, PLAIN, TREES, Governor

    monkeypatch.setenv(round_log.ENV, str(tmp_path))
    engine = make_engine(tiny_models("float64"), "sd", tree=TreeConfig(6, 3, 2), prefill_chunk=64,
                         tree_policy="adaptive")
    b = _run(engine, [_prompt(12, i) for i in range(4)],  # (life_factor 0: short requests measured too)
             governor=Governor(window=2, hold=1000, life_factor=0))
    rounds = round_log.read(str(tmp_path))
    assert rounds and all(r["regime"] in (FREE, PLAIN, TREES) for r in rounds)
    s = round_log.summary(rounds)
    assert sum(s["regimes"].values()) == len(rounds) and s["regimes"][FREE] > 0
    assert s["regimes"].get(PLAIN, 0) == b.held_rounds.get(PLAIN, 0) > 0  # (measured plain first)
    assert sum(v["tokens"] for v in s["by_regime"].values()) == s["tokens"] == sum(6 + i for i in range(4))
    assert s["by_regime"][PLAIN]["s"] == sum(r["s"] for r in rounds if r["regime"] == PLAIN)
    assert all(0 <= r["opening"] <= r["sessions"] for r in rounds)  # (drafts whose open was under way)
    assert s["opening_rounds"] == sum(r["opening"] > 0 for r in rounds)
    assert s["opening_s"] == sum(r["s"] for r in rounds if r["opening"])
