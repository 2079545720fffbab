"""Converted GGUF models kept on disk, so that a start after the first skips the conversion
(docs/architecture.md, "Models").

Reading a GGUF file's config and tokenizer (transformers parses its metadata arrays in Python)
and dequantising its weights take minutes on a CPU, every start. An entry under
`$SPECEXTEND_CACHE/converted/<sha256>-<code version>/` keeps the result: `meta/` holds the config
and tokenizer as transformers saves them, with a manifest of their sha256 sums, and
`weights-<dtype>.safetensors` the decoder's weights in that dtype, with a crc32 of every tensor in
its header. The key is the GGUF file's sha256 (pinned for the default pair; for other files hashed
once per path, size and mtime, remembered under `sources/`) and the versions of the code that
converted it. Writers build under temporary names and publish with one rename, holding a file lock
so that a second process starting at the same time waits and then reads the first one's entry;
readers never lock. An entry that fails its checks is removed and rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import shutil
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

import torch
from filelock import FileLock, Timeout
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from specextend import fetch
from specextend.models.decoder import LayerWeights, Weights

log = logging.getLogger(__name__)

FORMAT = 1  # bump when the layout of an entry changes
MANIFEST = "manifest.json"
LIGHT = "light.json"  # beside meta/: the light record (light_meta.py) of a process that never tokenizes
LOCK_TIMEOUT_S = 3600.0  # longest wait for another process's conversion before converting unshared
_BAD = (OSError, ValueError, KeyError, TypeError, SafetensorError)  # what a damaged entry raises
T = TypeVar("T")


def root() -> Path:
    return fetch.cache_dir() / "converted"


def _code_version() -> str:
    # the installed version, read without importing transformers (seconds; the draft side need not)
    return f"v{FORMAT}-transformers{version('transformers')}-gguf{version('gguf')}"


def file_sha256(path: Path) -> str:
    """The sha256 of a file, hashed once per (real path, size, mtime) and remembered."""
    real = path.resolve()
    st = real.stat()
    stamp = [str(real), st.st_size, st.st_mtime_ns]
    record = root() / "sources" / f"{hashlib.sha256(str(real).encode()).hexdigest()[:32]}.json"
    try:
        known = json.loads(record.read_text())
        if known["stamp"] == stamp:
            return known["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    log.info("hashing %s (once per file version)", real)
    digest = fetch.sha256_file(real)
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        fetch.write_atomic(record, json.dumps({"stamp": stamp, "sha256": digest}))
    except OSError as e:
        log.warning("cannot remember the sha256 of %s: %s", real, e)
    return digest


def _tmp(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


def _discard(path: Path, why: object) -> None:
    """Remove a damaged file or folder (renamed aside first, so no reader sees it half gone)."""
    log.warning("model cache: %s is damaged (%s); rebuilding it", path, why)
    aside = _tmp(path)
    try:
        os.rename(path, aside)
    except FileNotFoundError:  # another process discarded it first
        return
    if aside.is_dir():
        shutil.rmtree(aside, ignore_errors=True)
    else:
        aside.unlink(missing_ok=True)


def _crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def _crcs(tensors: dict[str, torch.Tensor], desc: str) -> dict[str, int]:
    """crc32 of every tensor (threads: zlib releases the GIL), with a progress bar on a terminal."""
    names = list(tensors)
    total = sum(t.nbytes for t in tensors.values())
    with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool, \
            tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=not sys.stderr.isatty()) as bar:
        out = {}
        for name, crc in zip(names, pool.map(lambda n: _crc(tensors[n]), names)):
            out[name] = crc
            bar.update(tensors[name].nbytes)
    return out


def flatten(w: Weights) -> dict[str, torch.Tensor]:
    """The weights as named CPU tensors (a tied head is stored once, as `embed`)."""
    out = {"embed": w.embed, "norm": w.norm}
    if w.lm_head is not w.embed:
        out["lm_head"] = w.lm_head
    for i, lw in enumerate(w.layers):
        for k in LayerWeights.__dataclass_fields__:
            if (t := getattr(lw, k)) is not None:
                out[f"layers.{i}.{k}"] = t
    return {k: v.detach().to("cpu").contiguous() for k, v in out.items()}


def unflatten(sd: dict[str, torch.Tensor], num_layers: int) -> Weights:
    layers = [LayerWeights(**{k: sd.get(f"layers.{i}.{k}") for k in LayerWeights.__dataclass_fields__})
              for i in range(num_layers)]
    return Weights(sd["embed"], layers, sd["norm"], sd.get("lm_head", sd["embed"]))


@dataclass(frozen=True)
class Entry:
    """The cached conversion of one GGUF file (its folder need not exist yet)."""

    path: Path

    @classmethod
    def for_file(cls, gguf: Path, sha256: Optional[str] = None) -> "Entry":
        """The entry of `gguf`; `sha256` when it is already known (the pinned default pair)."""
        return cls(root() / f"{sha256 or file_sha256(gguf)}-{_code_version()}")

    # ---------------------------------------------------------------- config and tokenizer

    def read_meta(self, discard: bool = True) -> Optional[tuple[Any, Any]]:
        """(config, tokenizer), or None when absent or damaged (then removed if `discard`)."""
        from transformers import AutoConfig, AutoTokenizer

        folder = self.path / "meta"
        if not folder.is_dir():
            return None
        try:
            manifest = json.loads((folder / MANIFEST).read_text())
            files = {p.name for p in folder.iterdir()} - {MANIFEST}
            if not manifest or set(manifest) != files:
                raise ValueError("files differ from the manifest")
            for name, digest in manifest.items():
                if hashlib.sha256((folder / name).read_bytes()).hexdigest() != digest:
                    raise ValueError(f"{name} fails its sha256")
            return AutoConfig.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
        except _BAD as e:
            if discard:
                _discard(folder, e)
            return None

    def _write_meta(self, meta: tuple[Any, Any]) -> None:
        config, tokenizer = meta
        tmp = _tmp(self.path / "meta")
        try:
            config.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            manifest = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in tmp.iterdir()}
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
            os.rename(tmp, self.path / "meta")  # a folder: fails if one was published meanwhile
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def meta(self, convert: Callable[[], tuple[Any, Any]]) -> tuple[Any, Any]:
        """The cached (config, tokenizer), else `convert()`'s, stored for the next start."""
        return self._get("meta", self.read_meta, convert, self._write_meta)

    # ---------------------------------------------------------------- light record

    def read_light(self) -> Optional[dict]:
        """The entry's light record (models/light_meta.py), or None when absent, older or damaged."""
        from specextend.models.light_meta import valid

        try:
            record = json.loads((self.path / LIGHT).read_text())
        except (OSError, ValueError):
            return None
        return record if valid(record) else None

    def write_light(self, record: dict) -> None:
        """Publishes the light record atomically (best effort: a disk that refuses costs a later
        light read its shortcut, not this start)."""
        tmp = _tmp(self.path / LIGHT)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(record))
            os.replace(tmp, self.path / LIGHT)
        except OSError as e:
            log.warning("model cache: cannot write %s of %s: %s", LIGHT, self.path, e)
            try:
                tmp.unlink(missing_ok=True)
            except OSError:  # (a path through a file: nothing was written)
                pass

    # ---------------------------------------------------------------- weights

    def weights_path(self, dtype: torch.dtype) -> Path:
        return self.path / f"weights-{str(dtype).removeprefix('torch.')}.safetensors"

    def read_weights(self, dtype: torch.dtype, num_layers: int, discard: bool = True) -> Optional[Weights]:
        """The weights on the CPU, or None when absent or damaged (then removed if `discard`)."""
        path = self.weights_path(dtype)
        if not path.is_file():
            return None
        t0 = time.perf_counter()
        try:
            with safe_open(path, "pt") as f:
                header = f.metadata() or {}
            if header.get("format") != str(FORMAT) or header.get("dtype") != str(dtype):
                raise ValueError(f"written as {header.get('format')}/{header.get('dtype')}")
            expected = json.loads(header["crc32"])
            sd = load_file(path)
            if set(sd) != set(expected):
                raise ValueError("tensor names differ from the header's")
            bad = [k for k, crc in _crcs(sd, f"checking {path.name}").items() if crc != expected[k]]
            if bad:
                raise ValueError(f"{len(bad)} tensors fail their crc32 (first {bad[0]})")
            weights = unflatten(sd, num_layers)
        except _BAD as e:
            if discard:
                _discard(path, e)
            return None
        log.info("model cache: %s read in %.1f s", path, time.perf_counter() - t0)
        return weights

    def _write_weights(self, dtype: torch.dtype, weights: Weights) -> None:
        path = self.weights_path(dtype)
        sd = flatten(weights)
        header = {"format": str(FORMAT), "dtype": str(dtype),
                  "crc32": json.dumps(_crcs(sd, f"writing {path.name}"))}
        tmp = _tmp(path)
        try:
            save_file(sd, tmp, metadata=header)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    def weights(self, dtype: torch.dtype, num_layers: int, convert: Callable[[], Weights]) -> Weights:
        """The cached weights (on the CPU), else `convert()`'s, stored for the next start."""
        return self._get(f"weights-{dtype}", lambda d: self.read_weights(dtype, num_layers, d), convert,
                         lambda w: self._write_weights(dtype, w))

    # ---------------------------------------------------------------- shared

    def _get(self, what: str, read: Callable[[bool], Optional[T]], convert: Callable[[], T],
             write: Callable[[T], None]) -> T:
        """read(discard) -> convert() -> write(value); only the lock holder discards or writes, so
        no process removes an entry that another has just published."""
        if (hit := read(False)) is not None:
            return hit
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            lock = FileLock(str(self.path / f"{what.replace('torch.', '')}.lock"))
            lock.acquire(timeout=LOCK_TIMEOUT_S)  # another process may be converting the same file
        except (OSError, Timeout) as e:
            log.warning("model cache: %s of %s not shared (%s); converting", what, self.path.name, e)
            return convert()
        try:
            if (hit := read(True)) is not None:  # the other process finished it
                return hit
            value = convert()
            try:
                write(value)
                log.info("model cache: %s of %s written", what, self.path.name)
            except OSError as e:  # a full or read-only disk costs the next start time, not this one
                log.warning("model cache: cannot write %s of %s: %s", what, self.path, e)
            return value
        finally:
            lock.release()
