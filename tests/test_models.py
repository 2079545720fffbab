"""Our compact decoder against transformers' own forward, per architecture."""

import pytest
import torch

from specextend.attention.backends import CAUSAL

from helpers import CONFIGS, build_pair


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("backend", ["eager", "torch"])
def test_forward_matches_transformers(name, backend):
    hf, dec = build_pair(name, backend)
    ids = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    cache = dec.new_cache(64)
    logits, _ = dec.forward(ids, torch.arange(40), cache, CAUSAL)
    torch.testing.assert_close(logits, ref, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["llama3", "qwen3"])
def test_incremental_decode_equals_full_recompute(name):
    _, dec = build_pair(name)
    ids = torch.randint(0, 97, (30,), generator=torch.Generator().manual_seed(2))
    full, _ = dec.forward(ids, torch.arange(30), dec.new_cache(64), CAUSAL)
    cache = dec.new_cache(64)
    rows = []
    # chunked prefill (12 + 9) then one token at a time
    for lo, hi in [(0, 12), (12, 21)] + [(i, i + 1) for i in range(21, 30)]:
        out, _ = dec.forward(ids[lo:hi], torch.arange(lo, hi), cache, CAUSAL)
        cache.advance(hi - lo)
        rows.append(out)
    torch.testing.assert_close(torch.cat(rows), full, atol=1e-4, rtol=1e-4)
