import os

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# Without a GPU, Triton kernels (test_full_graphs.py) run in Triton's interpreter. Triton reads this
# when it is imported (its own library functions are decorated then), so it is set before anything
# imports it.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _sessions_wait_for_the_draft(monkeypatch):
    """In-process engines: a session waits for its draft's open after the first token, as the fixed
    policy does, so that which steps speculate does not depend on the open's timing; the tests of
    joining late ask for it (`make_engine(join_early=True)`, test_join.py)."""
    from specextend.engine import Engine

    monkeypatch.setattr(Engine, "join_early", False)
    # ... and the draft's prefill against the target's does not seed the adaptive policy: on a loaded
    # 2-core host that ratio passed SLOW_DRAFT now and then (a CPU hog: the tiny pair's 0.8 read over
    # 3), and sessions started plain (test_join.py tests the prior)
    monkeypatch.setattr(Engine, "prior_from_prefill", False)


@pytest.fixture
def fake():
    """A fresh test_rpc.FakeDraft (base.py's step contract, deterministic trees) for a server to serve."""
    from test_rpc import FakeDraft

    return FakeDraft()


@pytest.fixture
def channel_steps(monkeypatch):
    """Session id -> steps that arrived over the ZeroMQ channel (counted where its jobs are made)."""
    import specextend.rpc.zmq_server as zmq_server

    seen: dict[str, list[int]] = {}
    make_job = zmq_server.step_from_proto

    def counting(request):
        seen.setdefault(request.session_id, []).append(request.step)
        return make_job(request)

    monkeypatch.setattr(zmq_server, "step_from_proto", counting)
    return seen


@pytest.fixture(scope="session")
def tiny_models():
    """Cache of (target, draft) tiny LoadedModels per (dtype, backend)."""
    from specextend.models.loader import load_model

    cache = {}

    def get(dtype="float64", backend="torch"):
        key = (dtype, backend)
        if key not in cache:
            t = load_model("random:llama-tiny", dtype=dtype, attention_backend=backend)
            d = load_model("random:llama-tiny-draft", role="draft", dtype=dtype, attention_backend=backend,
                           vocab_size=t.args.vocab_size, target_weights=t.decoder.w)
            cache[key] = (t, d)
        return cache[key]

    return get



@pytest.fixture(scope="module")
def pair(tiny_models):
    """The float64 tiny (target, draft) pair (a module may define its own `pair`)."""
    return tiny_models("float64")


@pytest.fixture(scope="module")
def ar_engine(pair):
    """Plain decoding on `pair`'s target: the reference of the lossless tests."""
    from helpers import make_engine

    return make_engine(pair, "ar")


@pytest.fixture
def gguf(tmp_path, monkeypatch):
    """A tiny GGUF file (tests/tiny_gguf.py), the model cache in tmp_path (test_model_cache, test_light_meta)."""
    from tests.tiny_gguf import write_tiny_gguf

    monkeypatch.setenv("SPECEXTEND_CACHE", str(tmp_path / "cache"))
    (tmp_path / "src").mkdir()
    return write_tiny_gguf(tmp_path / "src" / "tiny.gguf")
