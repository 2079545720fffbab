"""The HTTP API key (serving/auth.py): the check itself, the settings that carry the key, and the
served app with raw HTTP and the official `openai` client (tiny pair on CPU, draft over gRPC)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from pydantic import SecretStr, ValidationError

from specextend.serving import auth
from specextend.serving import protocol as p
from specextend.serving.settings import AppSettings

from helpers import free_port, openai_client, served_app

KEY = "sk-test-" + "7f3a9c" * 6  # what a client is given
MISSING = auth.error_body(auth.MISSING)
INCORRECT = auth.error_body(auth.INCORRECT)


# ------------------------------------------------------------------ no server

def test_error_body_is_openais():
    assert INCORRECT == {"error": {"message": "Incorrect API key provided.", "type": "invalid_request_error",
                                   "param": None, "code": "invalid_api_key"}}
    assert MISSING["error"]["type"] == "invalid_request_error" and "Bearer" in MISSING["error"]["message"]


def test_check():
    key = SecretStr(KEY)
    assert auth.check(f"Bearer {KEY}", key) is None
    assert auth.check(f"bearer {KEY}", key) is None  # the scheme is case-insensitive
    for header in (None, "", "Bearer", "Bearer ", KEY, f"Basic {KEY}", f"Token {KEY}"):
        assert auth.check(header, key) == auth.MISSING, header
    for header in (f"Bearer {KEY}x", f"Bearer {KEY[:-1]}", "Bearer sk-other", f"Bearer {KEY.upper()}",
                   "Bearer é"):
        assert auth.check(header, key) == auth.INCORRECT, header


def test_resolve_key_argument_then_environment():
    env = {auth.ENV: KEY + "\n"}  # a Secret created from a file often ends in a newline
    assert auth.resolve_key(SecretStr("from-arg"), env).get_secret_value() == "from-arg"
    assert auth.resolve_key(None, env).get_secret_value() == KEY
    assert auth.resolve_key(None, {}) is None and auth.resolve_key(None, {auth.ENV: "  "}) is None
    with pytest.raises(ValueError, match=auth.ENV) as e:
        auth.resolve_key(None, {auth.ENV: "two words"})
    assert "two words" not in str(e.value)


def test_settings_never_show_the_key():
    s = AppSettings(num_gpus=0, api_key=KEY)
    assert s.api_key.get_secret_value() == KEY
    assert KEY not in repr(s) and KEY not in str(s.model_dump()) and KEY not in s.model_dump_json()
    assert AppSettings(num_gpus=0, api_key=12345678).api_key.get_secret_value() == "12345678"  # YAML number
    for bad in (KEY + " x", "", f"{KEY}é", [KEY], {"k": KEY}, 1.5):
        with pytest.raises(ValidationError, match="api_key") as e:
            AppSettings.model_validate({"num_gpus": 0, "api_key": bad})
        assert KEY not in str(e.value), bad


def test_only_the_ingress_gets_the_key():
    from ray.serve._private.build_app import build_app as serve_build

    from specextend.serving.app import build_app

    args = dict(target="random:llama-tiny", draft="random:llama-tiny-draft", num_gpus=0, api_key=KEY)
    deployments = {d.name: d for d in serve_build(build_app(args), name="specextend").deployments}
    ingress_settings = deployments["OpenAIIngress"].init_args[1]
    assert ingress_settings["api_key"].get_secret_value() == KEY
    assert "api_key" not in deployments["SpecExtend"].init_args[0]


def _client(key):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    app = FastAPI()
    app.add_middleware(auth.APIKeyMiddleware, key=lambda: key)
    app.get("/health")(lambda: {"ready": True})
    app.get("/metrics")(lambda: "m 1")
    app.get("/v1/models")(lambda: {"data": []})

    @app.post("/v1/completions")
    def completions(body: p.CompletionRequest):
        return {"ok": True}

    return TestClient(app)


def test_middleware_before_routing_and_validation():
    c = _client(SecretStr(KEY))
    assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200
    r = c.get("/v1/models")
    assert (r.status_code, r.json()) == (401, MISSING)
    assert r.headers["www-authenticate"].startswith("Bearer")
    bad = c.post("/v1/completions", content=b"{not json", headers={"authorization": "Bearer nope"})
    assert (bad.status_code, bad.json()) == (401, INCORRECT)  # no validation detail before the key
    assert c.get("/v1/nothing").status_code == 401 and c.get("/docs").status_code == 401
    ok = {"authorization": f"Bearer {KEY}"}
    assert c.get("/v1/models", headers=ok).status_code == 200
    assert c.post("/v1/completions", json={"prompt": "x"}, headers=ok).status_code == 200
    assert c.get("/v1/nothing", headers=ok).status_code == 404
    assert _client(None).get("/v1/models").status_code == 200  # no key configured: open


# ------------------------------------------------------------------ the served app

PORT = free_port()
BASE = f"http://127.0.0.1:{PORT}"
TARGET = "random:llama-tiny"
SETTINGS = dict(target=TARGET, draft="random:llama-tiny-draft", num_gpus=0, dtype="float32", tree_nodes=8,
                tree_depth=4, tree_topk=2, max_prompt_tokens=256, max_new_tokens=64)


@pytest.fixture(scope="module")
def served(monkeypatch_module):
    """The app with its key from the environment (as the KubeRay manifests pass it): Ray's
    workers, the ingress among them, inherit the environment of the process that starts Ray."""
    monkeypatch_module.setenv(auth.ENV, KEY)
    with served_app(SETTINGS, PORT) as handle:
        yield handle


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def _ray_logs_contain(*needles: str) -> list[str]:
    import ray

    logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"
    hits = []
    for path in logs.rglob("*"):
        if path.is_file():
            text = path.read_bytes()
            hits += [f"{path.name}: {n[:6]}..." for n in needles if n.encode() in text]
    return hits


@pytest.mark.serve
def test_served_app_requires_the_key(served):
    from openai import AuthenticationError

    assert httpx.get(f"{BASE}/health", timeout=30).status_code == 200
    metrics = httpx.get(f"{BASE}/metrics", timeout=30)
    assert metrics.status_code == 200 and KEY not in metrics.text
    body = {"model": TARGET, "prompt": "Hello", "max_tokens": 4}
    for headers, want in (({}, MISSING), ({"Authorization": "Bearer sk-wrong"}, INCORRECT),
                          ({"Authorization": KEY}, MISSING)):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions")):
            r = httpx.request(method, f"{BASE}{path}", json=body, headers=headers, timeout=30)
            assert (r.status_code, r.json()) == (401, want), (path, headers)
    r = httpx.post(f"{BASE}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4

    wrong = openai_client(BASE, "sk-wrong", timeout=60)
    with pytest.raises(AuthenticationError) as e:
        wrong.models.list()
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    client = openai_client(BASE, KEY)
    assert [m.id for m in client.models.list().data] == [TARGET]
    out = client.completions.create(model=TARGET, prompt="The quick brown fox", max_tokens=16, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 16
    assert out.model_extra["speculative_decoding"]["fallback"] is False  # the draft channel works
    stream = client.chat.completions.create(model=TARGET, messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=8, stream=True)
    assert any(chunk.choices and chunk.choices[0].finish_reason for chunk in stream)
    assert _ray_logs_contain(KEY) == []


@pytest.mark.serve
def test_argument_key_wins_and_stays_out_of_logs(served):
    """`api_key=` as an app argument (here not the environment's) is the one checked; neither key
    shows up in any Ray log of the session."""
    from ray import serve

    from deploy.app import specextend

    arg_key = "sk-arg-" + "c0ffee" * 6
    serve.run(specextend(dict(SETTINGS, mode="ar", api_key=arg_key)), name="specextend", route_prefix="/")
    models = f"{BASE}/v1/models"
    assert httpx.get(models, headers={"Authorization": f"Bearer {KEY}"}, timeout=30).status_code == 401
    assert httpx.get(models, headers={"Authorization": f"Bearer {arg_key}"}, timeout=30).status_code == 200
    assert httpx.get(f"{BASE}/health", timeout=30).status_code == 200
    assert _ray_logs_contain(KEY, arg_key) == []
