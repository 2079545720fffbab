"""Shared test helpers: engines over the tiny pair, and DESIGN 3.6's near-tie rule."""

from __future__ import annotations

from specextend.config import EngineConfig
from specextend.draft.inprocess import InProcessDraft
from specextend.engine import Engine
from specextend.near_tie import near_tie_check


def make_engine(pair, mode="sd", draft_backend=None, **kw) -> Engine:
    target, draft = pair
    backend = None if mode == "ar" else (draft_backend or InProcessDraft(draft.decoder))
    return Engine(EngineConfig(mode=mode, **kw), target, backend)


def assert_equal_or_near_tie(decoder, prompt, ref, out, tol):
    """DESIGN 3.6: outputs equal, or the first divergence sits at a near-tie of the target."""
    ok, i, gap = near_tie_check(decoder, prompt, ref, out, tol)
    assert ok, f"divergence at generated position {i} with top-2 gap {gap} (tolerance {tol})"
    return i, gap


def start_local_ray(**kw):
    """ray.init for tests, retried once: on a loaded 2-core machine the GCS can miss Ray's start-up
    deadline ("Timed out waiting for file .../gcs_server_port"); a clean second start succeeds."""
    import subprocess
    import time

    import ray

    kw = dict(address="local", include_dashboard=False, log_to_driver=False, **kw)
    try:
        return ray.init(**kw)
    except RuntimeError:
        ray.shutdown()
        subprocess.run(["ray", "stop", "--force"], capture_output=True, timeout=120)
        time.sleep(5)
        return ray.init(**kw)
