"""Rotary position embeddings (HF "rotate half" layout), including llama3/yarn/linear scaling.

Inverse frequencies come from transformers' own RoPE initialisers, so every scaling type that
transformers supports is computed exactly as it computes it.
"""

from __future__ import annotations

import torch


def inv_freq_from_config(config) -> tuple[torch.Tensor, float]:
    """Returns inv_freq [D/2] (float32) and the attention scaling factor for cos/sin."""
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dim = int(dim * params.get("partial_rotary_factor", 1.0))
        inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return inv, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return inv.float(), float(scaling)


class Rope:
    def __init__(self, inv_freq: torch.Tensor, scaling: float = 1.0):
        self.inv_freq = inv_freq  # [D/2] float32
        self.scaling = scaling
        self._tables: dict = {}  # dtype -> (cos, signed sin, its negation) [N, D] for positions 0..N-1

    def to(self, device) -> "Rope":
        return Rope(self.inv_freq.to(device), self.scaling)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> cos, signed sin [T, D] in `dtype` (computed in float32/float64).

        The signed sine is [-sin, sin] over the two halves, so that apply_rope needs no negation."""
        cd = torch.float64 if dtype == torch.float64 else torch.float32
        ang = positions.to(cd)[:, None] * self.inv_freq.to(positions.device, cd)[None, :]  # [T, D/2]
        emb = torch.cat([ang, ang], dim=-1)  # [T, D]
        sin = emb.sin() * self.scaling
        sin = torch.cat([-sin[:, : sin.shape[1] // 2], sin[:, sin.shape[1] // 2:]], dim=-1)
        return (emb.cos() * self.scaling).to(dtype), sin.to(dtype)


    def span(self, lo: int, n: int, dtype: torch.dtype, inverse: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """cos_sin of positions lo..lo+n-1 as views of a table computed once per dtype (grown by
        doubling): no kernels on the host's path (the draft's re-roots and rebuilds call this
        between forwards; cos_sin is ~10 small ops). `inverse`: the signed sine negated, so that
        apply_rope undoes the rotation (times scaling**2)."""
        table = self._tables.get(dtype)
        if table is None or table[0].shape[0] < lo + n:
            size = max(1024, 1 << (lo + n - 1).bit_length())
            cos, sin = self.cos_sin(torch.arange(size, device=self.inv_freq.device), dtype)
            table = self._tables[dtype] = (cos, sin, -sin)
        return table[0][lo:lo + n], table[2 if inverse else 1][lo:lo + n]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x [..., T, D]; cos, signed sin [T, D] (Rope.cos_sin). HF's rotate-half form
    x * cos + cat(-x2, x1) * sin, written as x * cos + roll(x, D/2) * [-sin, sin]: three kernels."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin_signed)
