"""The model cache (docs/architecture.md, "Models"): a GGUF file converted once, then read back
bit for bit; damaged entries rebuilt; two processes starting at once convert it once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specextend import fetch
from specextend.config import EngineConfig
from specextend.models import loader, model_cache
from specextend.models.loader import load_model, read_meta
from tests.tiny_gguf import write_tiny_gguf

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def conversions(monkeypatch) -> list[str]:
    """Records each GGUF conversion (metadata, weights) that actually runs."""
    from transformers import AutoTokenizer

    seen: list[str] = []
    hf_state_dict, tokenizer = loader._hf_state_dict, AutoTokenizer.from_pretrained.__func__

    def state_dict(meta):
        seen.append("weights")
        return hf_state_dict(meta)

    def from_pretrained(cls, *a, **kw):
        if kw.get("gguf_file"):
            seen.append("meta")
        return tokenizer(cls, *a, **kw)

    monkeypatch.setattr(loader, "_hf_state_dict", state_dict)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", classmethod(from_pretrained))
    return seen


def load(path: Path, cache: bool = True, dtype: str = "float32"):
    return load_model(read_meta(str(path), cache=cache), dtype=dtype)


def tensors(model) -> dict[str, torch.Tensor]:
    return model_cache.flatten(model.decoder.w)


def assert_same_model(a, b) -> None:
    ta, tb = tensors(a), tensors(b)
    assert ta.keys() == tb.keys()
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and ta[k].shape == tb[k].shape, k
        assert torch.equal(ta[k].view(torch.uint8), tb[k].view(torch.uint8)), f"{k} differs"
    assert (a.decoder.w.lm_head is a.decoder.w.embed) == (b.decoder.w.lm_head is b.decoder.w.embed)
    assert a.args == b.args and a.name == b.name
    drop = {"_name_or_path", "transformers_version"}
    assert ({k: v for k, v in a.hf_config.to_dict().items() if k not in drop}
            == {k: v for k, v in b.hf_config.to_dict().items() if k not in drop})
    ta, tb = a.tokenizer, b.tokenizer
    assert ta.get_vocab() == tb.get_vocab() and ta.chat_template == tb.chat_template
    assert ta.all_special_tokens == tb.all_special_tokens and ta.eos_token_id == tb.eos_token_id
    text = "the inner <|im_start|>user\nhér über<|im_end|> 123"
    assert ta.encode(text) == tb.encode(text)
    assert loader.stop_token_ids(ta) == loader.stop_token_ids(tb)


def entry(gguf: Path) -> model_cache.Entry:
    return model_cache.Entry.for_file(gguf)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cached_model_is_bit_identical_to_converting(gguf, conversions, dtype):
    converted = load(gguf, cache=False, dtype=dtype)
    assert conversions == ["meta", "weights"] and not model_cache.root().exists()  # cache off: nothing kept
    first = load(gguf, dtype=dtype)  # converts and stores
    assert conversions == ["meta", "weights"] * 2
    second = load(gguf, dtype=dtype)  # reads the entry
    assert conversions == ["meta", "weights"] * 2
    for m in (first, second):
        assert_same_model(converted, m)
    assert entry(gguf).weights_path(getattr(torch, dtype)).is_file()


def test_each_dtype_has_its_own_weights(gguf, conversions):
    load(gguf, dtype="float32")
    load(gguf, dtype="float64")
    assert conversions == ["meta", "weights", "weights"]
    names = sorted(p.name for p in entry(gguf).path.glob("*.safetensors"))
    assert names == ["weights-float32.safetensors", "weights-float64.safetensors"]


def _truncate(e: model_cache.Entry) -> None:
    p = e.weights_path(torch.float32)
    os.truncate(p, p.stat().st_size - 100)


def _flip_weight_byte(e: model_cache.Entry) -> None:
    p = e.weights_path(torch.float32)
    data = bytearray(p.read_bytes())
    data[-1000] ^= 0x10  # inside the tensor data: only the crc32 notices
    p.write_bytes(bytes(data))


def _garbage_header(e: model_cache.Entry) -> None:
    p = e.weights_path(torch.float32)
    p.write_bytes(b"\xff" * 64 + p.read_bytes()[64:])


def _edit_tokenizer(e: model_cache.Entry) -> None:
    p = e.path / "meta" / "tokenizer.json"
    p.write_text(p.read_text().replace('"<|im_end|>"', '"<|im_stop|>"'))


def _drop_config(e: model_cache.Entry) -> None:
    (e.path / "meta" / "config.json").unlink()


@pytest.mark.parametrize("damage, rebuilt", [
    (_truncate, ["weights"]), (_flip_weight_byte, ["weights"]), (_garbage_header, ["weights"]),
    (_edit_tokenizer, ["meta"]), (_drop_config, ["meta"])])
def test_damaged_entry_is_detected_and_rebuilt(gguf, conversions, caplog, damage, rebuilt):
    converted = load(gguf, cache=False)
    load(gguf)
    damage(entry(gguf))
    del conversions[:]
    assert_same_model(converted, load(gguf))
    assert conversions == rebuilt
    assert "damaged" in caplog.text
    del conversions[:]
    assert_same_model(converted, load(gguf))  # rebuilt entry is whole again
    assert conversions == []
    leftovers = [p.name for p in entry(gguf).path.rglob("*") if p.name.endswith(".tmp")]
    assert leftovers == []


def test_file_hash_is_remembered_per_path_size_and_mtime(gguf, monkeypatch):
    digest = model_cache.file_sha256(gguf)
    assert digest == fetch.sha256_file(gguf)
    monkeypatch.setattr(fetch, "sha256_file", lambda p: pytest.fail("rehashed an unchanged file"))
    assert model_cache.file_sha256(gguf) == digest
    monkeypatch.undo()
    monkeypatch.setenv("SPECEXTEND_CACHE", str(gguf.parent.parent / "cache"))
    write_tiny_gguf(gguf, seed=1)  # new content (and mtime): a new entry
    assert model_cache.file_sha256(gguf) == fetch.sha256_file(gguf) != digest


def test_unwritable_cache_converts_without_storing(gguf, conversions, monkeypatch, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("SPECEXTEND_CACHE", str(blocker))
    assert_same_model(load(gguf, cache=False), load(gguf))
    assert conversions == ["meta", "weights", "meta", "weights"]


def test_model_cache_setting_reaches_read_meta(gguf, conversions):
    from specextend.builder import read_pair

    cfg = EngineConfig(target=str(gguf), draft=str(gguf), model_cache=False)
    read_pair(cfg)
    assert not model_cache.root().exists()
    read_pair(EngineConfig(target=str(gguf), draft=str(gguf)))
    assert (entry(gguf).path / "meta" / model_cache.MANIFEST).is_file()


CHILD = """
import hashlib, pathlib, sys, time, torch
from specextend.models import loader, model_cache
real = loader._hf_state_dict
def slow(meta):  # a conversion long enough for the other process to arrive while it runs
    print("CONVERTED", flush=True)
    time.sleep(3)
    return real(meta)
loader._hf_state_dict = slow
gguf, me, other = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3])
me.touch()
while not other.exists():  # both processes imported: start together
    time.sleep(0.01)
m = loader.load_model(loader.read_meta(str(gguf)), dtype="float32")
h = hashlib.sha256()
for k, t in sorted(model_cache.flatten(m.decoder.w).items()):
    h.update(k.encode() + t.reshape(-1).view(torch.uint8).numpy().tobytes())
print("DIGEST", h.hexdigest(), flush=True)
"""


def test_two_processes_starting_at_once_convert_once(gguf, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    ready = [str(tmp_path / f"ready{i}") for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(gguf), ready[i], ready[1 - i]],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
             for i in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    lines = [o[0].split("\n") for o in outs]
    assert sum(ln.count("CONVERTED") for ln in lines) == 1  # the second waited and read the first's
    digests = {ln for out in lines for ln in out if ln.startswith("DIGEST")}
    assert len(digests) == 1
    assert not [p for p in model_cache.root().rglob("*") if p.name.endswith(".tmp")]
    assert json.loads((entry(gguf).path / "meta" / model_cache.MANIFEST).read_text())
