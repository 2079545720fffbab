"""KV cache of one sequence, preallocated, with named operations only.

Layout: data [layers, 2, G, S_max, D] (k = data[:, 0], v = data[:, 1]). Slots [0, length) hold
committed tokens. A forward `stage`s its T new tokens into [length, length + T); the caller then
either `advance`s (prefill / decode: keep them all) or `commit`s a subset (tree verification:
gather the accepted nodes into contiguous slots, drop the rest).
"""

from __future__ import annotations

from typing import Optional

import torch


class CacheFull(RuntimeError):
    pass


class KVCache:
    pool = None  # the KVPool whose slot this is (kv_pool.py), else None
    slot = -1

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", data: Optional[torch.Tensor] = None):
        self.capacity = capacity
        self.data = (torch.zeros(num_layers, 2, num_kv_heads, capacity, head_dim, dtype=dtype, device=device)
                     if data is None else data)  # [layers, 2, G, S_max, D]
        self.length = 0
        # each layer's k, v views, made once: an eager decode step asks for them every layer, and on
        # the CPU each view op costs microseconds (docs/architecture.md, "Batched steps")
        self._layers = [(self.data[i, 0], self.data[i, 1]) for i in range(num_layers)]

    @classmethod
    def over(cls, data: torch.Tensor, pool=None, slot: int = -1) -> "KVCache":
        """A cache over `data` [layers, 2, G, S_max, D] (contiguous; a pool's slot), empty."""
        layers, _, g, cap, d = data.shape
        cache = cls(layers, g, d, cap, data.dtype, data.device, data=data)
        cache.pool, cache.slot = pool, slot
        return cache

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [G, S_max, D] views of layer i."""
        return self._layers[i]

    def stage(self, layer: int, k: torch.Tensor, v: torch.Tensor, offset: int = 0) -> None:
        """Write T new tokens' k, v [G, T, D] at `offset` after the committed prefix (uncommitted)."""
        lo = self.length + offset
        t = k.shape[1]
        if lo + t > self.capacity:
            raise CacheFull(f"KV cache full: {lo} + {t} > {self.capacity}")
        kl, vl = self._layers[layer]
        kl[:, lo:lo + t].copy_(k)
        vl[:, lo:lo + t].copy_(v)

    def stage_all(self, k: torch.Tensor, v: torch.Tensor, offset: int = 0) -> None:
        """`stage` for every layer at once: k, v [layers, G, T, D] (the step graphs' scratch)."""
        lo = self.length + offset
        t = k.shape[2]
        if lo + t > self.capacity:
            raise CacheFull(f"KV cache full: {lo} + {t} > {self.capacity}")
        self.data[:, 0, :, lo:lo + t].copy_(k)
        self.data[:, 1, :, lo:lo + t].copy_(v)

    def staged(self, offset: int, t: int) -> torch.Tensor:
        """View [layers, 2, G, t, D] of the staged slots [length + offset, length + offset + t)."""
        lo = self.length + offset
        return self.data[:, :, :, lo:lo + t]

    def committed(self) -> torch.Tensor:
        """View [layers, 2, G, length, D] of the committed tokens."""
        return self.data[:, :, :, :self.length]

    def advance(self, t: int) -> None:
        """Commit all T staged tokens (append)."""
        self.length += t

    def commit(self, staged_index: torch.Tensor) -> None:
        """Keep staged tokens staged_index [m] (offsets from `length`, increasing), in order."""
        m = staged_index.numel()
        src = staged_index.to(self.data.device) + self.length  # [m]
        # one gather over all layers and both k/v
        self.data[:, :, :, self.length:self.length + m] = self.data.index_select(3, src)
        self.length += m

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} to {length}")
        self.length = length

    def load(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Replace the whole content by k, v [layers, G, W, D] (draft working-cache rebuild)."""
        w = k.shape[2]
        if w > self.capacity:
            raise CacheFull(f"KV cache full: {w} > {self.capacity}")
        self.data[:, 0, :, :w] = k
        self.data[:, 1, :, :w] = v
        self.length = w

    def load_prefix(self, kv: torch.Tensor) -> None:
        """Start an empty cache from kv [layers, 2, G, m, D] (a cached prompt prefix, prefix_cache.py)."""
        m = kv.shape[3]
        if self.length:
            raise ValueError("a prefix goes into an empty cache")
        if m > self.capacity:
            raise CacheFull(f"KV cache full: {m} > {self.capacity}")
        self.data[:, :, :, :m].copy_(kv)
        self.length = m
