"""Our compact decoder against transformers' own forward, per architecture."""

import pytest
import torch
from transformers import (AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config,
                          Qwen3Config)

from specextend.attention.backends import CAUSAL, get_backend
from specextend.models.args import ModelArgs
from specextend.models.decoder import Decoder
from specextend.models.loader import weights_from_state_dict
from specextend.models.rope import Rope, inv_freq_from_config

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


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("backend", ["eager", "torch"])
def test_forward_matches_transformers(name, backend):
    hf, dec = build_pair(name, backend)
    ids = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    cache = dec.new_cache(64)
    logits, _ = dec.forward(ids, torch.arange(40), cache, CAUSAL)
    torch.testing.assert_close(logits, ref, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["llama3", "qwen3"])
def test_incremental_decode_equals_full_recompute(name):
    _, dec = build_pair(name)
    ids = torch.randint(0, 97, (30,), generator=torch.Generator().manual_seed(2))
    full, _ = dec.forward(ids, torch.arange(30), dec.new_cache(64), CAUSAL)
    cache = dec.new_cache(64)
    rows = []
    # chunked prefill (12 + 9) then one token at a time
    for lo, hi in [(0, 12), (12, 21)] + [(i, i + 1) for i in range(21, 30)]:
        out, _ = dec.forward(ids[lo:hi], torch.arange(lo, hi), cache, CAUSAL)
        cache.advance(hi - lo)
        rows.append(out)
    torch.testing.assert_close(torch.cat(rows), full, atol=1e-4, rtol=1e-4)
