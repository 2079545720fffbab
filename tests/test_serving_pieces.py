"""The serving layer's pure pieces, without a server: the text stream (partial characters, stop
strings), admission's queue limit, and the merge of replicas' metrics. The served app end to end
is test_serve.py."""

from __future__ import annotations

import asyncio

import pytest

from specextend.serving.admission import Admission
from specextend.serving.errors import QueueFullError
from specextend.serving.metrics import ReplicaMetrics, merge_expositions
from specextend.serving.textstream import TextStream


def test_textstream_holds_partial_characters_and_stop_prefixes():
    from specextend.models.tokenizer import build_byte_tokenizer

    tok = build_byte_tokenizer()
    ids = tok.encode("héllo wörld 😀 STOP here")
    ts = TextStream(tok, [], stop=["STOP"])
    parts = [ts.push([i]) for i in ids]
    assert all("\ufffd" not in p.text for p in parts)
    assert "".join(p.text for p in parts) == "héllo wörld 😀 " and ts.stopped
    assert ts.token_ids == ids[:ids.index(80) + 1]  # up to the token that completed "STOP"
    held = TextStream(tok, [], stop=["wörx"])
    text = "".join(held.push([i]).text for i in tok.encode("a wö")) + held.finish()
    assert text == "a wö" and not held.stopped


def test_admission_queue_limit():
    async def scenario():
        adm = Admission(max_sessions=1, max_queued=1, budget_bytes=100)
        await adm.acquire(10)
        waiter = asyncio.ensure_future(adm.acquire(10))
        await asyncio.sleep(0)
        with pytest.raises(QueueFullError):
            await adm.acquire(10)
        adm.release(10)
        await waiter
        assert (adm.active, adm.waiting, adm.reserved) == (1, 0, 10)
    asyncio.run(scenario())


def test_the_kv_budget_leaves_room_for_the_prefix_caches():
    from specextend.serving.admission import kv_budget

    gib = 2**30
    assert kv_budget(100 * gib, 0.9, 2.0, False) == 90 * gib  # the draft on its own GPU (the target's cache:
    assert kv_budget(100 * gib, 0.9, 2.0, True) == 88 * gib  # in the budget); the draft's on the same device
    assert kv_budget(100 * gib, 0.9, 0.0, True) == 90 * gib and kv_budget(gib, 0.25, 2.0, True) == 0


def test_the_prefix_cache_holds_what_admitted_sessions_leave_free():
    """Admission shrinks the target's prefix cache to what the admitted sessions leave of the
    budget, and a store keeps within it."""
    import torch

    from specextend.kv_cache import KVCache
    from specextend.prefix_cache import PrefixCache

    def filled(tokens):
        cache = KVCache(1, 1, 1, 64, torch.float32)  # 8 bytes a token (k and v)
        cache.advance(len(tokens))
        return cache

    prefixes = PrefixCache(4, 1 << 20)
    adm = Admission(4, 4, 100, prefixes)
    for k in range(3):
        assert prefixes.store([k] * 4, filled([k] * 4))  # 32 bytes each: 96 of the 100
    asyncio.run(adm.acquire(40))  # a session needs 40: the cache keeps at most 60, its newest entry
    assert len(prefixes) == 1 and prefixes.nbytes == 32 and prefixes.lookup([2] * 5)[0] == 4
    assert prefixes.store([7] * 4, filled([7] * 4)) and prefixes.nbytes == 32  # room 60: one entry
    assert not prefixes.store([9] * 8, filled([9] * 8))  # 64 bytes: more than the room
    adm.release(40)
    assert prefixes.store([9] * 8, filled([9] * 8)) and prefixes.nbytes == 96


def test_a_publish_that_fails_waits_for_the_next_period(monkeypatch, caplog):
    """A request's end publishes the replica's metrics from the publisher's thread, whose failures
    nobody reads: one there (the GCS unreachable) is logged at debug level, never raised."""
    import logging

    from specextend.serving import metrics as m

    def unreachable(key, text):
        raise ConnectionError("GCS unreachable")

    monkeypatch.setattr(m, "publish", unreachable)
    monkeypatch.setattr(m, "unpublish", lambda key: None)
    publisher = m.Publisher("replica-1", ReplicaMetrics(use_ray=False), every_s=3600)
    with caplog.at_level(logging.DEBUG, logger=m.__name__):
        publisher.publish()  # (no exception)
    assert "GCS unreachable" in caplog.text
    publisher.stop()


def test_requests_ending_together_publish_once(monkeypatch):
    """A request's end asks for a publish soon (at most one every min_gap_s), not one per request:
    fifty requests ending together publish once or twice, within a few gaps, and nothing after."""
    import time

    from specextend.serving import metrics as m

    times = []
    monkeypatch.setattr(m, "publish", lambda key, text: times.append(time.monotonic()))
    monkeypatch.setattr(m, "unpublish", lambda key: None)
    publisher = m.Publisher("replica-1", ReplicaMetrics(use_ray=False), every_s=3600, min_gap_s=0.1)
    t0 = time.monotonic()
    for _ in range(50):
        publisher.soon()
        time.sleep(0.002)
    deadline = time.monotonic() + 10
    while not times and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.5)
    assert 1 <= len(times) <= 2 and times[0] - t0 < 5, times
    assert publisher.published == len(times)
    publisher.stop()


def test_metrics_merge_sums_replicas():
    a, b = ReplicaMetrics(use_ray=False), ReplicaMetrics(use_ray=False)
    from specextend.stats import RequestStats

    stats = RequestStats(num_steps=2, accepted_per_step=[2, 1], draft_tokens=16, num_generated=5)
    a.record_request(stats, "length")
    b.record_request(stats, "stop")
    text = merge_expositions([a.exposition(), b.exposition()])
    assert "specextend_spec_decode_num_accepted_tokens_total 6.0" in text
    assert 'specextend_spec_decode_num_accepted_tokens_per_pos_total{position="1"} 2.0' in text


def test_the_replica_and_draft_actor_modules_import_no_torch():
    """Serve imports a replica's class module before its constructor runs, and Ray the draft
    actor's: neither may import torch or transformers (seconds), so that the replica starts its
    draft actor before its own heavy imports and the two processes import at once."""
    import subprocess
    import sys

    code = ("import sys, specextend.serving.replica, specextend.serving.draft_actor; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_short_prompts_are_tokenized_on_the_loop():
    """items.short_prompt: prompts up to INLINE_PROMPT ids or characters skip the worker thread."""
    from specextend.serving.items import INLINE_PROMPT, short_prompt

    n = INLINE_PROMPT
    assert short_prompt({"prompt_ids": [1] * n}) and not short_prompt({"prompt_ids": [1] * (n + 1)})
    assert short_prompt({"prompt": "a" * n}) and not short_prompt({"prompt": "a" * (n + 1)})
    assert short_prompt({"messages": [{"role": "user", "content": "a" * (n // 2)}] * 2})
    assert not short_prompt({"messages": [{"role": "user", "content": "a" * (n // 2)}] * 3})
