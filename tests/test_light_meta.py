"""The light record (models/light_meta.py; docs/architecture.md, "Deployment"): a converted model's
args, RoPE, stop ids and vocabulary digest, written beside its cache entry on a full read, so that the
draft actor checks the pair and builds its decoder without importing transformers. The full read is
its twin: the same args, RoPE, stop ids, pair verdict and weights."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from specextend.models import light_meta, model_cache
from specextend.models.loader import load_model, read_meta
REPO = Path(__file__).resolve().parent.parent


def test_a_light_read_gives_what_the_full_read_gives(gguf):
    assert read_meta(str(gguf), light=True).light is None  # no record yet: the full read (it writes one)
    full = read_meta(str(gguf))
    light = read_meta(str(gguf), light=True)
    assert light.light is not None and light.hf_config is None and full.light is None
    assert light.args == full.args and light.name == full.name and light.source == full.source
    assert light_meta.vocab_digest(light.tokenizer) == light_meta.vocab_digest(full.tokenizer)
    a, b = load_model(full, dtype="float32"), load_model(light, dtype="float32")
    assert a.args == b.args  # the stop ids folded in the same way
    assert torch.equal(a.decoder.rope.inv_freq, b.decoder.rope.inv_freq) and a.decoder.rope.scaling == b.decoder.rope.scaling
    ta, tb = model_cache.flatten(a.decoder.w), model_cache.flatten(b.decoder.w)
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    ids = torch.arange(6)
    cache_a, cache_b = a.decoder.new_cache(8), b.decoder.new_cache(8)
    from specextend.attention.backends import CAUSAL
    la, _ = a.decoder.forward(ids, ids, cache_a, CAUSAL)
    lb, _ = b.decoder.forward(ids, ids, cache_b, CAUSAL)
    assert torch.equal(la, lb)


def test_the_pair_check_reads_a_light_tokenizer_as_the_full_one(gguf):
    from specextend.builder import IncompatibleModels, check_pair

    full = read_meta(str(gguf))
    light = read_meta(str(gguf), light=True)
    check_pair(full, light)
    check_pair(light, light)
    other = SimpleNamespace(name="other", tokenizer=light_meta.LightTokenizer("0" * 64), args=light.args)
    with pytest.raises(IncompatibleModels, match="tokenizer mismatch"):
        check_pair(light, other)


def test_the_replica_reads_the_draft_light_and_the_target_in_full(gguf):
    from specextend.builder import read_pair
    from specextend.config import EngineConfig

    cfg = EngineConfig(target=str(gguf), draft=str(gguf))
    read_pair(cfg)  # (the records written)
    target, draft = read_pair(cfg, light=("draft",))
    assert target.light is None and target.hf_config is not None  # it tokenizes with the target's
    assert draft.light is not None and draft.args == target.args


def test_an_older_or_damaged_record_is_not_read(gguf):
    read_meta(str(gguf))
    path = model_cache.Entry.for_file(gguf).path / model_cache.LIGHT
    assert path.is_file()
    path.write_text("{not json")
    assert read_meta(str(gguf), light=True).light is None  # the full read, which writes it again
    assert read_meta(str(gguf), light=True).light is not None
    path.write_text('{"format": 0}')
    assert read_meta(str(gguf), light=True).light is None


CHILD = """
import sys
from specextend.builder import load_pair
from specextend.config import EngineConfig
gguf = sys.argv[1]
_, draft = load_pair(EngineConfig(target=gguf, draft=gguf, dtype="float32", device="cpu"), roles=("draft",), light=("target", "draft"))
print("LOADED", draft.args.num_layers, "transformers" in sys.modules)
"""


def test_the_draft_side_loads_without_importing_transformers(gguf):
    load_model(read_meta(str(gguf)), dtype="float32")  # the first start: the record and the weights cached
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", CHILD, str(gguf)], capture_output=True, text=True, env=env,
                         cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "LOADED" in out.stdout and out.stdout.strip().endswith("False"), out.stdout
