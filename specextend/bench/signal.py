"""The `signal` suite: the cross-model signal under stress (docs/architecture.md, "Baselines").

The target runs in this process; the draft is a real gRPC draft worker on 127.0.0.1 (its server in
a thread of this process, on cuda:1 with overlap when there are two GPUs, else on the target's
device). Every request's chunk ids pass through `draft/chaos.ChaosDraft`, which makes them late,
drops or repeats them (faults are injected there, never in the code under test), then through
`WireMeter`, which counts what reaches the wire. Each point of a sweep is one *cell*:

- `retrieval`: the target's attention picks the chunks (`retrieval_select=attention`);
- `recency`: a plain window of the same budget, sink + most recent chunks (`retrieval_select=recency`);
- `full`: the draft with its full cache (`sd`, HTA verification), one cell per prompt.

Sweeps (`SWEEPS`): ids `late` by k steps, `drop` p% of updates, `duplicate` (each step without a
new update re-sends the last), refresh `every` n steps, chunk `budget` (chunks of the nominal
size), `chunk` size at the nominal token budget. Faults apply to `retrieval` only: the recency
window is always current (new tokens are appended between refreshes), so it is the line that
stale retrieval must stay above. Every cell's output is checked against `ar` on the same prompt
(identical, or first differing at a near-tie: docs/architecture.md, "Losslessness in finite
precision"). The signal's cost: bytes per Step on the wire (all of it, and its retrieval part),
the target's score + select time per refresh (`RequestStats.retrieval_s`), the draft's
working-cache rebuild time per rebuild (`WorkerStats.rebuild_s`, on the draft's device clock).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field, replace
from typing import Optional, Sequence

import torch

from specextend.bench import e2e
from specextend.bench.texts import documents, prompt_ids
from specextend.config import RetrievalConfig
from specextend.draft.base import DraftBackend, DraftSessionParams, DraftTree, Retrieval, TreeBound
from specextend.draft.chaos import Chaos, ChaosDraft
from specextend.draft.worker import DraftWorker
from specextend.engine import Engine
from specextend.near_tie import lossless_check
from specextend.rpc import DraftServerThread, GrpcDraftBackend
from specextend.rpc.auth import new_token
from specextend.rpc.convert import step_to_proto

SWEEPS = ("late", "drop", "duplicate", "every", "budget", "chunk")
BASELINES = ("retrieval", "recency", "full")
XLABELS = {"late": "chunk ids late by (steps)", "drop": "updates dropped (%)",
           "duplicate": "last update re-sent every step (0 no, 1 yes)", "every": "refresh every (steps)",
           "budget": "chunk budget (chunks)", "chunk": "chunk size (tokens), same token budget"}


@dataclass(frozen=True)
class Grid:
    """The nominal setting (today's defaults on the GPU) and each sweep's values."""
    chunk_size: int = 32
    top_k: int = 32
    every: int = 4
    late: tuple[int, ...] = (0, 1, 2, 4)
    drop: tuple[int, ...] = (0, 10, 25, 50)  # percent
    duplicate: tuple[int, ...] = (0, 1)
    refresh: tuple[int, ...] = (1, 2, 4, 8, 16)
    budget: tuple[int, ...] = (8, 16, 32, 64)
    chunk: tuple[int, ...] = (16, 32, 64)

    def values(self, sweep: str) -> tuple[int, ...]:
        return getattr(self, "refresh" if sweep == "every" else sweep)


GPU_GRID = Grid()
# the tiny pair on the CPU at a few hundred tokens: a budget that leaves most of the prompt out
CPU_GRID = Grid(chunk_size=16, top_k=8, budget=(4, 8, 16), chunk=(8, 16, 32))


@dataclass(frozen=True)
class Setting:
    """What one cell runs: a baseline, its retrieval shape, and the faults on its signal."""
    baseline: str
    chunk_size: int = 0
    top_k: int = 0
    every: int = 0
    chaos: Chaos = field(default_factory=Chaos)

    def label(self) -> str:
        if self.baseline == "full":
            return "full"
        c = self.chaos
        faults = "".join([f" late {c.delay_steps}" if c.delay_steps else "",
                          f" drop {round(100 * c.drop_rate)}%" if c.drop_rate else "",
                          " duplicated" if c.duplicate else ""])
        return f"{self.baseline} {self.top_k}x{self.chunk_size} every {self.every}{faults}"


def _point(grid: Grid, sweep: str, value: int, baseline: str) -> Setting:
    """The setting of `baseline` at `value` of `sweep` (the others nominal)."""
    if baseline == "full":
        return Setting("full")
    s = Setting(baseline, grid.chunk_size, grid.top_k, grid.every)
    if sweep == "every":
        return replace(s, every=value)
    if sweep == "budget":
        return replace(s, top_k=value)
    if sweep == "chunk":  # the same token budget in chunks of `value` tokens
        return replace(s, chunk_size=value, top_k=max(grid.chunk_size * grid.top_k // value, 1))
    if baseline == "recency" or sweep == "nominal" or value == 0:
        return s
    chaos = {"late": Chaos(delay_steps=value), "drop": Chaos(drop_rate=value / 100, seed=1),
             "duplicate": Chaos(duplicate=bool(value))}[sweep]
    return replace(s, chaos=chaos)


def plan(grid: Grid, sweeps: Sequence[str]) -> list[tuple[str, int, str, Setting]]:
    """(sweep, value, baseline, setting) of every point: the nominal cell of each baseline, then
    each selected sweep's values. Faults sweep `retrieval` alone; shapes sweep it and `recency`."""
    points = [("nominal", 0, b, _point(grid, "nominal", 0, b)) for b in BASELINES]
    for sweep in sweeps:
        baselines = ("retrieval", "recency") if sweep in ("every", "budget", "chunk") else ("retrieval",)
        points += [(sweep, v, b, _point(grid, sweep, v, b)) for v in grid.values(sweep) for b in baselines]
    return points


class WireMeter(DraftBackend):
    """Counts the Step requests that go on the wire: bytes, and bytes of their retrieval part (the
    same message the gRPC client sends, `rpc/convert.py`)."""

    def __init__(self, inner: DraftBackend):
        self.inner = inner
        self.counters = dict(steps=0, bytes=0, signal_bytes=0)

    def open(self, session_id: str, prompt_ids: Sequence[int], params: DraftSessionParams) -> Optional[float]:
        return self.inner.open(session_id, prompt_ids, params)

    def step(self, session_id: str, step: int, accepted_tokens: Sequence[int],
             retrieval: Optional[Retrieval] = None, bound: Optional[TreeBound] = None) -> DraftTree:
        size = step_to_proto(session_id, step, accepted_tokens, retrieval, bound).ByteSize()
        bare = step_to_proto(session_id, step, accepted_tokens, None, bound).ByteSize() if retrieval else size
        n = self.counters
        n["steps"], n["bytes"], n["signal_bytes"] = n["steps"] + 1, n["bytes"] + size, n["signal_bytes"] + size - bare
        return self.inner.step(session_id, step, accepted_tokens, retrieval, bound)

    def close(self, session_id: str) -> None:
        self.inner.close(session_id)


class Remote:
    """The draft as the deployment runs it: a DraftWorker behind a gRPC server on 127.0.0.1 with a
    token, and one client."""

    def __init__(self, model, overlap: bool, params: DraftSessionParams, prefill_chunk: int):
        self.worker = DraftWorker(model.decoder, prefill_chunk=prefill_chunk, overlap=overlap)
        self.worker.warm_up(params)
        token = new_token()
        self.server = DraftServerThread(self.worker, "127.0.0.1", 0, token=token)
        self.client = GrpcDraftBackend(self.server.address, timeout_s=120, token=token)

    def stop(self) -> None:
        self.client.shutdown()
        self.server.stop()
        self.worker.stop()


def _config(base, s: Setting, overlap: bool):
    if s.baseline == "full":
        return replace(base, **e2e.MODES["sd"], draft_overlap=overlap)
    retrieval = RetrievalConfig(enabled=True, chunk_size=s.chunk_size, top_k=s.top_k, every=s.every,
                                select="attention" if s.baseline == "retrieval" else "recency")
    return replace(base, mode="specextend", retrieval=retrieval, draft_overlap=overlap)


def _deltas(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


def _measure(engine: Engine, meters: tuple, worker: DraftWorker, prompt: list[int], new_tokens: int,
             warm: set) -> tuple[list[int], dict]:
    """One request on a cell's engine; its measurements and what its signal cost and carried."""
    chaos, wire = meters
    snap = lambda: (chaos.counters.snapshot(), dict(wire.counters), worker.stats())  # noqa: E731
    e2e.warm_up(engine, prompt, warm)  # outside the counted request
    c0, w0, s0 = snap()
    ids, r = e2e.run_engine(engine, prompt, new_tokens, None, warm)
    c1, w1, s1 = snap()
    c, w = _deltas(c1, c0), _deltas(w1, w0)
    rebuilds = s1.rebuilds - s0.rebuilds
    steps = max(w["steps"], 1)
    r.update({f"updates_{k}": v for k, v in c.items()}, draft_rebuilds=rebuilds,
             wire_bytes_per_step=w["bytes"] / steps, signal_bytes_per_step=w["signal_bytes"] / steps,
             score_ms_per_refresh=r["retrieval_ms"] / max(r["retrieval_refreshes"], 1),
             rebuild_ms=1e3 * (s1.rebuild_s - s0.rebuild_s) / max(rebuilds, 1))
    return ids, r


def run(pairs: dict[str, list[int]], new_tokens: int, docs: dict[str, list[str]], grid: Grid,
        sweeps: Sequence[str], dtype: str = "auto", tree_policy: str = "fixed", device: str = "auto",
        progress=print) -> dict:
    """Every point of `plan(grid, sweeps)` on one prompt per document at each pair's lengths.
    Returns {"cells": one row per prompt and distinct setting, "points": (sweep, value, baseline) ->
    setting label, "summary": mean and spread over prompts per point, "grid", "placement"}."""
    points = plan(grid, sweeps)
    settings = list(dict.fromkeys(p[3] for p in points))
    assert len({s.label() for s in settings}) == len(settings), "two settings share a label"
    cells = []
    two = device != "cpu" and torch.cuda.is_available() and torch.cuda.device_count() >= 2
    placement = "target cuda:0, draft cuda:1 (overlap on)" if two else "target and draft on one device"
    for pair_name, lengths in pairs.items():
        base, target, drafts = e2e.load_models(e2e.PAIRS[pair_name], dtype, tree_policy, device,
                                               ("cuda:1",) if two else ())
        draft_model = drafts["cuda:1" if two else base.device]
        cfgs = {s: _config(base, s, two) for s in settings}
        remote = Remote(draft_model, two, DraftSessionParams(base.tree, cfgs[settings[0]].retrieval, 64),
                        base.prefill_chunk)
        tol = e2e.TIE_TOLERANCE.get(target.decoder.dtype, 0.125)
        try:
            engines, meters = {"ar": Engine(replace(base, mode="ar"), target)}, {}
            for s in settings:
                wire = WireMeter(remote.client)
                meters[s] = (ChaosDraft(wire, s.chaos), wire)
                engines[s] = Engine(cfgs[s], target, meters[s][0])
            warm: set = set()
            for length in lengths:
                for doc in documents(docs[pair_name]):
                    prompt = prompt_ids(target.tokenizer, doc, length)
                    ref, ar = e2e.run_engine(engines["ar"], prompt, new_tokens, None, warm)
                    head = dict(pair=pair_name, length=length, prompt_tokens=len(prompt), doc=doc.name)
                    cells.append(dict(head, setting="ar", baseline="ar", **ar))
                    for s in settings:
                        ids, r = _measure(engines[s], meters[s], remote.worker, prompt, new_tokens, warm)
                        check = lossless_check(target.decoder, prompt, ref, ids, tol)
                        ok, div = check.pop("near_tie"), check["first_divergence"]
                        r.update(lossless=ok, **check, x_ar=r["decode_tokens_per_s"] / max(ar["decode_tokens_per_s"], 1e-9))
                        cells.append(dict(head, setting=s.label(), baseline=s.baseline, **r))
                        progress(f"{pair_name} L={length} {doc.name} {s.label()}: acceptance "
                                 f"{r['mean_acceptance_length']:.2f}, {r['decode_tokens_per_s']:.1f} decode tok/s, "
                                 f"{'identical' if div is None else 'near-tie' if ok else 'DIVERGED'}")
        finally:
            remote.stop()
            del engines, target, drafts
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    point_rows = [dict(sweep=sw, value=v, baseline=b, setting=s.label()) for sw, v, b, s in points]
    return dict(cells=cells, points=point_rows, summary=summarize(cells, point_rows), grid=asdict(grid),
                sweeps=list(sweeps), placement=placement)


KEYS = ("mean_acceptance_length", "decode_tokens_per_s", "x_ar", "draft_cache_tokens", "wire_bytes_per_step",
        "signal_bytes_per_step", "score_ms_per_refresh", "rebuild_ms")
COUNTS = ("updates_updates", "updates_dropped", "updates_late", "updates_repeated", "updates_delivered",
          "draft_rebuilds")


def summarize(cells: list[dict], points: list[dict]) -> list[dict]:
    """Per (pair, length, sweep, value, baseline): mean and spread over prompts of each measurement,
    the fault counters summed, and how many outputs were identical / lossless."""
    groups: dict[tuple, list[dict]] = {}
    for c in cells:
        groups.setdefault((c["pair"], c["length"], c["setting"]), []).append(c)
    out = []
    for pair, length in dict.fromkeys((c["pair"], c["length"]) for c in cells):
        for p in points:
            rs = groups.get((pair, length, p["setting"]), [])
            if not rs:
                continue
            s = dict(p, pair=pair, length=length, prompts=len(rs), identical=sum(r["identical"] for r in rs),
                     lossless=sum(r["lossless"] for r in rs))
            for key in KEYS:
                vals = [r[key] for r in rs]
                s[key] = statistics.fmean(vals)
                s[key + "_std"] = statistics.stdev(vals) if len(vals) > 1 else 0.0
            s.update({k: sum(r[k] for r in rs) for k in COUNTS})
            out.append(s)
    return out


def table(result: dict) -> str:
    """Markdown: one row per point (mean ± spread over prompts), then the lossless count."""
    lines = ["| pair | L | sweep | value | baseline | mean acc. len | decode tok/s | x ar | draft cache | "
             "updates sent / dropped / late / repeated / delivered | draft rebuilds | B/step (signal) | "
             "score ms | rebuild ms | identical / lossless |", "|" + "---|" * 15]
    for s in result["summary"]:
        value = "-" if s["sweep"] == "nominal" else s["value"]
        lines.append(
            f"| {s['pair']} | {s['length']} | {s['sweep']} | {value} | {s['baseline']} | "
            f"{s['mean_acceptance_length']:.2f} ± {s['mean_acceptance_length_std']:.2f} | "
            f"{s['decode_tokens_per_s']:.1f} ± {s['decode_tokens_per_s_std']:.1f} | {s['x_ar']:.2f} | "
            f"{s['draft_cache_tokens']:.0f} | {s['updates_updates']} / {s['updates_dropped']} / {s['updates_late']} / "
            f"{s['updates_repeated']} / {s['updates_delivered']} | {s['draft_rebuilds']} | "
            f"{s['wire_bytes_per_step']:.0f} ({s['signal_bytes_per_step']:.0f}) | {s['score_ms_per_refresh']:.3f} | "
            f"{s['rebuild_ms']:.3f} | {s['identical']} / {s['lossless']} of {s['prompts']} |")
    checked = [c for c in result["cells"] if c["baseline"] != "ar"]
    bad = [c for c in checked if not c["lossless"]]
    lines += ["", f"Lossless checks against `ar`: {len(checked)} outputs, {sum(c['identical'] for c in checked)} "
                  f"identical, {len(checked) - len(bad)} identical or first differing at a near-tie, {len(bad)} not. "
                  f"Draft placement: {result.get('placement', '-')}."]
    return "\n".join(lines)


def glance(result: dict) -> str:
    """One line: acceptance of each baseline's nominal cell at each pair's longest length, and the
    lossless count."""
    parts = []
    for pair in dict.fromkeys(s["pair"] for s in result["summary"]):
        top = max(s["length"] for s in result["summary"] if s["pair"] == pair)
        accs = ", ".join(f"{s['baseline']} {s['mean_acceptance_length']:.2f}" for s in result["summary"]
                         if s["pair"] == pair and s["length"] == top and s["sweep"] == "nominal")
        parts.append(f"{pair} pair at {top} tokens, acceptance: {accs}")
    checked = [c for c in result["cells"] if c["baseline"] != "ar"]
    return "; ".join(parts) + f"; {sum(c['lossless'] for c in checked)}/{len(checked)} outputs lossless"
