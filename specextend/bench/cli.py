"""`specextend bench`: named benchmark suites that run on a GPU machine or the CPU, print a table,
write one JSON per suite and device (commit, device, date, command, results) and PNG plots under
`<out>/<suite>/`; `specextend bench --report` rebuilds the results page from those files.

Suites and their defaults (`--pair NAME=L1,L2` and the other flags override them):

| suite | what | GPU default | CPU default |
|---|---|---|---|
| kernels | step times against the memory floor | 8B geometry + 68M draft, 4K-128K | tiny pair, 256-4K |
| e2e | every baseline on three prompts per length | real pair, 1K-30K | tiny pair, real pair (1 prompt), 1K |
| sweep | length sweep | 8B geometry 4K-128K (replayed), real pair 1K-30K | tiny pair, 256-4K |
| serve | the Serve app over HTTP, one and two GPUs | real pair, 1K-30K | tiny pair, 512 |
| signal | the cross-model signal late, dropped, repeated; refresh, budget, chunk size | real pair, 16K and 30K | tiny pair, 512 |
| prefix | questions over one document, the prefix cache off and on: first token, outputs equal | real pair, 4K-30K | real target, 2K |
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

SUITES = ("kernels", "e2e", "sweep", "serve", "signal", "prefix")
REAL = [1024, 4096, 8192, 16384, 30000]  # the real pair's context is 32K
LONG = [4096, 8192, 16384, 32768, 65536, 130000]  # "128K": 130,000 document tokens, the question and 128 new fit 131,072
SMALL = [256, 1024, 4096]
DEFAULTS = {  # suite -> device kind -> (pairs and lengths, new tokens)
    "e2e": {"gpu": ({"real": REAL}, 128), "cpu": ({"tiny": [1024], "real": [1024]}, 16)},
    "sweep": {"gpu": ({"8b-succ": LONG, "real": REAL}, 128), "cpu": ({"tiny": SMALL}, 32)},  # (successor weights: presets.py)
    "serve": {"gpu": ({"real": [1024, 16384, 30000]}, 128), "cpu": ({"tiny": [512]}, 32)},
    "kernels": {"gpu": ({"8b": LONG}, 0), "cpu": ({"tiny": SMALL}, 0)},
    "signal": {"gpu": ({"real": [16384, 30000]}, 256), "cpu": ({"tiny": [512]}, 32)},
    "prefix": {"gpu": ({"real": [4096, 16384, 30000]}, 32), "cpu": ({"real": [2048]}, 4)},
}
DOCS = ["nodejs", "shakespeare", "python"]  # one prompt per kind of text and length
# On a 2-core CPU a 1K prefill of the real pair takes tens of seconds per mode: one prompt there,
# so that `--suite e2e --device cpu` fits in about ten minutes (the tiny pair keeps all three).
CPU_DOCS = {"real": ["nodejs"]}
SIGNAL_DOCS = ["nodejs", "shakespeare"]  # two kinds of text: a run of every sweep fits a few minutes
KERNEL_PAIRS = {"8b": ("random:llama-3.1-8b", "random:llama-68m"), "tiny": ("random:llama-tiny", "random:llama-tiny-draft"),
                "qwen": ("random:qwen2.5-1.5b", "random:qwen2.5-0.5b")}


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="run a benchmark suite (table, JSON, plots) or rebuild the results page",
                       description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="\n".join(__doc__.splitlines()[1:]))
    p.add_argument("--suite", choices=SUITES, help="the suite to run")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="auto: cuda when present")
    p.add_argument("--pair", action="append", default=[], metavar="NAME=L1,L2",
                   help="a model pair and its input lengths (tiny, real, 8b, 8b-1b; kernels also qwen); repeatable")
    p.add_argument("--modes", help="comma-separated (e2e/sweep: ar, sd, sd-masked, specextend, hf, hf-assisted, "
                                   "sd-2gpu, specextend-2gpu, sd-overlap, specextend-overlap; serve: ar, sd, sd-masked, specextend)")
    p.add_argument("--new-tokens", type=int, help="tokens generated per request")
    p.add_argument("--docs", help="documents, one prompt each per length (default nodejs,shakespeare,python: "
                                  "docs, prose, code; on the CPU the real pair takes nodejs only)")
    p.add_argument("--sweeps", help="signal: comma-separated sweeps (late, drop, duplicate, every, budget, chunk; "
                                    "default all); the nominal cells and the baselines always run")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    p.add_argument("--reps", type=int, default=10, help="kernels: timed repetitions per step")
    p.add_argument("--dtype", default="auto", help="auto: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--tree-policy", default="fixed", choices=("fixed", "adaptive"),
                   help="fixed: every step speculative (the methods compared); adaptive: as the app's default")
    p.add_argument("--port", type=int, default=8000, help="serve: the local HTTP port")
    p.add_argument("--app-args", type=json.loads, default={},
                   help="serve: more Serve application arguments for every app, as a JSON object "
                        "(e.g. '{\"stream_interval_ms\": 0}'); recorded with the run")
    p.add_argument("--placements", help="serve: the placements of the speculative modes to run, comma-separated "
                                        "(1gpu, 1gpu-replica, 1gpu-replica-serial, 1gpu-nolookup, 2gpu, 2gpu-wait, 2gpu-serial, 2gpu-nolookup, "
                                        "2gpu-nohandover, 2gpu-notell, 2gpu-noearly, 2gpu-snap, 2gpu-asks; default: all the "
                                        "machine has)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="results folder (JSON and plots)")
    p.add_argument("--merge", action="store_true",
                   help="e2e/sweep: merge this run's rows into the suite's recorded JSON (same pair, length, doc "
                        "and mode replaced), so that a long grid can run in parts")
    p.add_argument("--report", action="store_true", help="rebuild the results page from the JSON under --out")
    p.add_argument("--page", type=Path, default=Path("benchmarks/README.md"), help="--report: the results page")
    p.add_argument("--readme", type=Path, default=Path("README.md"),
                   help="--report: the README whose 'performance at a glance' block is rebuilt (if it has one)")


def _pairs(a, suite: str, kind: str) -> dict[str, list[int]]:
    if not a.pair:
        return dict(DEFAULTS[suite][kind][0])
    out = {}
    for item in a.pair:
        name, _, lengths = item.partition("=")
        if not lengths:
            raise ValueError(f"--pair {item!r}: give lengths, e.g. --pair {name}=1024,4096")
        out[name] = [int(x) for x in lengths.split(",")]
    return out


def _modes(a, suite: str, gpus: int) -> list[str]:
    if a.modes:
        from specextend.bench.e2e import LABELS

        modes = [m for m in a.modes.split(",") if m]
        known = ["ar", "lookup", "sd", "sd-masked", "specextend"] if suite in ("serve", "prefix") else list(LABELS)
        unknown = [m for m in modes if m not in known]
        if unknown:
            raise ValueError(f"{suite}: unknown modes {unknown}; known: {', '.join(known)}")
        if gpus < 2 and any(m.endswith("-2gpu") for m in modes):
            raise ValueError(f"the -2gpu modes need two GPUs; this machine has {gpus}")
        return modes
    if suite == "serve":
        return ["ar", "sd", "specextend"]
    if suite == "prefix":  # (on the CPU the real draft's prefill would double a long run)
        return ["ar", "specextend"] if gpus else ["ar"]
    modes = ["ar", "sd", "sd-masked", "specextend"]
    if gpus >= 2:
        modes += ["sd-2gpu", "specextend-2gpu"]
    return modes + (["hf", "hf-assisted"] if suite == "e2e" else [])


def run_suite(a, argv: list[str]) -> int:
    from specextend.bench import e2e, kernels, plots, prefix, record
    from specextend.bench import serve as served
    from specextend.bench.texts import documents

    device = "cuda" if a.device == "auto" and torch.cuda.is_available() else a.device
    device = "cpu" if device == "auto" else device
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device here")
    kind = "gpu" if device == "cuda" else "cpu"
    if a.merge and a.suite not in ("e2e", "sweep"):
        raise ValueError(f"--merge: only the e2e and sweep suites' rows merge, not {a.suite}'s")
    gpus = torch.cuda.device_count() if kind == "gpu" else 0
    pairs = _pairs(a, a.suite, kind)
    new_tokens = a.new_tokens or DEFAULTS[a.suite][kind][1]
    if a.docs:
        docs = {name: [d for d in a.docs.split(",") if d] for name in pairs}
    elif a.suite == "signal":
        docs = {name: SIGNAL_DOCS for name in pairs}
    elif a.suite == "prefix":  # one document: its questions are the point
        docs = {name: DOCS[:1] for name in pairs}
    else:
        docs = {name: CPU_DOCS.get(name, DOCS) if kind == "cpu" else DOCS for name in pairs}
    for names in docs.values():
        for doc in documents(names):  # unknown names and texts not installed fail here, before any model loads
            doc.text()
    if a.threads:
        torch.set_num_threads(a.threads)
    meta = record.meta(a.suite, device, argv, pairs=pairs, new_tokens=new_tokens, docs=docs, dtype=a.dtype,
                       tree_policy=a.tree_policy, **({"app_args": a.app_args} if a.app_args else {}))
    recorded = record.result_path(a.out, a.suite, meta["device"], a.tree_policy)
    if a.merge and recorded.is_file():  # refused before anything runs
        record.check_mergeable(json.loads(recorded.read_text())["meta"], meta)
    progress = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    if a.suite == "signal":
        result, table = _signal(a, pairs, new_tokens, docs, kind, device, meta, progress)
    elif a.suite == "kernels":
        unknown = set(pairs) - set(KERNEL_PAIRS)
        if unknown:
            raise ValueError(f"kernels: unknown pair {sorted(unknown)}; known: {', '.join(KERNEL_PAIRS)}")
        if len(pairs) != 1:
            raise ValueError("kernels: one --pair at a time")
        (name, lengths), = pairs.items()
        result = kernels.run(*KERNEL_PAIRS[name], lengths, a.reps, a.dtype, device, progress=progress)
        result["pair"] = name
        table = kernels.table(result)
    else:
        unknown = set(pairs) - set(e2e.PAIRS)
        if unknown:
            raise ValueError(f"unknown pair {sorted(unknown)}; known: {', '.join(e2e.PAIRS)}")
        modes = _modes(a, a.suite, gpus)
        if a.suite == "prefix":
            result = prefix.run(pairs, modes, new_tokens, docs, a.dtype, a.tree_policy, device, progress=progress)
        elif a.suite == "serve":
            result = served.run(pairs, modes, new_tokens, docs, a.port, progress=progress, tree_policy=a.tree_policy,
                                app_args=a.app_args, only=a.placements.split(",") if a.placements else None)
        else:
            result = e2e.run(pairs, modes, new_tokens, docs, a.dtype, a.tree_policy, device, progress=progress)
    result["meta"] = meta
    if a.merge:
        result = _merged(result, recorded)
    if a.suite not in ("signal", "kernels"):
        table = (prefix.table if a.suite == "prefix" else e2e.table)(result)
    path = record.write(a.out, result)
    stem = path.with_suffix("")
    title = f"{a.suite}, {result['meta']['device']}"
    if a.suite == "signal":
        pngs = plots.sweep_plots(result["summary"], stem, title)
    elif a.suite == "prefix":
        pngs = prefix.plot(result["summary"], stem, title)
    elif a.suite == "kernels":
        pngs = plots.step_time_plot(result["rows"], stem, f"{title}, {result['pair']} pair")
    else:
        pngs = plots.decode_plots(result["summary"], stem, title)
    print(table)
    print(f"\nwrote {path}" + "".join(f"\nwrote {p}" for p in pngs))
    return 0


def _signal(a, pairs, new_tokens, docs, kind, device, meta, progress):
    from specextend.bench import e2e, signal

    sweeps = [s for s in (a.sweeps or ",".join(signal.SWEEPS)).split(",") if s]
    unknown = [s for s in sweeps if s not in signal.SWEEPS] + [p for p in pairs if p not in e2e.PAIRS or e2e.PAIRS[p].replayed]
    if unknown:
        raise ValueError(f"signal: unknown sweeps or pairs {unknown}; sweeps: {', '.join(signal.SWEEPS)}; "
                         "pairs with real acceptance: " + ", ".join(n for n, p in e2e.PAIRS.items() if not p.replayed))
    grid = signal.GPU_GRID if kind == "gpu" else signal.CPU_GRID
    meta["sweeps"] = sweeps
    result = signal.run(pairs, new_tokens, docs, grid, sweeps, a.dtype, a.tree_policy, device, progress=progress)
    return result, signal.table(result)


def _merged(result: dict, path: Path) -> dict:
    """This run merged into the suite's recorded JSON (record.merge), or as it is where none exists."""
    from specextend.bench import e2e, record

    if not path.is_file():
        return result
    merged = record.merge(json.loads(path.read_text()), result)
    merged["summary"] = e2e.summarize(merged["rows"])
    return merged


def cmd_bench(a, argv: list[str]) -> int:
    if a.report:
        from specextend.bench import report

        for path in report.write_pages(a.out, a.page, a.readme):
            print(f"wrote {path}")
        return 0
    if not a.suite:
        raise ValueError("give --suite (" + ", ".join(SUITES) + ") or --report")
    return run_suite(a, argv)
