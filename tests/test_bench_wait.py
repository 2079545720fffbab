"""The serve suite's wait for an app (bench/app_wait.wait_ready): what Serve says of an app that does
not become ready is reported while waiting, and a deployment Serve gave up on ends the wait with
Serve's message (its replica's traceback) instead of a silent wait of up to half an hour."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import requests


def _status(app_status, deployment_status, message):
    from ray.serve._private.common import DeploymentStatus
    from ray.serve.schema import ApplicationStatus

    dep = SimpleNamespace(status=DeploymentStatus[deployment_status], message=message)
    ok = SimpleNamespace(status=DeploymentStatus.HEALTHY, message="healthy, not reported")
    app = SimpleNamespace(status=ApplicationStatus[app_status], message="",
                          deployments={"SpecExtend": dep, "OpenAIIngress": ok})
    return SimpleNamespace(applications={"bench": app})


@pytest.fixture
def no_health(monkeypatch):
    import specextend.bench.app_wait as served

    def refused(*a, **k):
        raise requests.ConnectionError("refused")
    monkeypatch.setattr(served.requests, "get", refused)
    monkeypatch.setattr(served.time, "sleep", lambda s: None)
    return served


def test_a_failed_deployment_ends_the_wait_with_serve_s_message(no_health, monkeypatch):
    from ray import serve

    monkeypatch.setattr(serve, "status", lambda: _status("DEPLOY_FAILED", "UNHEALTHY",
                                                         "replica failed: RuntimeError: boom"))
    said = []
    with pytest.raises(RuntimeError, match="boom"):
        no_health.wait_ready("http://127.0.0.1:1", 30, report_s=0.0, progress=said.append)
    assert said and "DEPLOY_FAILED" in said[0] and "boom" in said[0] and "not reported" not in said[0]


def test_a_slow_start_is_reported_and_times_out_with_the_state(no_health, monkeypatch):
    from ray import serve

    monkeypatch.setattr(serve, "status", lambda: _status("DEPLOYING", "UPDATING", "waiting for replicas"))
    said = []
    with pytest.raises(TimeoutError, match="DEPLOYING"):
        no_health.wait_ready("http://127.0.0.1:1", 0.05, report_s=0.0, progress=said.append)
    assert all("DEPLOYING" in s and "waiting for replicas" in s for s in said)
    monkeypatch.setattr(serve, "status", lambda: SimpleNamespace(applications={}))
    assert no_health.app_state("bench") == ("MISSING", "")
