"""Sessions' KV caches as slots of one tensor, so that a batched round's steps attend in one call a
layer instead of one call per session and layer (docs/architecture.md, "Batched steps").

A pool's data is [slots, layers, 2, G, S_max, D]; a slot is a KVCache over data[slot] (contiguous:
every KVCache operation works on it unchanged). A batching driver owns the pool (scheduler.Batcher,
on the CPU, where each eager op costs microseconds) and hands it to its sessions (session_calls.Load);
a session takes a slot for its target cache and gives it back when the cache is dropped. A request
that needs more than a slot holds, or finds every slot taken, gets a cache of its own, as before.

`pooled_attention` is the batched attention of a round's calls in one pool whose new rows attend
their whole cache (plain steps, trees, lookup chains; `PoolBatch` says where each sits): it writes
their new K/V into their slots (their `stage`) and attends every slot of the batch in one SDPA call
(rows of a slot padded to the most any member has), each row's keys past what it may see masked.
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


class PoolBatch:
    """Where a round's pooled calls sit (built once per forward): member m's T_m rows are rows
    rows[m] of the batch, its keys its slot's committed L_m and its T_m new ones (written at L_m..),
    each row seeing the committed keys and the new ones its mask allows (causal: a plain step's
    one row sees its own; a tree's rows their ancestors'). The batched attention runs S = the
    highest member slot + 1 slots of Tmax rows (the most a member has) over Kmax = max(L_m + T_m)
    keys; rows and slots no member holds see key 0 only (dropped: a fully masked row is NaN)."""

    def __init__(self, slots: list[int], lengths: list[int], masks: list[torch.Tensor], rows: list[int],
                 heads_per_group: int, dtype: torch.dtype):
        sizes = [m.shape[0] for m in masks]  # T_m (a member's mask [T_m, T_m] over its new keys)
        self.s, self.tmax = max(slots) + 1, max(sizes)
        self.kmax = max(l + t for l, t in zip(lengths, sizes))
        slot_of = [s for s, t in zip(slots, sizes) for _ in range(t)]
        tok = [i for t in sizes for i in range(t)]
        self.slot = torch.tensor(slot_of)  # [N] each member row's slot
        self.tok = torch.tensor(tok)  # [N] its place among its member's rows
        self.pos = torch.tensor([l + i for l, t in zip(lengths, sizes) for i in range(t)])  # [N] its new key's
        self.rows = torch.tensor([r + i for r, t in zip(rows, sizes) for i in range(t)])  # [N] its batch row
        # the plain steps' shape with every slot a member's, in order: no scatter or gather
        self.dense = self.tmax == 1 and slots == list(range(self.s))
        see = torch.zeros(self.s, self.tmax, self.kmax, dtype=torch.bool)
        see[:, :, 0] = True
        for slot, length, t, mask in zip(slots, lengths, sizes, masks):
            see[slot, :t] = False
            see[slot, :t, :length] = True
            see[slot, :t, length:length + t] = mask
        bias = torch.zeros(self.s, self.tmax, self.kmax, dtype=dtype).masked_fill_(~see, float("-inf"))
        self.bias = bias[:, None].expand(-1, heads_per_group, -1, -1).reshape(self.s, 1, -1, self.kmax)  # [S, 1, r*Tmax, K]


def pooled_attention(data: torch.Tensor, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     batch: PoolBatch, scale: float, need_lse: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The pooled calls' attention at layer `layer` (their N rows: q [H, N, D]; k, v [G, N, D]):
    writes each row's K/V into its slot at its position (the calls' `stage`), then attends every
    slot at once in one SDPA call. -> out [H, N, D], lse [H, N] (None unless need_lse)."""
    h, n, d = q.shape
    g, r, b = k.shape[0], h // k.shape[0], batch
    kl, vl = data[:, layer, 0], data[:, layer, 1]  # [slots, G, S_max, D]
    kl[b.slot, :, b.pos] = k.transpose(0, 1)  # [N, G, D]
    vl[b.slot, :, b.pos] = v.transpose(0, 1)
    qn = q.transpose(0, 1).reshape(n, g, r, d)  # [N, G, r, D]: a group's r heads share its K/V
    if b.dense:
        qs = qn  # [S, G, r, D] (S = N, Tmax = 1)
    else:
        qs = qn.new_zeros(b.s, g, r, b.tmax, d)
        qs[b.slot, :, :, b.tok] = qn
        qs = qs.view(b.s, g, r * b.tmax, d)  # [S, G, r*Tmax, D]: rows (head, token), as the bias's
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        qs, kl[:b.s, :, :b.kmax], vl[:b.s, :, :b.kmax], 0.0, False, attn_mask=b.bias, scale=scale)[:2]
    if not b.dense:
        out = out.view(b.s, g, r, b.tmax, d)[b.slot, :, :, b.tok]  # [N, G, r, D]
        lse = lse.view(b.s, g, r, b.tmax)[b.slot, :, :, b.tok] if need_lse else None  # [N, G, r]
    out = out.reshape(n, h, d).transpose(0, 1)  # [H, N, D]
    return out, (lse.reshape(n, h).transpose(0, 1) if need_lse else None)
