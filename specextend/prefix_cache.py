"""Prefix caching on the target: the K/V of recent prompts, reused by a later prompt that starts
with the same tokens (many questions over one long document; docs/architecture.md, "Prefix caching").

Only whole prefill chunks are reused: a prompt is prefilled one `chunk` of tokens per forward
from position 0, so the K/V of its first k chunks are what the same k chunks of any prompt that
starts with them compute, forward for forward. A hit copies those k chunks' K/V into the new
session's cache and the prefill goes on from chunk k, as it would have: the output is the one
without the cache (bitwise where the forwards run alone), and a prompt's last token is always
forwarded (its logits and the retrieval's capture come from that forward).

Entries are found by a chain of hashes, one per chunk boundary (the hash of the prompt's first
k chunks), checked against the entry's tokens (a collision is a miss), and evicted least recently
used first within `budget_bytes` and, in the served app, within the KV memory that admitted
sessions leave free (`room`; admission `shrink`s it for a session that needs more). Thread-safe
(a lock around the index); the K/V of an entry are never written after it is stored.

Prompts that arrive together share too: a session about to prefill whole chunks that no entry
holds `promise`s them, and a session whose prompt starts with chunks promised by another waits
for that prefill (`awaited`) instead of computing them as well, then looks up again.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from specextend.kv_cache import KVCache


@dataclass
class Entry:
    tokens: tuple[int, ...]  # the prefix, a whole number of chunks
    kv: torch.Tensor  # [layers, 2 * caches, G, len(tokens), D], a copy no session writes
    hashes: list[int]  # boundary_hashes(tokens): the index's keys for it

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


@dataclass(eq=False)
class Promise:
    """The whole chunks a session's prefill will store (PrefixCache.promise)."""
    tokens: tuple[int, ...]  # the prompt's whole chunks
    hashes: list[int]  # the boundaries past what the cache held when it began
    first: int  # chunks the cache held when it began
    done: Future = field(default_factory=Future)  # set once they are stored, or the prefill ended without


def boundary_hashes(tokens: Sequence[int], chunk: int, upto: int) -> list[int]:
    """The hash of tokens[:k * chunk] for k = 1 .. upto // chunk (each chained on the one before)."""
    out, h = [], 0
    for lo in range(0, upto - upto % chunk, chunk):
        h = hash((h, tuple(tokens[lo:lo + chunk])))
        out.append(h)
    return out


class PrefixCache:
    def __init__(self, chunk: int, budget_bytes: int):
        self.chunk = chunk
        self.budget_bytes = budget_bytes
        self.nbytes = 0
        self._entries: OrderedDict[int, Entry] = OrderedDict()  # id -> entry, least recently used first
        self._index: dict[int, list[int]] = {}  # boundary hash -> ids of the entries that hold it
        self._next_id = 0
        self._lock = threading.Lock()
        self.queries = self.hits = 0  # prompt tokens looked up and found (metrics)
        self.room: Optional[Callable[[], int]] = None  # bytes it may hold now besides the budget (None: all of it)
        self._promised: dict[int, list[Promise]] = {}  # boundary hash -> prefills under way that will store it

    @classmethod
    def of(cls, config) -> Optional["PrefixCache"]:
        """An engine's cache (config: EngineConfig), None where prefix_cache_gb is 0."""
        return cls(config.prefill_chunk, int(config.prefix_cache_gb * 2**30)) if config.prefix_cache_gb else None

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt_ids: Sequence[int]) -> tuple[int, Optional[torch.Tensor]]:
        """The longest cached prefix of whole chunks that leaves the prompt's last token to be
        forwarded: (its length m, its K/V [layers, 2 * caches, G, m, D]: the caches `store` was
        given, in order), or (0, None)."""
        hashes = boundary_hashes(prompt_ids, self.chunk, len(prompt_ids) - 1)
        want = tuple(prompt_ids[:len(hashes) * self.chunk])
        with self._lock:
            self.queries += len(prompt_ids)
            m, eid = self._hit(hashes, want)
            if not m:
                return 0, None
            self._entries.move_to_end(eid)
            self.hits += m
            return m, self._entries[eid].kv[:, :, :, :m]

    def load(self, prompt_ids: Sequence[int], *caches: KVCache) -> int:
        """`lookup`, and the hit's K/V into the empty `caches` (the ones `store` was given, in order:
        each takes its 2 of the entry's 2 * caches K/V planes); the tokens loaded (0: none)."""
        m, kv = self.lookup(prompt_ids)
        for i, cache in enumerate(caches if kv is not None else ()):
            cache.load_prefix(kv[:, 2 * i:2 * i + 2])
        return m

    def _hit(self, hashes: list[int], want: tuple[int, ...]) -> tuple[int, Optional[int]]:
        """(the longest held prefix of `want` in tokens, the entry holding it) for want's boundary
        `hashes`; (0, None) where none is held. Under the lock."""
        for k in range(len(hashes), 0, -1):
            m = k * self.chunk
            for eid in self._index.get(hashes[k - 1], ()):  # (the hash found it; the tokens decide)
                if self._entries[eid].tokens[:m] == want[:m]:
                    return m, eid
        return 0, None

    def awaited(self, prompt_ids: Sequence[int]) -> Optional[Future]:
        """A prefill under way (another session's promise) that will store more of this prompt's
        whole chunks than the cache holds now, the longest: its future, else None. Only one whose
        chunks this prompt shares at least half of: waiting for the whole of a long prefill to
        reuse a chunk or two of it would take longer than computing them."""
        hashes = boundary_hashes(prompt_ids, self.chunk, len(prompt_ids) - 1)
        want = tuple(prompt_ids[:len(hashes) * self.chunk])
        with self._lock:
            held = self._hit(hashes, want)[0] // self.chunk
            for k in range(len(hashes), held, -1):
                for p in self._promised.get(hashes[k - 1], ()):
                    if 2 * (k - p.first) >= len(p.hashes) and p.tokens[:k * self.chunk] == want[:k * self.chunk]:
                        return p.done
        return None

    def promise(self, prompt_ids: Sequence[int], start: int) -> Optional[Promise]:
        """Registers the whole chunks past `start` (what the cache held) that this prefill will
        store, for sessions whose prompts start with them to wait for (`awaited`); None where there
        are none. `fulfil` it once stored, or if the prefill ends without."""
        m = len(prompt_ids) - len(prompt_ids) % self.chunk
        if m <= start:
            return None
        hashes = boundary_hashes(prompt_ids, self.chunk, m)
        p = Promise(tuple(prompt_ids[:m]), hashes[start // self.chunk:], start // self.chunk)
        with self._lock:
            for h in p.hashes:
                self._promised.setdefault(h, []).append(p)
        return p

    def fulfil(self, p: Promise) -> None:
        with self._lock:
            _unlist(self._promised, p.hashes, p)
        if not p.done.done():
            p.done.set_result(None)

    def store(self, prompt_ids: Sequence[int], *caches: KVCache) -> bool:
        """Keep a copy of the K/V of the prompt's whole chunks (the caches hold the prefilled
        prompt: the target's one; the draft's working cache and its pre-RoPE store). Entries the
        new one extends are dropped; the least recently used go until it fits. False where there is
        nothing to keep or it cannot fit."""
        m = len(prompt_ids) - len(prompt_ids) % self.chunk
        if m == 0 or any(c.length < m for c in caches):
            return False
        per_token = sum(c.data[:, :, :, :1].numel() * c.data.element_size() for c in caches)
        limit = self.budget_bytes if self.room is None else min(self.budget_bytes, self.room())
        if m * per_token > limit:
            return False
        tokens = tuple(prompt_ids[:m])
        hashes = boundary_hashes(tokens, self.chunk, m)
        with self._lock:
            held = [e for e in self._index.get(hashes[-1], ()) if self._entries[e].tokens[:m] == tokens]
            if held:  # already held (by an entry of these tokens or a longer one)
                for e in held:
                    self._entries.move_to_end(e)
                return False
            for eid in [e for e, entry in self._entries.items()  # prefixes of the new entry (by hash, then
                        if len(entry.hashes) <= len(hashes) and entry.hashes[-1] == hashes[len(entry.hashes) - 1]
                        and tokens[:len(entry.tokens)] == entry.tokens]:  # by tokens): nothing they hold is lost
                self._drop(eid)
            while self._entries and self.nbytes + m * per_token > limit:
                self._drop(next(iter(self._entries)))
        kv = torch.cat([c.data[:, :, :, :m] for c in caches], dim=1)  # (outside the lock: a device copy)
        with self._lock:
            eid, self._next_id = self._next_id, self._next_id + 1
            self._entries[eid] = Entry(tokens, kv, hashes)
            self.nbytes += m * per_token
            for h in hashes:
                self._index.setdefault(h, []).append(eid)
            while self.nbytes > self.budget_bytes:  # (another store came in between)
                self._drop(next(iter(self._entries)))
        return True

    def shrink(self, limit: int) -> None:
        """Drops the least recently used entries until at most `limit` bytes are held (admission:
        a session needs the rest)."""
        with self._lock:
            while self._entries and self.nbytes > max(limit, 0):
                self._drop(next(iter(self._entries)))

    def clear(self) -> None:
        with self._lock:
            for eid in list(self._entries):
                self._drop(eid)

    def _drop(self, eid: int) -> None:
        entry = self._entries.pop(eid)
        self.nbytes -= entry.nbytes
        _unlist(self._index, entry.hashes, eid)


def _unlist(table: dict, keys: list, item) -> None:
    """Removes `item` from the list under each of `keys` in `table` (and the lists left empty)."""
    for key in keys:
        items = table.get(key)
        if items is not None and item in items:
            items.remove(item)
            if not items:
                del table[key]
