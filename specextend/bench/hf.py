"""The external anchor: transformers `generate`, plain and with assisted generation (its
speculative decoding), on the weights our engine loaded, on the same device (docs/architecture.md,
"Baselines").

Our decoder's weights are handed to a transformers model of the same config without a copy
(`load_state_dict(assign=True)` on views), so the anchor runs exactly the model we serve, whatever
its source (GGUF, folder, random preset).
"""

from __future__ import annotations

import time
from typing import Optional

import torch

from specextend.models.loader import LoadedModel


def state_dict(model: LoadedModel) -> dict[str, torch.Tensor]:
    """transformers' parameter names for our Weights (the inverse of loader.weights_from_state_dict)."""
    a, w = model.args, model.decoder.w
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    sd = {"model.embed_tokens.weight": w.embed, "model.norm.weight": w.norm, "lm_head.weight": w.lm_head}
    for i, lw in enumerate(w.layers):
        p = f"model.layers.{i}."
        s = p + "self_attn."
        sd[s + "q_proj.weight"], sd[s + "k_proj.weight"], sd[s + "v_proj.weight"] = lw.qkv.split([q, kv, kv])
        if lw.qkv_bias is not None:
            sd[s + "q_proj.bias"], sd[s + "k_proj.bias"], sd[s + "v_proj.bias"] = lw.qkv_bias.split([q, kv, kv])
        if lw.q_norm is not None:
            sd[s + "q_norm.weight"], sd[s + "k_norm.weight"] = lw.q_norm, lw.k_norm
        sd[s + "o_proj.weight"] = lw.o
        sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"] = lw.gate_up.split(a.intermediate_size)
        sd[p + "mlp.down_proj.weight"] = lw.down
        sd[p + "input_layernorm.weight"], sd[p + "post_attention_layernorm.weight"] = lw.input_norm, lw.post_norm
    return sd


def hf_model(model: LoadedModel):
    """A transformers causal LM sharing `model`'s weights (same dtype and device)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # generate's notes on argument precedence, once per call
    dec = model.decoder
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(model.hf_config, dtype=dec.dtype)
    sd = state_dict(model)
    if "lm_head.weight" not in hf.state_dict():
        sd.pop("lm_head.weight")
    hf.load_state_dict(sd, assign=True, strict=True)
    hf.tie_weights() if model.args.tie_word_embeddings else None
    hf.generation_config.eos_token_id = None  # runs to max_new_tokens, EOS included, like ignore_eos
    # buffers (rotary inv_freq) were created on meta: rebuild the rotary module on the device
    for name, module in hf.named_modules():
        if name.endswith("rotary_emb"):
            with torch.device(dec.device):
                fresh = type(module)(config=model.hf_config)
            parent = hf.get_submodule(name.rsplit(".", 1)[0])
            setattr(parent, "rotary_emb", fresh)
    return hf.eval()


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class _FirstToken:
    """A transformers streamer that notes when the first new token arrives (its first `put` is
    the prompt)."""

    def __init__(self, dev: torch.device):
        self.dev, self.puts, self.at = dev, 0, None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2 and self.at is None:
            _sync(self.dev)
            self.at = time.perf_counter()

    def end(self) -> None:
        pass


def generate(hf, prompt: list[int], new_tokens: int, assistant=None) -> tuple[list[int], dict]:
    """Greedy `generate` of exactly `new_tokens` tokens (EOS emitted and ignored, as our engine's
    `ignore_eos` does: hf_model clears the stop ids; `min_new_tokens` would forbid EOS instead and
    change the output), with `assistant` as assisted
    generation's draft; time to first token from a streamer in the same call."""
    dev = hf.device
    ids = torch.tensor([prompt], device=dev)
    kw = dict(do_sample=False, pad_token_id=0)
    if assistant is not None:
        kw["assistant_model"] = assistant
    with torch.inference_mode():
        hf.generate(ids[:, :64], attention_mask=torch.ones_like(ids[:, :64]), max_new_tokens=4, **kw)  # warm-up
        first = _FirstToken(dev)
        _sync(dev)
        t0 = time.perf_counter()
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, streamer=first,
                          **kw)
        _sync(dev)
        total = time.perf_counter() - t0
    tokens = out[0, len(prompt):].tolist()
    ttft = (first.at or t0 + total) - t0
    decode_s = max(total - ttft, 1e-9)
    return tokens, dict(tokens_per_s=len(tokens) / total, decode_tokens_per_s=(len(tokens) - 1) / decode_s,
                        ttft_s=ttft)


def anchors(target: LoadedModel, draft: Optional[LoadedModel]):
    """{'hf': (model, None), 'hf-assisted': (model, assistant)}; the assistant only with a draft."""
    hf = hf_model(target)
    out = {"hf": (hf, None)}
    if draft is not None:
        out["hf-assisted"] = (hf, hf_model(draft))
    return out
