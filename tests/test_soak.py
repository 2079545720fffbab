"""Soak and chaos on the real Serve app (tiny pair, float64, CPU): many requests with flat memory
and no leaked session, concurrent requests each equal to its solo output (batched steps), client
disconnects, and the draft killed under load. Small in CI; SPECEXTEND_SOAK_SCALE=10 runs the
full size (1,000 requests, 64 concurrent)."""

from __future__ import annotations

import os
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from helpers import app_fixture

pytestmark = [pytest.mark.serve, pytest.mark.soak, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

SCALE = float(os.environ.get("SPECEXTEND_SOAK_SCALE", "1"))
REQUESTS = int(100 * SCALE)  # soak: requests in all (1,000 at scale 10)
CONCURRENT = min(64, int(16 * SCALE))  # concurrent requests, each checked against its solo output
TARGET, DRAFT = "random:llama-tiny", "random:llama-tiny-draft"
SETTINGS = dict(target=TARGET, draft=DRAFT, num_gpus=0, dtype="float64", tree_nodes=8, tree_depth=4,
                tree_topk=2, prefill_chunk=32, retrieval_chunk_size=8, retrieval_top_k=4, retrieval_every=2,
                max_prompt_tokens=256, max_new_tokens=64, max_concurrent_sessions=64, max_queued_requests=256,
                max_batch_sessions=16, draft_timeout_s=3,
                prefix_cache_gb=0.004)  # a cache bounded at 4 MiB, evicting under load: flat beyond it



PORT, BASE, server = app_fixture(SETTINGS)


@pytest.fixture(scope="module")
def solo():
    """solo(prompt_ids, max_tokens) -> the in-process AR engine's greedy tokens (float64)."""
    import torch

    from specextend.config import EngineConfig, SamplingParams
    from specextend.engine import Engine
    from specextend.models.loader import load_model

    torch.set_num_threads(1)
    engine = Engine(EngineConfig(mode="ar", dtype="float64"), load_model(TARGET, dtype="float64"))
    cache = {}

    def greedy(prompt_ids, max_tokens):
        key = (tuple(prompt_ids), max_tokens)
        if key not in cache:
            cache[key] = engine.generate(prompt_ids, SamplingParams(max_new_tokens=max_tokens, ignore_eos=True))[0]
        return cache[key]

    return greedy


def _prompt(i: int) -> list[int]:
    rng = random.Random(i)
    return [rng.randrange(256) for _ in range(rng.choice([5, 40, 90, 150]))]


def _complete(i: int, max_tokens: int = 16, stream: bool = False) -> list[int]:
    body = dict(prompt=_prompt(i), max_tokens=max_tokens, temperature=0, ignore_eos=True, return_token_ids=True,
                stream=stream)
    if not stream:
        r = httpx.post(f"{BASE}/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]
    ids = []
    with httpx.stream("POST", f"{BASE}/v1/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        import json

        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                data = json.loads(line[6:])
                if "error" in data:  # the stream ended with an error event
                    raise ValueError(data["error"]["message"])
                for choice in data["choices"]:
                    ids += choice.get("token_ids") or []
    return ids


def _disconnect(i: int) -> None:
    """A client that leaves after its first chunk."""
    body = dict(prompt=_prompt(i), max_tokens=60, temperature=0, ignore_eos=True, stream=True)
    with httpx.stream("POST", f"{BASE}/v1/completions", json=body, timeout=300) as r:
        for _ in r.iter_lines():
            break


def _idle(server, timeout_s: float = 60) -> dict:
    """Waits until the replica holds no session (nor the draft); returns its health."""
    deadline = time.time() + timeout_s
    while True:
        health = httpx.get(f"{BASE}/health", timeout=10).json()
        drafts = server.draft_sessions.remote().result()
        if health["active_sessions"] == 0 and health["queued_requests"] == 0 and drafts in (0, None):
            return health
        assert time.time() < deadline, f"sessions leaked: {health}, draft sessions {drafts}"
        time.sleep(0.5)


def _replica_rss() -> int:
    import psutil

    procs = [p for p in psutil.Process().children(recursive=True)
             if "ServeReplica:specextend:SpecExtend" in " ".join(p.cmdline())]
    assert len(procs) == 1, procs
    return procs[0].memory_info().rss


def test_concurrent_requests_each_equal_their_solo_output(server, solo):
    n = CONCURRENT
    with ThreadPoolExecutor(n) as pool:
        got = list(pool.map(lambda i: _complete(i, 24, stream=i % 2 == 0), range(n)))
    for i, ids in enumerate(got):
        assert ids == solo(_prompt(i), 24), f"request {i} differs from its solo output"
    _idle(server)


def test_soak_memory_flat_no_leaked_sessions(server, solo):
    """REQUESTS requests, 8 at a time, every tenth client gone after its first chunk: the replica's
    memory is flat over the second half and no session (target or draft) outlives its request."""
    def one(i):
        if i % 10 == 3:
            return _disconnect(i)
        assert _complete(i, 8, stream=i % 2 == 0) == solo(_prompt(i), 8)

    half = REQUESTS // 2
    start = _replica_rss()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(half)))
        _idle(server)
        before = _replica_rss()
        list(pool.map(one, range(half, REQUESTS)))
    _idle(server)
    end = _replica_rss()
    grown = (end - before) / 2**20
    print(f"\nsoak: replica RSS {start / 2**20:.0f} MiB at 0, {before / 2**20:.0f} at {half}, "
          f"{end / 2**20:.0f} at {REQUESTS} requests")
    assert grown < 32, f"the replica grew by {grown:.0f} MiB over {REQUESTS - half} requests"


def test_draft_killed_under_load(server, solo):
    """The draft actor dies while several streams decode: each stream still equals its solo output
    (those caught fall back to plain decoding), and speculation comes back."""
    import ray

    actor = server.draft_actor_handle.remote().result()
    restores = httpx.get(f"{BASE}/health", timeout=10).json()["draft_restores"]
    n = min(CONCURRENT, 8)
    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(_complete, 1000 + i, 48, True) for i in range(n)]
        time.sleep(1.0)
        ray.kill(actor, no_restart=True)
        got = [f.result() for f in futures]
    for i, ids in enumerate(got):
        assert ids == solo(_prompt(1000 + i), 48)
    # The streams may have decoded plainly past the kill (the adaptive policy's plain steps do not
    # call the draft). A request that calls the draft falls back at once; one whose policy can take
    # no tree before its next probe does not open the draft at all (a deferred open:
    # docs/architecture.md, "Deployment"), and Serve's periodic check_health notices the dead draft.
    r = httpx.post(f"{BASE}/v1/completions", json=dict(prompt=_prompt(8), max_tokens=8, temperature=0,
                                                      ignore_eos=True, return_token_ids=True), timeout=120)
    assert r.json()["choices"][0]["token_ids"] == solo(_prompt(8), 8)
    if r.json()["speculative_decoding"]["fallback"]:
        # the replica marks its draft failed as soon as a session falls back, not once the request ends
        # (one CI run read "ok" here, then the next request was served plainly)
        assert httpx.get(f"{BASE}/health", timeout=10).json()["draft"] == "restoring"
    deadline = time.time() + 120  # restored (a new draft actor: the old one cannot restart) and connected
    while (health := httpx.get(f"{BASE}/health", timeout=10).json())["draft_restores"] == restores or health["draft"] != "ok":
        assert time.time() < deadline, "the draft was not restored"
        time.sleep(0.5)
    assert server.draft_actor_handle.remote().result() != actor
    _idle(server)
    r = httpx.post(f"{BASE}/v1/completions", json=dict(prompt=_prompt(7), max_tokens=8, temperature=0,
                                                      ignore_eos=True, return_token_ids=True), timeout=120)
    assert r.json()["choices"][0]["token_ids"] == solo(_prompt(7), 8)
    assert r.json()["speculative_decoding"]["fallback"] is False


def test_replica_killed_under_load(server, solo):
    """The target replica dies while streams decode: each client gets its whole output or an error,
    none hangs; Serve starts a new replica and requests are served (and equal) again."""
    import ray

    replicas = [a for a in ray.util.list_named_actors(all_namespaces=True)
                if "SpecExtend" in a["name"] and "REPLICA" in a["name"].upper()]
    assert len(replicas) == 1, replicas
    actor = ray.get_actor(replicas[0]["name"], namespace=replicas[0]["namespace"])

    def stream(i):
        try:
            return _complete(2000 + i, 60, stream=True)
        except (AssertionError, httpx.HTTPError, ValueError) as e:
            return e

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(stream, i) for i in range(4)]
        time.sleep(1.0)
        t_kill = time.time()
        ray.kill(actor, no_restart=False)
        outcomes = [f.result(timeout=180) for f in futures]
    for i, out in enumerate(outcomes):  # a whole output is the right one; anything else is an error
        if isinstance(out, list) and len(out) == 60:
            assert out == solo(_prompt(2000 + i), 60)
    while True:
        try:
            r = httpx.post(f"{BASE}/v1/completions", json=dict(prompt=_prompt(9), max_tokens=8, temperature=0,
                                                              ignore_eos=True, return_token_ids=True), timeout=30)
            if r.status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.time() - t_kill < 180, "no replica served again"
        time.sleep(1.0)
    print(f"\nreplica killed: served again after {time.time() - t_kill:.1f} s; outcomes "
          f"{[len(o) if isinstance(o, list) else type(o).__name__ for o in outcomes]}")
    assert r.json()["choices"][0]["token_ids"] == solo(_prompt(9), 8)
