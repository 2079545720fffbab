"""benchmarks/hostile_probe.py's pure parts (no server): its cases cover the serve suite's
BAD_REQUESTS and issue 17's list, and each one builds a well-formed HTTP request."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from test_serve import BAD_REQUESTS

PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "hostile_probe.py"


@pytest.fixture(scope="module")
def probe():
    spec = importlib.util.spec_from_file_location("hostile_probe", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cases_cover_the_suite_and_the_issue(probe):
    cases = probe.cases()
    names = [c["name"] for c in cases]
    assert len(names) == len(set(names))
    table = [(c["path"], c["body"], c["expect"], c["param"]) for c in cases if c["name"].startswith("table ")]
    assert table == [tuple(row) for row in BAD_REQUESTS]  # every row, as the suite expects it
    bodies = [json.dumps(c["body"]) if isinstance(c["body"], dict) else repr(c["body"]) for c in cases]
    for needle in ("\\\\ud800", "1e-38", "1e-46", "<|im_start|>system", "wizard", "not json", '"seed": -1',
                   str(2**64 - 1)):
        assert any(needle in b for b in bodies), needle
    wanted = {"body 5 MiB > max_request_bytes", "body shorter than Content-Length", "HEAD /health", "no API key",
              "wrong API key", "forged special tokens in chat"}
    assert wanted <= set(names)
    assert {c["kind"] for c in cases} >= {"malformed JSON", "unicode", "injection", "sampling extremes",
                                          "size/transport", "auth", "routing", "fields/limits"}


def test_each_case_builds_a_well_formed_request(probe):
    for c in probe.cases():
        expect = c["expect"] if isinstance(c["expect"], tuple) else (c["expect"],)
        assert all(isinstance(s, int) and 200 <= s < 600 for s in expect), c["name"]
        if c.get("raw") is not None:  # sent as is: a request line, headers, a blank line, the body
            head, _, body = probe.raw_bytes(c).partition(b"\r\n\r\n")
            lines = head.decode().split("\r\n")
            assert lines[0] == f"POST {c['path']} HTTP/1.1" and body == c["raw"], c["name"]
            assert all(": " in line for line in lines[1:]) and f"Content-Length: {c['length']}" in lines
            continue
        r = probe.build(c, "http://127.0.0.1:1")
        assert r.method in ("GET", "HEAD", "POST", "DELETE") and r.url.path, c["name"]
        auth = r.headers.get("authorization")
        assert (auth == f"Bearer {probe.KEY}") == (c.get("auth", "ok") == "ok"), c["name"]
        if c.get("chunked"):
            assert "content-length" not in r.headers and r.headers["transfer-encoding"] == "chunked"
        elif c["body"] is not None:
            sent = r.read()
            assert int(r.headers["content-length"]) == len(sent), c["name"]
            if isinstance(c["body"], dict):
                assert json.loads(sent) == c["body"], c["name"]
