"""Shared test helpers: tiny models of every architecture, engines over the tiny pair, and
the near-tie rule (docs/architecture.md, "Losslessness in finite precision")."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from specextend.attention.backends import get_backend
from specextend.config import EngineConfig
from specextend.draft.worker import DraftWorker
from specextend.engine import Engine
from specextend.models.args import ModelArgs
from specextend.models.decoder import Decoder
from specextend.models.loader import weights_from_state_dict
from specextend.models.rope import Rope, inv_freq_from_config
from specextend.near_tie import near_tie_check

# tiny configurations of every supported architecture, and our decoder built from transformers' model
COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
CONFIGS = {
    "llama3": lambda: LlamaConfig(**COMMON, rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64, "rope_theta": 500000.0}),
    "llama2": lambda: LlamaConfig(**{**COMMON, "num_key_value_heads": 4}),
    "mistral": lambda: MistralConfig(**COMMON, sliding_window=None),
    "qwen2": lambda: Qwen2Config(**COMMON, tie_word_embeddings=True),
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=24),
}


def build_pair(name, backend="eager"):
    torch.manual_seed(0)
    config = CONFIGS[name]()
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # non-trivial biases/norm weights so that every term is exercised
        for n, p in hf.named_parameters():
            if n.endswith("bias") or "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    args = ModelArgs.from_hf_config(config)
    sd = {k: v.detach() for k, v in hf.state_dict().items()}
    dec = Decoder(args, weights_from_state_dict(sd, args), Rope(*inv_freq_from_config(config)),
                  get_backend(backend, "cpu"))
    return hf, dec


def make_engine(pair, mode="sd", draft_backend=None, join_early=None, prior_from_prefill=None, **kw) -> Engine:
    """An engine over the pair; every step speculative (tree_policy=fixed) unless `kw` says."""
    target, draft = pair
    backend = None if mode == "ar" else (draft_backend or DraftWorker(draft.decoder))
    engine = Engine(EngineConfig(mode=mode, **{"tree_policy": "fixed", **kw}), target, backend)
    if join_early is not None:  # (tests: False unless asked, conftest.py)
        engine.join_early = join_early
    if prior_from_prefill is not None:  # (tests: False unless asked, conftest.py)
        engine.prior_from_prefill = prior_from_prefill
    return engine


def warm_until_costs(engine: Engine, prompt, params, ref=None, tries: int = 5):
    """Cold sessions until one leaves carried costs (engine._costs): it measures a draft level only at
    a tree step that is neither the engine's first nor a catch-up, and on a loaded 2-core host the
    adaptive policy now and then stops taking trees before that (1 cold session in 12 under two CPU
    hogs). Each output equals `ref` where given. -> the last session's stats."""
    for _ in range(tries):
        tokens, _, stats = engine.generate(prompt, params)
        assert ref is None or tokens == ref
        if engine._costs is not None:
            break
    return stats


def assert_equal_or_near_tie(decoder, prompt, ref, out, tol):
    """docs/architecture.md, "Losslessness in finite precision": outputs equal, or the first divergence sits at a near-tie of the target."""
    ok, i, gap = near_tie_check(decoder, prompt, ref, out, tol)
    assert ok, f"divergence at generated position {i} with top-2 gap {gap} (tolerance {tol})"
    return i, gap


def start_local_ray(**kw):
    """ray.init for tests, retried once: on a loaded 2-core machine the GCS or the raylet can miss
    Ray's start-up deadlines (a RuntimeError "Timed out waiting for file .../gcs_server_port", or a
    bare Exception "The current node timed out during startup", which failed one CI run); a clean
    second start succeeds."""
    import subprocess
    import time

    import ray

    kw = dict(address="local", include_dashboard=False, log_to_driver=False, **kw)
    try:
        return ray.init(**kw)
    except Exception:  # noqa: BLE001 - Ray raises bare Exception for a raylet start-up timeout
        ray.shutdown()
        subprocess.run(["ray", "stop", "--force"], capture_output=True, timeout=120)
        time.sleep(5)
        return ray.init(**kw)


def free_port() -> int:
    """A free local port for a served app, below the kernel's ephemeral range and above Ray's worker
    ports (10002-19999). Suites pick their port when pytest collects them and start their app minutes
    later; a port from the ephemeral range (what binding to port 0 gives) can be taken by then by any
    outgoing connection or by one of Ray's own processes, which failed a CI run ("Failed to bind to
    address"). The machine may run other Serve apps (other test runs) on 8000."""
    import random
    import socket

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral = int(f.read().split()[0])
    except OSError:  # not Linux: the IANA ephemeral range's start
        ephemeral = 49152
    for port in random.sample(range(20000, max(ephemeral, 20001)), k=min(200, max(ephemeral - 20000, 1))):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def app_fixture(settings: dict):
    """(port, base URL, a module-scoped `server` fixture that runs the app there): a serve suite's
    `PORT, BASE, server = app_fixture(SETTINGS)`."""
    import pytest

    port = free_port()

    @pytest.fixture(scope="module")
    def server():
        with served_app(settings, port) as handle:
            yield handle

    return port, f"http://127.0.0.1:{port}", server


@contextmanager
def served_app(settings: dict, port: int) -> Iterator:
    """The real Serve app (deploy.app) on a fresh local Ray, HTTP on 127.0.0.1:`port`; yields the
    SpecExtend deployment's handle, and shuts Serve and Ray down after."""
    import ray
    from ray import serve

    from deploy.app import specextend

    start_local_ray(num_cpus=2)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(specextend(dict(settings)), name="specextend", route_prefix="/")
        yield serve.get_deployment_handle("SpecExtend", app_name="specextend")
    finally:
        serve.shutdown()
        ray.shutdown()


# The served tiny pair of the serve suites (test_serve.py, test_serve_ingress.py)
SERVE_TARGET, SERVE_DRAFT = "random:llama-tiny", "random:llama-tiny-draft"
SERVE_SETTINGS = dict(target=SERVE_TARGET, draft=SERVE_DRAFT, num_gpus=0, dtype="float32", tree_nodes=8, tree_depth=4,
                      tree_topk=2, prefill_chunk=32, retrieval_chunk_size=8, retrieval_top_k=4, retrieval_every=2,
                      max_prompt_tokens=256, max_new_tokens=256, max_concurrent_sessions=4,
                      max_queued_requests=12, draft_overlap=True,  # overlapped drafting: lossless, every check holds
                      max_request_bytes=4 << 20, request_read_timeout_s=3)
# 90 tokens: above the CMR budget (32 tokens) and prefilled in 3 chunks, other sessions' steps between
SERVE_PROMPT = "The quick brown fox jumps over the lazy dog. " * 2


def speculated(create, ref, tries=5):
    """The first of up to `tries` responses of `create()` that verified a tree, each checked against
    `ref` (the target's greedy ids). A session decodes plainly until its draft's open is done
    (docs/architecture.md, "Adaptive speculation"): on a loaded CPU a short request may end first."""
    for _ in range(tries):
        out = create()
        assert out.choices[0].token_ids == ref
        if out.model_extra["speculative_decoding"]["num_steps"] >= 1:
            break
    return out


def openai_client(base: str, api_key: str = "unused", timeout: float = 120):
    """The official `openai` client of a served app at `base` (no retries: a test sees every failure)."""
    from openai import OpenAI

    return OpenAI(base_url=f"{base}/v1", api_key=api_key, max_retries=0, timeout=timeout)


def chat_ids(tokenizer, messages):
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def stream_ids(stream):
    """(token ids, text, last chunk with a finish_reason, usage) of an openai stream."""
    ids, text, last, usage = [], "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            ids += getattr(choice, "token_ids", None) or []
            text += choice.text if hasattr(choice, "text") else (choice.delta.content or "")
            if choice.finish_reason:
                last = chunk
    return ids, text, last, usage


def served_target_greedy():
    """The served tiny target alone, in float32 as the serve suites serve it: `run(ids, n)` -> its
    greedy ids (with `.tokenizer`), the reference of a served app's output."""
    import torch

    from specextend.config import EngineConfig, SamplingParams
    from specextend.engine import Engine
    from specextend.models.loader import load_model

    torch.set_num_threads(1)
    target = load_model(SERVE_TARGET, dtype="float32", attention_backend="auto")
    engine = Engine(EngineConfig(mode="ar", dtype="float32"), target)

    def run(ids, n):
        return engine.generate(ids, SamplingParams(max_new_tokens=n, ignore_eos=True))[0]

    run.tokenizer = target.tokenizer
    return run


def slow_target(target, seconds=0.02):
    """`target` (its decoder copied) whose every forward first sleeps `seconds`: forwards that cost a
    known least, whatever the machine (trees that pay where the tiny pair's plain step on a CPU costs
    about what a draft level does: CI, 2026-11-30; a lookup run's readings of at least it)."""
    import copy
    import dataclasses
    import time

    decoder, forward = copy.copy(target.decoder), target.decoder.forward

    def slow(*a, **kw):
        time.sleep(seconds)
        return forward(*a, **kw)

    decoder.forward = slow
    return dataclasses.replace(target, decoder=decoder)

