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


def test_step_transport():
    assert AppSettings().step_transport == "zmq"
    assert AppSettings(step_transport="grpc").step_transport == "grpc"


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
    ("kv_cache_memory_gb", 0), ("target", ""), ("step_transport", "tcp"),
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


@pytest.mark.parametrize("field", ["cuda_graphs", "full_graphs", "torch_compile", "draft_pipeline"])
def test_removed_settings_fail_with_what_replaced_them(field):
    with pytest.raises(ValidationError, match=field) as e:
        AppSettings(num_gpus=0, **{field: True})
    assert ("execution" in str(e.value)) or ("draft_overlap" in str(e.value))


def test_execution_and_overlap_reach_the_engine_config():
    cfg = AppSettings(num_gpus=0).to_engine_config()
    assert cfg.execution == "auto" and cfg.draft_overlap is False  # no own GPU: no overlap
    assert AppSettings(num_gpus=1).to_engine_config().draft_overlap is True
    assert AppSettings(num_gpus=0.5).to_engine_config().draft_overlap is False  # a draft actor on a shared GPU
    # the draft in the replica's process on a shared GPU drafts when asked, unless overlap is set
    assert AppSettings(num_gpus=0.5, draft_in_replica=True).to_engine_config().draft_overlap is False
    assert AppSettings(num_gpus=0.5, draft_in_replica=True, draft_overlap=True).to_engine_config().draft_overlap
    assert AppSettings(num_gpus=0.5, draft_in_replica=True).draft_here and not AppSettings(num_gpus=0.5).draft_here
    assert not AppSettings(num_gpus=0.5, mode="ar", draft_in_replica=True).draft_here
    with pytest.raises(ValidationError, match="draft_in_replica runs the draft on the target's GPU"):
        AppSettings(num_gpus=1, draft_in_replica=True)  # (a second GPU the replica would reserve and not use)
    assert AppSettings(num_gpus=0, draft_overlap=True).to_engine_config().overlap
    assert AppSettings(num_gpus=1, mode="ar").to_engine_config().overlap is False
    with pytest.raises(ValidationError, match="execution"):
        AppSettings(num_gpus=0, execution="sometimes")


def test_serve_arguments_and_cli_flags_come_from_one_schema():
    """Every field of the configuration tree is a Serve argument or a CLI flag (or both), under
    one flat name, with the same default and range: nothing is declared twice."""
    import argparse

    from specextend.cli import CliSettings, _add_generate
    from specextend.config import AppConfig
    from specextend.schema import flat_fields

    fields = flat_fields(AppConfig)
    names = [f.name for f in fields]
    assert len(names) == len(set(names))
    assert set(AppSettings.model_fields) == {f.name for f in fields if "serve" in f.surfaces}
    assert set(CliSettings.model_fields) == {f.name for f in fields if "cli" in f.surfaces}
    for name in set(AppSettings.model_fields) & set(CliSettings.model_fields):
        a, c = AppSettings.model_fields[name], CliSettings.model_fields[name]
        assert (a.annotation, a.metadata, a.description) == (c.annotation, c.metadata, c.description), name
    parser = argparse.ArgumentParser()
    _add_generate(parser.add_subparsers(dest="command"))
    flags = {a.dest for a in parser._subparsers._group_actions[0].choices["generate"]._actions}
    assert set(CliSettings.model_fields) <= flags


def test_cli_and_serve_resolve_mode_defaults_alike():
    import argparse

    from specextend.cli import _add_generate, engine_config

    parser = argparse.ArgumentParser()
    _add_generate(parser.add_subparsers(dest="command"))
    for argv, app in ((["--mode", "sd", "--hybrid-attention"], dict(mode="sd", hybrid_attention=True)),
                      (["--tree-nodes", "8", "--no-retrieval"], dict(tree_nodes=8, retrieval=False)),
                      (["--execution", "eager"], dict(execution="eager"))):
        cli = engine_config(parser.parse_args(["generate", "--prompt", "x", "--device", "cpu", *argv]))
        served = AppSettings(num_gpus=0, **app).to_engine_config()
        assert (cli.mode, cli.hybrid_attention, cli.retrieval, cli.tree, cli.execution) == \
            (served.mode, served.hybrid_attention, served.retrieval, served.tree, served.execution)


def tiny_hf_folder(path: Path) -> Path:
    """A tiny Llama checkpoint with its own (word-level) tokenizer: not the byte tokenizer of the
    random presets."""
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(61)]
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)},
                                                                              unk_token="<unk>")),
                                  unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    config = LlamaConfig(vocab_size=len(words), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_a_mismatched_pair_is_refused_before_deploying(tmp_path):
    """`serve run` with a draft that does not speak the target's token ids fails in the app
    builder, naming both models, before any weights load (and each actor checks again)."""
    from deploy.app import specextend
    from specextend.builder import IncompatibleModels, load_pair
    from specextend.config import EngineConfig

    folder = str(tiny_hf_folder(tmp_path / "other-draft"))
    with pytest.raises(IncompatibleModels, match="tokenizer mismatch") as e:
        specextend({**TINY, "draft": folder, "num_gpus": 0})
    assert "other-draft" in str(e.value) and "random:llama-tiny" in str(e.value)
    with pytest.raises(IncompatibleModels, match="tokenizer mismatch"):
        load_pair(EngineConfig(target="random:llama-tiny", draft=folder, device="cpu"), roles=("draft",))
    specextend({**TINY, "draft": folder, "num_gpus": 0, "mode": "ar"})  # no draft in ar mode: fine
