"""Successor weights (models/presets.py): random weights whose greedy next token is the same fixed
function of the current token for every model, with a real draft's spread of probabilities, so that
a replayed pair's plain and bonus tokens are ones its draft ranks first or second."""

import torch

from specextend.attention.backends import CAUSAL
from specextend.models import presets
from specextend.models.loader import load_model

VOCAB = 8192


def successors(vocab: int) -> torch.Tensor:
    """[V, K]: each token's k-th successor, from the permutations the construction draws."""
    gen = torch.Generator().manual_seed(presets.SEED + 2)
    return torch.stack([torch.argsort(torch.randperm(vocab, generator=gen)) for _ in presets.SUCC_LOGITS], -1)


def probs(spec: str, ids: torch.Tensor) -> torch.Tensor:
    m = load_model(spec, "draft", "float32", "cpu", vocab_size=VOCAB)
    with torch.no_grad():
        logits, _ = m.decoder.forward(ids, torch.arange(len(ids)), m.decoder.new_cache(len(ids)), CAUSAL)
    return torch.softmax(logits, -1)  # [T, V]


def test_models_of_any_geometry_rank_the_same_successors_first():
    ids = torch.randint(0, VOCAB, (120,), generator=torch.Generator().manual_seed(3))
    want = successors(VOCAB)[ids]  # [T, K]
    for spec in ("random:llama-68m-succ", "random:qwen2.5-0.5b-succ"):
        p = probs(spec, ids)
        top = torch.topk(p, len(presets.SUCC_LOGITS), -1)
        assert (top.indices[:, 0] == want[:, 0]).float().mean() >= 0.95, spec
        # the first four are the four successors, in falling probability like a real draft's
        assert (top.indices.sort(-1).values == want.sort(-1).values).all(), spec
        mean = top.values.mean(0)
        assert 0.5 < mean[0] < 0.95 and 0.02 < mean[1] < 0.3 and mean[3] < mean[2] < mean[1], (spec, mean)


def test_successor_presets_load_as_their_geometry_with_their_own_head():
    m = load_model("random:llama-68m-succ", "draft", "float32", "cpu", vocab_size=VOCAB)
    base = load_model("random:llama-68m", "draft", "float32", "cpu", vocab_size=VOCAB)
    assert m.args.hidden_size == base.args.hidden_size and m.args.num_layers == base.args.num_layers
    assert m.decoder.w.lm_head is not m.decoder.w.embed
    assert not torch.equal(m.decoder.w.lm_head, base.decoder.w.lm_head)
    assert "llama-3.2-1b-succ" in presets.PRESET_NAMES and "llama-tiny-succ" not in presets.PRESET_NAMES
    assert presets.successor_of("llama-tiny-succ") is None and presets.successor_of("llama-68m") is None
