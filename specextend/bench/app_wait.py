"""Waiting for a served app to answer (the serve suite, benchmarks/concurrency.py,
benchmarks/useless_served.py): /health polled, and what Serve says of an app that does not
become ready reported while waiting."""

from __future__ import annotations

import time

import requests


def app_state(app: str = "bench") -> tuple[str, str]:
    """(status, what Serve says of it): the application's and, where one is not healthy, its
    deployments' messages (a replica whose constructor raised: its traceback)."""
    from ray import serve

    def name(x) -> str:  # (Serve's statuses are str enums: their value)
        return str(getattr(x, "value", x))

    status = serve.status().applications.get(app)
    if status is None:
        return "MISSING", ""
    notes = [status.message] + [f"{dep}: {name(d.status)} {d.message}" for dep, d in status.deployments.items()
                                if name(d.status) != "HEALTHY" and d.message]
    return name(status.status), "; ".join(n for n in notes if n)


def wait_ready(url: str, timeout_s: float, app: str = "bench", report_s: float = 60.0, progress=print) -> None:
    """Until the app answers /health; a deployment Serve gave up on raises at once with Serve's
    message, and every `report_s` the wait says what Serve reports (a replica that never becomes
    ready: in 2026-11-29's one GPU run of `draft_in_replica` nothing told why)."""
    t0 = last = time.time()
    while time.time() - t0 < timeout_s:
        try:
            if requests.get(url + "/health", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        if time.time() - last >= report_s:
            last = time.time()
            state, note = app_state(app)
            progress(f"app {app!r} not ready after {last - t0:.0f} s: {state} {note}".rstrip())
            if state == "DEPLOY_FAILED":
                raise RuntimeError(f"the app failed to deploy: {note}")
        time.sleep(1)
    raise TimeoutError(f"the app did not become ready in {timeout_s:.0f} s: {' '.join(app_state(app))}")
