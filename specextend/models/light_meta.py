"""A converted model's record for a process that never tokenizes (the draft actor; docs/architecture.md,
"Deployment", the draft's start): its ModelArgs, RoPE frequencies, stop ids and a digest of its
vocabulary, written beside the model cache entry when the full config and tokenizer are read, so
that such a process checks the pair and builds its decoder without importing transformers (seconds
of a start). Pure functions of the config and tokenizer; the full read is their twin (tests compare
what each gives)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any

import torch

from specextend.models.args import ModelArgs

FORMAT = 1  # bump when the record's fields change (an older record is then ignored and rewritten)


@dataclass(frozen=True)
class LightTokenizer:
    """What the pair check reads of a tokenizer, without it: the digest of its vocabulary."""

    vocab_digest: str


def vocab_digest(tokenizer: Any) -> str:
    """sha256 of a tokenizer's vocabulary (token -> id, sorted); a LightTokenizer's own digest."""
    if isinstance(tokenizer, LightTokenizer):
        return tokenizer.vocab_digest
    items = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(items, ensure_ascii=False).encode()).hexdigest()


def same_vocab(a: Any, b: Any) -> bool:
    """Whether two tokenizers have one vocabulary: their vocabularies compared where both are at
    hand, their digests where either is a LightTokenizer (a digest costs ~4x the vocabulary's read)."""
    if isinstance(a, LightTokenizer) or isinstance(b, LightTokenizer):
        return vocab_digest(a) == vocab_digest(b)
    return a.get_vocab() == b.get_vocab()


def light_record(args: ModelArgs, inv_freq: torch.Tensor, scaling: float, stop_ids: list[int], tokenizer: Any) -> dict:
    """The record of a model read in full: its args, RoPE (inv_freq [D/2] float32, scaling), stop ids
    (loader.stop_token_ids) and vocabulary digest."""
    return dict(format=FORMAT, args=dataclasses.asdict(args), inv_freq=inv_freq.float().tolist(),
                scaling=float(scaling), stop_ids=[int(i) for i in stop_ids], vocab=vocab_digest(tokenizer))


def args_of(record: dict) -> ModelArgs:
    fields = dict(record["args"])
    fields["eos_token_ids"] = tuple(fields["eos_token_ids"])
    return ModelArgs(**fields)


def rope_of(record: dict) -> tuple[torch.Tensor, float]:
    """(inv_freq [D/2] float32, scaling) as loader's inv_freq_from_config gave them (float32 values
    survive the JSON's float64 exactly)."""
    return torch.tensor(record["inv_freq"], dtype=torch.float32), float(record["scaling"])


def valid(record: Any) -> bool:
    return isinstance(record, dict) and record.get("format") == FORMAT and {
        "args", "inv_freq", "scaling", "stop_ids", "vocab"} <= set(record)
