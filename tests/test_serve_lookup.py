"""The real Serve app with mode=lookup (context lookup alone, no draft model; docs/architecture.md,
"Context lookup"): one GPU's worth of placement (no draft actor), the output equals the target's
greedy output, chains verified, and the health check says there is no draft."""

from __future__ import annotations

import httpx
import pytest

from helpers import SERVE_SETTINGS, SERVE_TARGET, app_fixture, openai_client, served_target_greedy

SETTINGS = {k: v for k, v in SERVE_SETTINGS.items() if k not in ("draft", "draft_overlap")}
SETTINGS.update(mode="lookup", lookup_tokens=6,
                stream_items_per_s=0.5)  # a stream alone: an item every 2 s at most (no test here streams but one)
PORT, BASE, server = app_fixture(SETTINGS)
# a prompt that repeats itself: the index finds chains (a tiny random model never repeats on its own)
PROMPT = "alpha beta gamma delta epsilon zeta eta theta " * 3


@pytest.fixture(scope="module")
def greedy():
    return served_target_greedy()


def test_lookup_mode_serves_greedy_output_with_its_chains(server, greedy):
    health = httpx.get(f"{BASE}/health").json()
    assert health["ready"] is True and health["draft"] == "off"  # no draft actor was started
    client = openai_client(BASE)
    ids = greedy.tokenizer.encode(PROMPT)
    ref = greedy(ids, 40)
    out = client.completions.create(model=SERVE_TARGET, prompt=PROMPT, max_tokens=40, temperature=0,
                                    extra_body={"return_token_ids": True, "ignore_eos": True})
    assert out.choices[0].token_ids == ref
    spec = out.model_extra["speculative_decoding"]
    assert spec["fallback"] is False and spec["num_steps"] == 0 and spec["lookup_steps"] > 0
    kinds = spec["step_kinds"]  # every decode step by kind: the chains' steps, the others plain
    assert kinds["lookup"]["steps"] == spec["lookup_steps"] and set(kinds) <= {"lookup", "plain"}
    assert sum(k["tokens"] for k in kinds.values()) == 39 and 0 < spec["max_step_ms"] <= sum(k["ms"] for k in kinds.values())
    off = client.completions.create(model=SERVE_TARGET, prompt=PROMPT, max_tokens=40, temperature=0,
                                    extra_body={"return_token_ids": True, "ignore_eos": True,
                                                "speculative_decoding": {"enabled": False}})
    assert off.choices[0].token_ids == ref and off.model_extra["speculative_decoding"]["lookup_steps"] == 0


def test_streams_share_the_replicas_items_a_second(server, greedy):
    """stream_items_per_s bounds the items a second that leave the replica, shared by its streams
    (docs/architecture.md, "Serving surface"): at 0.5 a second a stream alone waits 2 s between
    items, so a 60-token stream that decodes in well under that comes as its first item (the
    first token, or the first few on a loaded host) and the rest at the finish (the stream
    interval alone, 10 ms, would send an item every few steps)."""
    ids = greedy.tokenizer.encode(PROMPT)
    stream = openai_client(BASE).completions.create(model=SERVE_TARGET, prompt=ids, max_tokens=60, temperature=0,
                                                    stream=True, extra_body={"return_token_ids": True,
                                                                             "ignore_eos": True})
    chunks = [c.choices[0].token_ids for c in stream if c.choices and c.choices[0].token_ids]
    assert [t for c in chunks for t in c] == greedy(ids, 60)
    assert 2 <= len(chunks) <= 3 and len(chunks[0]) < 30, [len(c) for c in chunks]


def test_item_wait():
    from specextend.serving.items import item_wait

    assert item_wait(0.01, 1, 1 / 200) == 0.01  # one stream: the interval
    assert item_wait(0.01, 8, 1 / 200) == 8 / 200  # eight share 200 items a second
    assert item_wait(0.01, 8, 0.0) == 0.01  # no bound
