"""`random:<preset>` model specs: real geometries with seeded random weights, and tiny test models.

The tiny pair: `llama-tiny` (target) and `llama-tiny-draft`, a *correlated* copy of the target
(its first layers plus small noise, sharing embeddings and head) so that acceptance is substantial
and every acceptance length occurs (docs/architecture.md, "Losslessness in finite precision"). The target's later layers are scaled down so the
draft, which lacks them, agrees with it most of the time but not always.

`<preset>-succ` (any other preset): the geometry with *successor* weights (`successor_weights`): every
such model ranks the same few tokens first after each token, with a real draft's confidence, so
that a replayed pair's drafts, plain steps and bonus tokens behave as a real pair's do
(docs/architecture.md, "Models").
"""

from __future__ import annotations

import torch

from specextend.models.args import ModelArgs
from specextend.models.decoder import LayerWeights, Weights

_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

PRESETS: dict[str, dict] = {
    "llama-3.1-8b": dict(arch="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         max_position_embeddings=131072,
                         rope_parameters={**_LLAMA3_ROPE, "factor": 8.0, "rope_theta": 500000.0}),
    "llama-3.2-1b": dict(arch="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         max_position_embeddings=131072, tie_word_embeddings=True,
                         rope_parameters={**_LLAMA3_ROPE, "factor": 32.0, "rope_theta": 500000.0}),
    "llama-68m": dict(arch="llama", vocab_size=32000, hidden_size=768, intermediate_size=3072,
                      num_hidden_layers=2, num_attention_heads=12, num_key_value_heads=12,
                      max_position_embeddings=2048),
    "qwen2.5-0.5b": dict(arch="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         max_position_embeddings=32768, tie_word_embeddings=True, rope_theta=1e6),
    "qwen2.5-1.5b": dict(arch="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         max_position_embeddings=32768, tie_word_embeddings=True, rope_theta=1e6),
    "llama-tiny": dict(arch="llama", vocab_size=259, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       max_position_embeddings=8192, tie_word_embeddings=False),
}
TINY_DRAFT = "llama-tiny-draft"
TINY_DRAFT_LAYERS = 2
TINY_LATE_LAYER_SCALE = 0.35  # output projections of the target's layers the draft lacks
TINY_DRAFT_NOISE = 0.004  # relative to each weight matrix's std
SUCCESSOR = "-succ"  # preset suffix: successor weights
PRESET_NAMES = tuple(PRESETS) + (TINY_DRAFT,) + tuple(p + SUCCESSOR for p in PRESETS if p != "llama-tiny")
SEED = 1234
# successor weights: the logit (above a flat tail of about one per token) of each token's k-th
# successor, and the scale of every layer's output projections (the layers barely move the stream)
SUCC_LOGITS = (14.0, 12.0, 11.0, 10.0)
SUCC_LAYER_SCALE = 0.0005


def successor_of(preset: str) -> str | None:
    """The base preset of a `-succ` name, else None."""
    base = preset[:-len(SUCCESSOR)] if preset.endswith(SUCCESSOR) else None
    return base if base in PRESETS and base != "llama-tiny" else None


def hf_config(preset: str, vocab_size: int | None = None):
    succ = successor_of(preset)
    if preset == TINY_DRAFT:
        preset = "llama-tiny"
    preset = succ or preset
    if preset not in PRESETS:
        raise ValueError(f"unknown random preset {preset!r}; known: {', '.join(PRESET_NAMES)}")
    kw = dict(PRESETS[preset])
    arch = kw.pop("arch")
    if vocab_size is not None:
        kw["vocab_size"] = vocab_size
    if succ:
        kw["tie_word_embeddings"] = False  # (successor_weights: the head is its own tensor)
    if "rope_theta" in kw:
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": kw.pop("rope_theta")}
    from transformers import LlamaConfig, Qwen2Config  # (here: importing it takes seconds)

    cls = Qwen2Config if arch == "qwen2" else LlamaConfig
    return cls(eos_token_id=[256, 258], bos_token_id=None, pad_token_id=256, **kw)  # byte tokenizer ids


def random_weights(args: ModelArgs, seed: int, dtype: torch.dtype, device, embed_std: float = 0.02,
                   layer_scales: list[float] | None = None, head: bool = True) -> Weights:
    """Seeded normal weights, generated directly on `device` in float32 then cast. `head` False: an
    untied head is not drawn (the caller builds its own; it is the generator's last draw, so every
    other weight is the same) and the embedding stands in for it."""
    gen = torch.Generator(device=device).manual_seed(seed)
    e, i, d = args.hidden_size, args.intermediate_size, args.head_dim
    h, g = args.num_heads, args.num_kv_heads

    def rnd(*shape, std=0.02):
        return (torch.randn(*shape, generator=gen, device=device) * std).to(dtype)

    def ones(n):
        return torch.ones(n, dtype=dtype, device=device)

    layers = []
    for li in range(args.num_layers):
        s = 1.0 if layer_scales is None else layer_scales[li]
        layers.append(LayerWeights(
            qkv=rnd((h + 2 * g) * d, e), qkv_bias=rnd((h + 2 * g) * d) if args.qkv_bias else None,
            o=rnd(e, h * d, std=0.02 * s), q_norm=ones(d) if args.qk_norm else None,
            k_norm=ones(d) if args.qk_norm else None, gate_up=rnd(2 * i, e), down=rnd(e, i, std=0.02 * s),
            input_norm=ones(e), post_norm=ones(e)))
    embed = rnd(args.vocab_size, e, std=embed_std)
    lm_head = embed if args.tie_word_embeddings or not head else rnd(args.vocab_size, e)
    return Weights(embed=embed, layers=layers, norm=ones(e), lm_head=lm_head)


def successor_weights(args: ModelArgs, dtype, device, seed: int = SEED) -> Weights:
    """Random weights whose greedy next token is a fixed function of the current one, the same for
    every model of any geometry and seed (with the same vocabulary): row v of the head is the sum of
    c_k * embed[perm_k[v]] over a few seeded permutations, so the current token x's embedding (the
    layers' outputs are scaled down to a small share of the stream) scores v = perm_k^-1(x) about
    SUCC_LOGITS[k] above the flat rest of the vocabulary (noise of std SUCC_LOGITS / sqrt(E)). A
    draft's probabilities then fall as a real one's do (on average 0.67, 0.14, 0.05, 0.02 for its
    first four with the 68M geometry and a 128K vocabulary, the rest spread thin), its first two
    now and then swapped where E is small (2% of tokens for the 68M, E = 768). Speed is the preset's: same shapes, weights of normal magnitudes."""
    e = args.hidden_size
    w = random_weights(args, seed, dtype, device, layer_scales=[SUCC_LAYER_SCALE] * args.num_layers, head=False)
    gen = torch.Generator().manual_seed(SEED + 2)  # not `seed`: every model gets the same successors
    head = torch.zeros(args.vocab_size, e, dtype=torch.float32, device=device)  # [V, E]
    for logit in SUCC_LOGITS:
        perm = torch.randperm(args.vocab_size, generator=gen).to(device)  # [V]
        head.add_(w.embed[perm].float(), alpha=logit / (0.02 * e))  # h . embed[x] = 0.02 E for RMS-normed h
    w.lm_head = head.to(dtype)
    return w


def tiny_target_weights(args: ModelArgs, dtype, device) -> Weights:
    scales = [1.0 if li < TINY_DRAFT_LAYERS else TINY_LATE_LAYER_SCALE for li in range(args.num_layers)]
    w = random_weights(args, SEED, torch.float64, "cpu", embed_std=0.1, layer_scales=scales)
    for lw in w.layers:  # larger attention/MLP weights so that each layer matters
        lw.qkv.mul_(30)
        lw.gate_up.mul_(30)
    w.lm_head.mul_(100)  # peaky logits (an untied head, so the model does not just copy its input)
    return w.to(device=device, dtype=dtype)


def tiny_draft_weights(target: Weights, dtype, device, noise: float = TINY_DRAFT_NOISE) -> Weights:
    """First TINY_DRAFT_LAYERS layers of the tiny target plus seeded noise; embeddings/head shared."""
    gen = torch.Generator().manual_seed(SEED + 1)
    src = target.to(device="cpu", dtype=torch.float64)
    layers = []
    for lw in src.layers[:TINY_DRAFT_LAYERS]:
        fields = {}
        for k in LayerWeights.__dataclass_fields__:
            x = getattr(lw, k)
            if x is not None and x.dim() == 2:
                x = x + torch.randn(x.shape, generator=gen, dtype=torch.float64) * noise * x.std()
            fields[k] = x
        layers.append(LayerWeights(**fields))
    w = Weights(embed=src.embed, layers=layers, norm=src.norm, lm_head=src.lm_head)
    return w.to(device=device, dtype=dtype)
