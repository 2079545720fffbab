"""The served app's ingress and operations, end to end (tiny pair on CPU, real Ray Serve, real
HTTP): body limits and read timeouts, tokenising off the event loop, prompts refused before the
replica, current gauges, quiet logs, the stream's framing of prompt ids. The generation paths are
test_serve.py's."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from helpers import SERVE_PROMPT as PROMPT, SERVE_SETTINGS as SETTINGS, SERVE_TARGET, app_fixture, chat_ids, openai_client

pytestmark = [pytest.mark.serve, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

PORT, BASE, server = app_fixture(SETTINGS)


@pytest.fixture(scope="module")
def tokenizer():
    """The served target's tokenizer."""
    from specextend.models.loader import load_model

    return load_model(SERVE_TARGET, dtype="float32").tokenizer


def test_head_health(server):
    r = httpx.head(f"{BASE}/health")
    assert r.status_code == 200 and r.content == b""


def test_oversized_body_is_413(server):
    big = b'{"prompt": "' + b"a" * (5 << 20) + b'"}'
    r = httpx.post(f"{BASE}/v1/completions", content=big, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == 413, r.text
    chunked = httpx.post(f"{BASE}/v1/completions", content=iter([big[i:i + (1 << 20)] for i in range(0, len(big), 1 << 20)]),
                         headers={"content-type": "application/json"}, timeout=60)  # no Content-Length: counted
    assert chunked.status_code == 413 and chunked.json()["error"]["type"] == "invalid_request_error"


def _raw_post(body: bytes, content_length: int, wait_s: float = 60) -> bytes:
    import socket

    with socket.create_connection(("127.0.0.1", PORT), timeout=wait_s) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (content_length, body))
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
        return reply


def test_short_body_times_out_with_408(server):
    """A body shorter than its Content-Length (or a client that stalls) gets a 408 after
    request_read_timeout_s (3 s here), not a connection held open forever."""
    reply = _raw_post(b'{"prompt": "x"', 100)
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), reply[:300]
    assert b'"code":408' in body
    ok = _raw_post(b'{"prompt": "x", "max_tokens": 1}', len(b'{"prompt": "x", "max_tokens": 1}'))
    assert ok.startswith(b"HTTP/1.1 200"), ok[:300]


def test_long_prompt_tokenizes_off_the_event_loop(server):
    """While megabytes of text are tokenized (then refused: too long), the replica keeps serving:
    a short request sent after the long one finishes first."""
    done = []

    def post(body):
        r = httpx.post(f"{BASE}/v1/completions", json=body, timeout=120)
        done.append((body["max_tokens"], r.status_code))

    with ThreadPoolExecutor(2) as pool:
        big = pool.submit(post, {"prompt": "lorem ipsum " * 300_000, "max_tokens": 2})
        time.sleep(1.0)  # the long prompt is being tokenized by now (it takes seconds)
        small = pool.submit(post, {"prompt": "short", "max_tokens": 1, "temperature": 0})
        big.result(), small.result()
    assert done == [(1, 200), (2, 400)], done


def _replica_rss() -> int:
    import psutil

    procs = [p for p in psutil.Process().children(recursive=True)
             if "ServeReplica:specextend:SpecExtend" in " ".join(p.cmdline())]
    assert len(procs) == 1, procs
    return procs[0].memory_info().rss


def test_oversized_token_id_prompts_stay_out_of_the_replica(server):
    """Token-id prompts over max_prompt_tokens are refused at the ingress: the replica's memory
    stays flat (it grew by megabytes per such request when the replica decoded and refused them)."""
    body = b'{"prompt": [' + b",".join([b"1"] * 1_500_000) + b'], "max_tokens": 1}'
    httpx.post(f"{BASE}/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=60)
    before = _replica_rss()
    for _ in range(12):
        r = httpx.post(f"{BASE}/v1/completions", content=body, headers={"content-type": "application/json"},
                       timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    grown = (_replica_rss() - before) / 2**20
    assert grown < 24, f"the replica grew by {grown:.0f} MiB"


def test_metrics_gauges_are_current(server):
    """num_requests_running reads 0 soon after the last request (published after the slot is
    released); a replica that stopped publishing (killed) is left out and its entry deleted."""
    import json

    from ray.experimental import internal_kv

    from specextend.serving import metrics as m

    for _ in range(2):
        httpx.post(f"{BASE}/v1/completions", json={"prompt": "gauge", "max_tokens": 2}, timeout=60)
        deadline = time.time() + 3
        while "specextend_num_requests_running 0.0" not in httpx.get(f"{BASE}/metrics").text:
            assert time.time() < deadline, "num_requests_running still reads a finished request"
            time.sleep(0.1)
    dead = m.ReplicaMetrics(use_ray=False)
    dead.set("specextend_num_requests_running", 5)
    key = m.KV_PREFIX + "killed-replica"
    internal_kv._internal_kv_put(key, json.dumps({"ts": time.time() - 15, "text": dead.exposition()}).encode(),
                                 overwrite=True, namespace=m.KV_NAMESPACE)
    assert "specextend_num_requests_running 0.0" in httpx.get(f"{BASE}/metrics").text
    assert not internal_kv._internal_kv_exists(key, namespace=m.KV_NAMESPACE)


def test_a_shared_document_is_prefilled_once(server):
    """Prefix caching: a second question over the same document reports the document's whole
    prefill chunks (32 tokens each here) as cached, in OpenAI's usage field and in /metrics."""
    client = openai_client(BASE)
    doc = [(37 * i + 11) % 250 + 3 for i in range(100)]  # token ids no other test sends
    first = client.completions.create(model=SETTINGS["target"], prompt=doc, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.completions.create(model=SETTINGS["target"], prompt=doc + [5, 6, 7, 8, 9], max_tokens=4,
                                       temperature=0)
    assert second.usage.prompt_tokens == 105 and second.usage.prompt_tokens_details.cached_tokens == 96
    deadline = time.time() + 10  # (a replica publishes its metrics when a request ends)
    while True:
        text = httpx.get(f"{BASE}/metrics").text
        hits = [float(line.split()[-1]) for line in text.splitlines()
                if line.startswith("specextend_prefix_cache_hit_tokens_total")]
        if hits and hits[0] >= 96:
            break
        assert time.time() < deadline, "the prefix cache's hits are not in /metrics"
        time.sleep(0.2)


def test_client_errors_and_disconnects_log_no_tracebacks(server):
    """A request's own errors (4xx) and a client that leaves mid-stream are not server errors:
    no ERROR lines, no tracebacks in the ingress's or the replica's logs."""
    import glob

    import ray

    logs = ray._private.worker._global_node.get_logs_dir_path()
    files = glob.glob(f"{logs}/serve/replica_specextend_*.log") + glob.glob(f"{logs}/worker-*.err")
    sizes = {f: os.path.getsize(f) for f in files}
    for body in ({"prompt": "x", "speculative_decoding": {"max_tree_nodes": 9}}, {"prompt": "x" * 300}):
        assert httpx.post(f"{BASE}/v1/completions", json=body, timeout=30).status_code == 400
    body = {"prompt": PROMPT, "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{BASE}/v1/completions", json=body) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
    time.sleep(5)  # the replica notices the cancel; logs are flushed
    new = ""
    for f in files:
        with open(f, errors="replace") as fh:
            fh.seek(sizes[f])
            new += fh.read()
    bad = [line for line in new.splitlines() if line.startswith("ERROR") or "Traceback" in line
           or "ExceptionGroup" in line]
    assert not bad, "\n".join(bad[:10])


def test_streamed_prompt_token_ids_come_first(server, tokenizer):
    """With return_token_ids a stream's prompt ids come in its first chunk (as vLLM's do), not with
    its last tokens: a long prompt's ids do not delay the end of the stream."""
    client = openai_client(BASE)
    ids = tokenizer.encode(PROMPT)
    messages = [{"role": "user", "content": "Hi there!"}]
    for chat in (False, True):
        kw = dict(model=SERVE_TARGET, max_tokens=12, temperature=0, stream=True,
                  extra_body={"return_token_ids": True, "ignore_eos": True})
        stream = (client.chat.completions.create(messages=messages, **kw) if chat
                  else client.completions.create(prompt=ids, **kw))
        chunks = [c for c in stream if c.choices and (getattr(c.choices[0], "token_ids", None) or c.choices[0].finish_reason)]
        got = [(c.model_extra.get("prompt_token_ids") if chat else c.choices[0].model_extra.get("prompt_token_ids"))
               for c in chunks]
        want = chat_ids(tokenizer, messages) if chat else ids
        assert len(chunks) >= 2 and got[0] == want and not any(got[1:])
        assert chunks[-1].choices[0].finish_reason == "length"


def _items(handle, req: dict) -> list[dict]:
    """The replica's items for `req`, through its streaming handle."""
    import asyncio

    async def collect():
        return [item async for item in handle.options(stream=True).generate.remote(req)]

    return asyncio.run(collect())


def test_a_whole_response_is_one_item(server, tokenizer):
    """A request answered whole (not streamed) leaves the replica as one item, with what the
    streamed items carry together: every item is a Ray object the ingress awaits. With a stop
    string the replica still reads the tokens as they come (the stop ends the steps early)."""
    ids = tokenizer.encode(PROMPT)
    base = {"prompt_ids": ids, "max_tokens": 120, "temperature": 0.0, "ignore_eos": True, "return_prompt_ids": True}
    streamed = _items(server, base)
    text = "".join(i["text"] for i in streamed)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    for req in (base, {**base, "stop": [stop]}):
        streamed = _items(server, req)
        whole = _items(server, {**req, "stream": False})
        assert len(streamed) > 1 and len(whole) == 1, (len(streamed), len(whole))
        item = whole[0]
        assert item["token_ids"] == [t for i in streamed for t in i["token_ids"]]
        assert item["text"] == "".join(i["text"] for i in streamed)
        assert item["prompt_token_ids"] == ids and item["finish_reason"] == streamed[-1]["finish_reason"]
        assert item["completion_tokens"] == streamed[-1]["completion_tokens"] and "speculative_decoding" in item
    assert item["finish_reason"] == "stop" and stop not in item["text"] and len(item["text"]) < len(text)


def _aborted() -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{BASE}/metrics").text
    return sum(s.value for fam in text_string_to_metric_families(text) if fam.name == "specextend_request_success"
               for s in fam.samples if s.labels.get("finish_reason") == "abort" and s.name.endswith("_total"))


def test_a_client_that_leaves_a_whole_response_frees_its_session(server):
    """A whole response is held in the replica until its finish; a client that leaves before it
    ends the request there (counted as an abort) and frees its session."""
    before = _aborted()
    body = {"prompt": PROMPT, "max_tokens": 256, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{BASE}/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.1))
    deadline = time.time() + 30
    while time.time() < deadline:
        health = httpx.get(f"{BASE}/health").json()
        if health["active_sessions"] == 0 and _aborted() > before:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"the request was not ended as an abort: {health}, aborts {_aborted()} (before {before})")
