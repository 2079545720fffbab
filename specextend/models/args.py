"""Model geometry read from a transformers config (one frozen object per model)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class ModelArgs:
    model_type: str
    vocab_size: int
    hidden_size: int  # E
    intermediate_size: int
    num_layers: int
    num_heads: int  # H
    num_kv_heads: int  # G
    head_dim: int  # D
    rms_norm_eps: float
    max_position_embeddings: int
    qkv_bias: bool  # Qwen2/2.5
    qk_norm: bool  # Qwen3
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf_config(cls, config) -> "ModelArgs":
        model_type = config.model_type
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        window = getattr(config, "sliding_window", None)
        if getattr(config, "use_sliding_window", False) or (
            model_type == "mistral" and window and window < config.max_position_embeddings
        ):
            raise ValueError("sliding-window attention models are not supported")
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        eos = config.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        return cls(
            model_type=model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            max_position_embeddings=config.max_position_embeddings,
            qkv_bias=model_type == "qwen2" or bool(getattr(config, "attention_bias", False)),
            qk_norm=model_type == "qwen3",
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
        )

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        elem = torch.tensor([], dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem

    def decode_weights(self) -> int:
        """Weights one decode-time forward multiplies by (every layer's projections and the lm_head;
        not the embedding table, a gather): what its cost grows with, on a CPU or bound by bytes."""
        e, d = self.hidden_size, self.head_dim
        attn = e * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        return self.num_layers * (attn + 3 * e * self.intermediate_size) + self.vocab_size * e

    def num_params(self) -> int:
        """decode_weights, and the embedding table where the lm_head is not the same tensor."""
        return self.decode_weights() + (0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size)
