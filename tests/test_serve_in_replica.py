"""The real Serve app with the draft in the target replica's process (`draft_in_replica`:
docs/architecture.md, "Overlapped drafting"): one bundle, no
draft actor, overlapped drafting on the worker's thread; the output over HTTP equals the target's
greedy output with trees verified, and speculation off equals it too."""

from __future__ import annotations

import time

import httpx
import pytest

from helpers import SERVE_PROMPT, SERVE_SETTINGS, SERVE_TARGET, app_fixture, openai_client, served_target_greedy, speculated

SETTINGS = dict(SERVE_SETTINGS, draft_in_replica=True, max_concurrent_sessions=2, max_queued_requests=4)
PORT, BASE, server = app_fixture(SETTINGS)


@pytest.fixture(scope="module")
def greedy():
    return served_target_greedy()


def test_the_placement_has_one_bundle_and_no_draft_actor():
    from specextend.serving.app import replica_options
    from specextend.serving.settings import AppSettings

    s = AppSettings(**SETTINGS)
    assert s.draft_here and len(replica_options(s)["placement_group_bundles"]) == 1
    assert s.to_engine_config().overlap  # (set here; on the CPU overlap is off unless set)
    shared = AppSettings(**{**{k: v for k, v in SETTINGS.items() if k != "draft_overlap"}, "num_gpus": 0.5})
    opts = replica_options(shared)  # target and draft sharing one GPU in the replica: the replica takes it
    assert shared.draft_here and not shared.to_engine_config().overlap  # (drafting when asked unless set)
    assert opts["ray_actor_options"]["num_gpus"] == 1.0 and opts["placement_group_bundles"] == [{"CPU": 0.5, "GPU": 1.0}]
    apart = AppSettings(**{**{k: v for k, v in SETTINGS.items() if k != "draft_in_replica"}, "num_gpus": 0.5})
    assert not apart.draft_here and replica_options(apart)["placement_group_bundles"] == [{"CPU": 0.5, "GPU": 0.5}] * 2


def test_the_draft_in_the_replica_serves_the_targets_greedy_output(server, greedy):
    health = httpx.get(f"{BASE}/health").json()
    assert health["ready"] is True and health["draft"] == "ok"
    assert server.draft_actor_handle.remote().result() is None
    assert server.draft_step_endpoint.remote().result() is None
    client = openai_client(BASE)
    ids = greedy.tokenizer.encode(SERVE_PROMPT)
    ref = greedy(ids, 32)

    def create(**extra):
        return client.completions.create(model=SERVE_TARGET, prompt=SERVE_PROMPT, max_tokens=32, temperature=0,
                                         extra_body={"return_token_ids": True, "ignore_eos": True, **extra})
    out = speculated(create, ref, tries=10)
    spec = out.model_extra["speculative_decoding"]
    assert spec["fallback"] is False and spec["num_steps"] >= 1
    # the request's draft session was closed (its close runs after the answer, on the draft's
    # threads: on a loaded 2-core host it was still running when asked at once)
    deadline = time.monotonic() + 10
    while server.draft_sessions.remote().result() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.draft_sessions.remote().result() == 0
    off = create(speculative_decoding={"enabled": False})
    assert off.choices[0].token_ids == ref and off.model_extra["speculative_decoding"]["num_steps"] == 0
