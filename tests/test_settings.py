"""AppSettings (the Serve arguments) validate at the boundary and fail fast, naming the field."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from specextend.serving.settings import AppSettings, InsufficientGPUsError, check_gpus

from helpers import start_local_ray

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.filterwarnings("ignore::pydantic.warnings.PydanticDeprecatedSince20")
TINY = dict(target="random:llama-tiny", draft="random:llama-tiny-draft")


def test_defaults():
    s = AppSettings()
    assert (s.target, s.draft, s.mode) == ("default", "default", "specextend")
    import torch

    assert s.num_gpus == (1 if torch.cuda.is_available() else 0)


def test_cli_strings_are_coerced():
    s = AppSettings(num_gpus="0", tree_nodes="8", draft_timeout_s="2.5", max_prompt_tokens="100")
    assert (s.num_gpus, s.tree_nodes, s.draft_timeout_s, s.max_prompt_tokens) == (0, 8, 2.5, 100)


def test_unknown_field_is_named():
    with pytest.raises(ValidationError) as e:
        AppSettings(tree_nodez=8)
    assert "tree_nodez" in str(e.value) and "extra_forbidden" in str(e.value)


@pytest.mark.parametrize("field,value", [
    ("tree_nodes", 0), ("tree_depth", -1), ("tree_topk", 0), ("retrieval_chunk_size", 0),
    ("retrieval_top_k", 0), ("retrieval_every", 0), ("retrieval_sink_chunks", -1),
    ("draft_prefill_window", -1), ("num_gpus", -1), ("num_gpus", 1.5), ("max_prompt_tokens", 0),
    ("max_new_tokens", 0), ("max_concurrent_sessions", 0), ("max_queued_requests", -1),
    ("draft_timeout_s", 0), ("mode", "fast"), ("dtype", "int8"), ("attention_backend", "cudnn"),
    ("kv_cache_memory_gb", 0), ("target", ""),
])
def test_bad_values_are_rejected_with_the_field_named(field, value):
    with pytest.raises(ValidationError) as e:
        AppSettings(**{field: value})
    assert field in str(e.value)


def test_cross_field_check_from_the_engine_config():
    with pytest.raises(ValidationError, match="retrieval_sink_chunks"):
        AppSettings(retrieval_top_k=2, retrieval_sink_chunks=2, retrieval_recent_chunks=1)


def test_to_engine_config():
    cfg = AppSettings(num_gpus=0, tree_nodes=8, retrieval_top_k=4).to_engine_config()
    assert cfg.mode == "specextend" and cfg.hybrid_attention and cfg.retrieval.enabled
    assert (cfg.retrieval.draft_prefill_window, cfg.retrieval.top_k, cfg.tree.nodes) == (512, 4, 8)
    assert cfg.device == "cpu"
    sd = AppSettings(mode="sd", num_gpus=1).to_engine_config()
    assert not sd.retrieval.enabled and sd.retrieval.draft_prefill_window == 0 and sd.device == "cuda"
    window = AppSettings(draft_prefill_window=0).to_engine_config()
    assert window.retrieval.enabled and window.retrieval.draft_prefill_window == 0


def test_gpu_check_message():
    check_gpus(AppSettings(num_gpus=0), [], None)  # CPU: nothing to check
    check_gpus(AppSettings(num_gpus=1), [0, 2], None)  # one node with the pair
    check_gpus(AppSettings(num_gpus=1), [0], 8)  # the autoscaler can add GPU nodes
    check_gpus(AppSettings(num_gpus=1, mode="ar"), [1], None)  # AR: no draft GPU
    with pytest.raises(InsufficientGPUsError) as e:
        check_gpus(AppSettings(num_gpus=1), [1, 1], None)  # STRICT_PACK: two GPUs on one node
    msg = str(e.value)
    assert "num_gpus=1 needs 2 GPU(s) on one node" in msg and "target + draft" in msg and "num_gpus=0" in msg


def test_builder_fails_fast_on_a_cluster_without_gpus():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    from deploy.app import specextend

    start_local_ray(num_cpus=1, num_gpus=0)
    try:
        with pytest.raises(InsufficientGPUsError, match="num_gpus=1 needs 2 GPU"):
            specextend({**TINY, "num_gpus": 1})
        with pytest.raises(InsufficientGPUsError, match=r"\(target\)"):
            specextend({**TINY, "num_gpus": "1", "mode": "ar"})
        assert specextend({**TINY, "num_gpus": 0}) is not None
    finally:
        ray.shutdown()


def test_serve_run_rejects_a_bad_argument_before_deploying():
    serve = Path(sys.executable).with_name("serve")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.run([str(serve), "run", "deploy.app:specextend", "tree_nodes=0", "num_gpus=0"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "tree_nodes" in proc.stderr and "greater than or equal to 1" in proc.stderr
    assert "Started a local Ray instance" not in proc.stdout + proc.stderr


def test_cuda_graphs_setting_reaches_the_engine_config():
    assert AppSettings(num_gpus=0).to_engine_config().cuda_graphs is True
    assert AppSettings(num_gpus=0, cuda_graphs=False).to_engine_config().cuda_graphs is False
    with pytest.raises(ValidationError, match="cuda_graphs"):
        AppSettings(num_gpus=0, cuda_graphs="sometimes")


@pytest.mark.parametrize("field,default", [("full_graphs", True), ("torch_compile", False)])
def test_graph_settings_reach_the_engine_config(field, default):
    assert getattr(AppSettings(num_gpus=0).to_engine_config(), field) is default
    assert getattr(AppSettings(num_gpus=0, **{field: not default}).to_engine_config(), field) is (not default)
    with pytest.raises(ValidationError, match=field):
        AppSettings(num_gpus=0, **{field: "sometimes"})


def test_graph_flags_reach_the_engine_config():
    import argparse

    from specextend.cli import _add_generate, engine_config

    parser = argparse.ArgumentParser()
    _add_generate(parser.add_subparsers(dest="command"))
    cfg = engine_config(parser.parse_args(["generate", "--prompt", "x", "--no-full-graphs", "--torch-compile"]))
    assert cfg.full_graphs is False and cfg.torch_compile is True
