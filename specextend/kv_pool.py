"""Sessions' KV caches as slots of one tensor, so that a batched round's decode steps attend in one
call instead of one call per session and layer (docs/architecture.md, "Batched steps").

A pool's data is [slots, layers, 2, G, S_max, D]; a slot is a KVCache over data[slot] (contiguous:
every KVCache operation works on it unchanged). A batching driver owns the pool (scheduler.Batcher,
on the CPU, where each eager op costs microseconds) and hands it to its sessions (session_calls.Load);
a session takes a slot for its target cache and gives it back when the cache is dropped. A request
that needs more than a slot holds, or finds every slot taken, gets a cache of its own, as before.

`decode_attention` is the batched attention of calls whose one new token attends its whole cache
(a plain decode step): it writes their new K/V into their slots (their `stage`) and attends every
slot of the batch over [0, max length] in one SDPA call, each slot's keys past its own length masked.
Its twin is the per-call path (Decoder.attend through hybrid.layer_attention); tests compare them.
"""

from __future__ import annotations

import threading
import weakref
from typing import Optional

import torch

from specextend.kv_cache import KVCache
from specextend.models.args import ModelArgs

POOL_BYTES = 64 << 20  # a pool's size: slots x slot capacity x per-token bytes within this
SLOT_MARGIN = 64  # a slot's room past the model's context (a request's cache holds its tree's staged rows too)


class KVPool:
    def __init__(self, args: ModelArgs, dtype: torch.dtype, device: torch.device | str, slots: int,
                 max_bytes: int = POOL_BYTES):
        self.args, self.dtype, self.device, self.slots = args, dtype, torch.device(device), slots
        per_token = args.kv_bytes_per_token(dtype)
        # S_max of a slot: the model's context and a step's staged rows past it, within max_bytes
        self.capacity = min(args.max_position_embeddings + SLOT_MARGIN, max_bytes // max(slots * per_token, 1))
        self.data: Optional[torch.Tensor] = None  # allocated (zeroed) at the first take
        self._free = list(range(slots))
        self._lock = threading.Lock()

    def take(self, capacity: int) -> Optional[KVCache]:
        """A cache of at least `capacity` tokens over a free slot; None: too large, or none free."""
        if capacity > self.capacity:
            return None
        with self._lock:
            if not self._free:
                return None
            slot = self._free.pop(0)  # (the lowest: a round's slots stay few, its attention narrow)
            if self.data is None:  # zeroed once: a slot only ever holds finite K/V, which the masked
                a = self.args  # attention of a batch reads past a slot's own length
                self.data = torch.zeros(self.slots, a.num_layers, 2, a.num_kv_heads, self.capacity, a.head_dim,
                                        dtype=self.dtype, device=self.device)
        cache = KVCache.over(self.data[slot], pool=self, slot=slot)
        weakref.finalize(cache, self._give_back, slot)
        return cache

    def _give_back(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)
            self._free.sort()

    @property
    def free(self) -> int:
        with self._lock:
            return len(self._free)


def decode_attention(data: torch.Tensor, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     slots: torch.Tensor, lengths: torch.Tensor, bias: torch.Tensor, scale: float,
                     need_lse: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """n decode calls of one pool at layer `layer`: q [H, n, D], k, v [G, n, D] (one row each);
    slots, lengths [n] (each call's slot and committed length); bias [S, 1, 1, Lmax] (from
    `decode_bias`: S = the highest slot + 1, Lmax = the longest length + 1). Writes each row's K/V
    at its slot's position `length`, then attends the S slots at once. -> out [H, n, D], lse [H, n]."""
    h, n, d = q.shape
    g = k.shape[0]
    s, lmax = bias.shape[0], bias.shape[-1]
    kl, vl = data[:, layer, 0], data[:, layer, 1]  # [slots, G, S_max, D]
    kl[slots, :, lengths] = k.transpose(0, 1)  # [n, G, D] (the calls' stage)
    vl[slots, :, lengths] = v.transpose(0, 1)
    qn = q.transpose(0, 1).reshape(n, g, h // g, d)  # [n, G, H/G, D]: a group's heads share its K/V
    dense = n == s and bool((slots == torch.arange(n)).all())
    qs = qn if dense else qn.new_zeros(s, g, h // g, d).index_copy_(0, slots, qn)  # [S, G, H/G, D]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        qs, kl[:s, :, :lmax], vl[:s, :, :lmax], 0.0, False, attn_mask=bias, scale=scale)[:2]
    if not dense:
        out, lse = out.index_select(0, slots), lse.index_select(0, slots)
    out = out.reshape(n, h, d).transpose(0, 1)  # [H, n, D]
    return out, (lse.reshape(n, h).transpose(0, 1) if need_lse else None)


def decode_bias(slots: list[int], lengths: list[int], dtype: torch.dtype) -> torch.Tensor:
    """[S, 1, 1, Lmax] additive mask of `decode_attention`: slot s (a call's) sees keys 0..length
    (its committed ones and its new one); a slot no call holds sees key 0 only (its row is dropped:
    a fully masked row would be NaN)."""
    s, lmax = max(slots) + 1, max(lengths) + 1
    see = torch.zeros(s, dtype=torch.long)  # the last key each slot sees
    see[torch.tensor(slots)] = torch.tensor(lengths)
    keys = torch.arange(lmax)
    bias = torch.zeros(s, lmax, dtype=dtype).masked_fill_(keys[None, :] > see[:, None], float("-inf"))
    return bias[:, None, None, :]
