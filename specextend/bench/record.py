"""What a benchmark run records: its commit, device, date and command, next to its results, in one
JSON file per suite and device (`<out>/<suite>/<device>.json`). A new run of the same suite on
the same device replaces the file; history lives in git."""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import torch


def device_name(device: str) -> str:
    """'cpu', or 'N x <GPU name>' for the GPUs a run may use."""
    if device == "cpu" or not torch.cuda.is_available():
        return "cpu"
    return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def commit() -> str:
    """$SPECEXTEND_COMMIT when set (a copied tree whose git metadata is stale or absent, as on a
    GPU host the tree is carried to), else the checkout's short commit (`-dirty` with uncommitted
    changes), else "unknown"."""
    if os.environ.get("SPECEXTEND_COMMIT"):
        return os.environ["SPECEXTEND_COMMIT"]
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        if sha:
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def meta(suite: str, device: str, argv: list[str], **extra) -> dict:
    return dict(suite=suite, commit=commit(), device=device_name(device), date=time.strftime("%Y-%m-%d %H:%M"),
                command="specextend " + " ".join(argv), host=platform.node(), torch=torch.__version__,
                python=sys.version.split()[0], **extra)


def result_path(out: Path, suite: str, device: str, tree_policy: str | None = None) -> Path:
    tail = "-adaptive" if tree_policy == "adaptive" else ""  # the methods compared use fixed trees
    return Path(out) / suite / f"{slug(device)}{tail}.json"


def write(out: Path, result: dict) -> Path:
    """One JSON per suite and device (and tree policy, where it is the adaptive one)."""
    m = result["meta"]
    path = result_path(out, m["suite"], m["device"], m.get("tree_policy"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path


def write_rows(out: Path, stem: str, suite: str, args, rows: list, argv: list[str]) -> Path:
    """The rows of the script benchmarks/<suite>.py as `out`/<stem><device>.json, its meta the
    script's command and its options (`args`, an argparse namespace with `device`; `out` aside)."""
    info = meta(suite, args.device, argv) | {k: v for k, v in vars(args).items() if k not in ("out", "device")}
    info["command"] = f"python benchmarks/{suite}.py " + " ".join(argv)
    path = Path(out) / f"{stem}{slug(device_name(args.device))}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(rows=rows, meta=info), indent=1))
    return path


ROW_KEY = ("pair", "length", "doc", "mode")  # a row of the e2e and sweep suites: one prompt in one mode
SAME = ("suite", "device", "tree_policy", "dtype", "new_tokens")  # what parts of one run must share


def check_mergeable(old_meta: dict, new_meta: dict) -> None:
    """Raises unless a part with `new_meta` may merge into the record with `old_meta` (SAME)."""
    differ = [k for k in SAME if old_meta.get(k) != new_meta.get(k)]
    if differ:
        raise ValueError("--merge: the recorded run differs in " + ", ".join(
            f"{k} ({old_meta.get(k)!r} there, {new_meta.get(k)!r} here)" for k in differ) + "; run the whole grid instead")


def merge(old: dict, new: dict) -> dict:
    """`new` (a run of part of a suite's grid, e.g. its longest lengths) merged into `old`, the file
    an earlier part wrote: a row or check of the same (pair, length, doc, mode) is replaced, the
    others kept; the meta is the newest part's, with `parts` listing every part's commit, date and
    command and `pairs` the lengths of all of them. A long sweep can so be run in pieces (a job
    with a time limit, a preempted machine) and still be one record. The caller recomputes the
    summary. Parts that differ in what they measure (device, tree policy, dtype, tokens) fail."""
    om, nm = old["meta"], new["meta"]
    check_mergeable(om, nm)
    key = lambda r: tuple(r.get(k) for k in ROW_KEY)  # noqa: E731
    out = {}
    for part in ("rows", "checks"):
        fresh = {key(r) for r in new.get(part, [])}
        out[part] = [r for r in old.get(part, []) if key(r) not in fresh] + list(new.get(part, []))
    pairs = {name: sorted(set(om.get("pairs", {}).get(name, [])) | set(lengths)) for name, lengths in nm["pairs"].items()}
    pairs = {**om.get("pairs", {}), **pairs}
    docs = dict(om.get("docs", {}))
    for name, names in nm.get("docs", {}).items():  # every part's documents, in order
        docs[name] = list(dict.fromkeys([*docs.get(name, []), *names]))
    part = lambda m: {k: m[k] for k in ("commit", "date", "command") if k in m}  # noqa: E731
    parts = om.get("parts") or [part(om)]
    out["meta"] = dict(nm, pairs=pairs, docs=docs, parts=parts + [part(nm)])
    return out


def load_all(out: Path) -> list[dict]:
    """Every recorded run under `out`, with its file's path, latest first per suite and device."""
    runs = []
    for path in sorted(Path(out).glob("*/*.json")):
        try:
            data = json.loads(path.read_text())
        except ValueError:
            continue
        if isinstance(data, dict) and {"suite", "device", "date"} <= set(data.get("meta", {})):
            data["path"] = path
            runs.append(data)
    return sorted(runs, key=lambda r: (r["meta"]["suite"], r["meta"]["device"], r["meta"]["date"]), reverse=True)
