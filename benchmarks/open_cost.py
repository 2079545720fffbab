"""What a draft's open (its prefill of a long prompt) costs, alone and beside the target's decoding,
and where the time goes: each prefill chunk's host time (launching its forward) and device time
(CUDA events on the draft worker's stream), the rebuild of the working cache, and the open as the
engine's request timed it (stats.draft_open_s) with the plain steps decoded meanwhile.

In process, both models on one device, warmed as a served replica warms itself (warm_up, then
warm_long), the prefix cache off; prompts no cache has seen (random ids or a document's), each a
few odd tokens longer than `--length`, and the late work each call met (late_work.py). Prints a
table, writes JSON (commit, device, date, command) under results/open/.

    python benchmarks/open_cost.py --target random:qwen2.5-1.5b --draft random:qwen2.5-0.5b --length 16384
    python benchmarks/open_cost.py --target default --draft default --doc python --length 4096
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from specextend.bench.record import write_rows
from specextend.bench.texts import documents, prompt_ids
from specextend.builder import build_engine
from specextend.config import EngineConfig, SamplingParams
from specextend.draft.base import DraftSessionParams
from specextend.draft.jobs import Open
from specextend.draft.session import DraftSession
from specextend.draft.worker import DraftWorker
from specextend.models.decoder import Decoder
from specextend.models import late_work
from specextend.warmup import warm_long, warm_up


# host time of the open's other parts: the job on the worker's thread, the session's set-up, its caches
WRAPPED = ((DraftWorker, "_open"), (DraftSession, "__init__"), (DraftSession, "_init_overlap"), (Decoder, "new_cache"))
PREFILL_ROWS = 128  # a forward of at least this many tokens is a prefill chunk
SLOW_MS = 5.0  # a smaller forward (a prompt's last chunk, a catch-up) listed when its host time is longer


class ChunkTimes:
    """Wraps DraftSession's committed forward and rebuild: host seconds of each call, and device
    seconds between CUDA events recorded around it on the calling thread's current stream."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, float, object, object]] = []  # kind, rows, host s, events
        self._fwd, self._reb = DraftSession._forward_committed_co, DraftSession._rebuild
        times = self

        def fwd(session, ids, *a, **k):
            t, ev = time.perf_counter(), times._event()
            out = yield from times._fwd(session, ids, *a, **k)
            times.calls.append(("forward", len(ids), time.perf_counter() - t, ev, times._event()))
            return out

        def reb(session, *a, **k):
            t, ev = time.perf_counter(), times._event()
            out = times._reb(session, *a, **k)
            times.calls.append(("rebuild", 0, time.perf_counter() - t, ev, times._event()))
            return out
        DraftSession._forward_committed_co, DraftSession._rebuild = fwd, reb
        for owner, name in WRAPPED:
            setattr(owner, name, self._host_timed(name, getattr(owner, name)))

    def _host_timed(self, name: str, fn):
        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.calls.append((name, 0, time.perf_counter() - t, None, None))
        return timed

    @staticmethod
    def _event():
        if not torch.cuda.is_available():
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def take(self) -> list[dict]:
        """The calls recorded since the last take (their events waited for)."""
        out = []
        for kind, rows, host, a, b in self.calls:
            if kind not in ("forward", "rebuild"):
                out.append(dict(kind=kind, rows=rows, host_ms=1e3 * host, device_ms=None))
                continue
            dev = None
            if a is not None:
                b.synchronize()
                dev = a.elapsed_time(b) / 1e3
            out.append(dict(kind=kind, rows=rows, host_ms=1e3 * host, device_ms=None if dev is None else 1e3 * dev))
        self.calls.clear()
        return out


class Prompts:
    """Each call a prompt no cache has seen: random ids, or a document's (a tag ahead of it), `length`
    tokens plus the call's odd extra few (a last prefill chunk of a new size, as real prompts have)."""

    def __init__(self, tokenizer, vocab: int, length: int, doc: str) -> None:
        self.tokenizer, self.vocab, self.length, self.n = tokenizer, vocab, length, 0
        self.doc = prompt_ids(tokenizer, documents([doc])[0], length) if doc else None

    def __call__(self) -> list[int]:
        self.n += 1
        extra = (37 * self.n) % 61
        if self.doc is None:
            g = torch.Generator().manual_seed(self.n)
            return torch.randint(100, self.vocab - 100, (self.length + extra,), generator=g).tolist()
        tag = self.tokenizer.encode(f"[{self.n} {'x' * extra}] ", add_special_tokens=False)
        return list(tag) + self.doc


def summary(calls: list[dict]) -> dict:
    fw = [c for c in calls if c["kind"] == "forward" and c["rows"] >= PREFILL_ROWS]  # (not a step's catch-up)
    rb = [c for c in calls if c["kind"] == "rebuild"][:1]  # (the prefill's: not a step's refresh)
    parts = {}
    for c in calls:
        if c["kind"] not in ("forward", "rebuild"):
            parts[c["kind"]] = parts.get(c["kind"], 0.0) + c["host_ms"]
    small = [c for c in calls if c["kind"] == "forward" and c["rows"] < PREFILL_ROWS]  # (a prompt's last chunk too)
    calls = fw + rb
    s = dict(chunks=len(fw), host_ms=sum(c["host_ms"] for c in calls))
    s["forward_host_ms"] = sum(c["host_ms"] for c in fw)
    s["rebuild_host_ms"] = sum(c["host_ms"] for c in rb)
    if fw and fw[0]["device_ms"] is not None:
        s["forward_device_ms"] = sum(c["device_ms"] for c in fw)
        s["rebuild_device_ms"] = sum(c["device_ms"] for c in rb)
    s["parts_host_ms"] = parts
    s["slow_small_forwards"] = [(c["rows"], round(c["host_ms"], 1)) for c in small if c["host_ms"] > SLOW_MS]
    return s


def new_late(before: dict) -> dict:
    """Late work (graph captures, kernel compiles, full collections) since `before`."""
    return {k: v - before[k] for k, v in late_work.counts().items() if v > before[k]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="random:qwen2.5-1.5b")
    p.add_argument("--draft", default="random:qwen2.5-0.5b")
    p.add_argument("--length", type=int, default=16384)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--doc", default="", help="a document's prompt (bench texts, e.g. python) instead of random ids")
    p.add_argument("--switch-interval", type=float, default=0.0,
                   help="sys.setswitchinterval for a third round (0: none)")
    p.add_argument("--cudnn", action="store_true", help="cuDNN attention back on after the build (the A/B's other arm)")
    p.add_argument("--masked-window", action="store_true",
                   help="the draft's windowed prefill as one masked call on every device (attention/window.py's twin)")
    p.add_argument("--blocks-window", action="store_true",
                   help="the draft's windowed prefill in blocks on every device (production takes them on the CPU only)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/open"))
    a = p.parse_args(argv)
    if a.masked_window:
        from specextend.attention.backends import AttentionBackend, TorchBackend

        TorchBackend.takes_window_blocks = AttentionBackend.takes_window_blocks
    elif a.blocks_window:
        from specextend.attention.backends import TorchBackend
        from specextend.attention.window import blocks_pay

        TorchBackend.takes_window_blocks = lambda self, rows, window, device: blocks_pay(rows, window)
    cfg = EngineConfig(target=a.target, draft=a.draft, device=a.device, tree_policy="adaptive",
                       max_prompt_tokens=a.length + 256, prefix_cache_gb=0)
    t0 = time.perf_counter()
    engine = build_engine(cfg)
    if a.cudnn:
        torch.backends.cuda.enable_cudnn_sdp(True)
    engine.defer_opens = False  # every speculative request opens its draft at once (the open measured)
    vocab = engine.target.args.vocab_size
    ids = [(7 * i + 3) % vocab for i in range(12)]
    warm_up(engine, ids * 8)
    warm_long(engine, ids)
    print(f"built and warmed in {time.perf_counter() - t0:.1f} s", flush=True)
    late_work.mark_ready()
    prompt = Prompts(engine.target.tokenizer, vocab, a.length, a.doc)
    times = ChunkTimes()
    params = DraftSessionParams(cfg.tree, cfg.retrieval, a.new_tokens, cfg.lookup_tokens)
    rows = []
    rounds = [("default", sys.getswitchinterval())]
    if a.switch_interval:
        rounds.append(("switch", a.switch_interval))
    for label, interval in rounds:
        sys.setswitchinterval(interval)
        for rep in range(a.reps):
            times.take()
            late = late_work.counts()
            torch.cuda.synchronize() if a.device == "cuda" else None
            t = time.perf_counter()
            fut = engine.draft.submit(Open(f"alone-{rep}", tuple(prompt()), params))
            fut.result()
            host = time.perf_counter() - t
            queued = getattr(fut, "started", t) - t
            torch.cuda.synchronize() if a.device == "cuda" else None
            wall = time.perf_counter() - t
            engine.draft.close(f"alone-{rep}")
            rows.append(dict(round=label, case="open alone", rep=rep, open_ms=1e3 * host, done_ms=1e3 * wall,
                             queued_ms=1e3 * queued,
                             late=new_late(late), **summary(times.take())))
            for speculate in (True, False):
                late = late_work.counts()
                t = time.perf_counter()
                _, _, st = engine.generate(prompt(),
                                           SamplingParams(max_new_tokens=a.new_tokens, ignore_eos=True),
                                           speculate=speculate)
                wall = time.perf_counter() - t
                rows.append(dict(round=label, case="request" if speculate else "request ar", rep=rep,
                                 open_ms=1e3 * st.draft_open_s, done_ms=1e3 * wall,
                                 open_steps=st.open_steps, steps=st.num_steps, prefill_ms=1e3 * st.prefill_s,
                                 decode_tok_s=(st.num_generated - 1) / max(st.decode_s, 1e-9),
                                 late=new_late(late), **summary(times.take())))
            for r in rows[-3:]:
                print(json.dumps(r), flush=True)
    print("| round | case | rep | open ms | chunks | host ms (fwd / rebuild) | device ms (fwd / rebuild) | open steps"
          " | decode tok/s | late | other parts, host ms |\n|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        dev = (f"{r.get('forward_device_ms', 0):.1f} / {r.get('rebuild_device_ms', 0):.1f}"
               if "forward_device_ms" in r else "-")
        slow = f"; slow small forwards (rows, ms) {r['slow_small_forwards']}" if r["slow_small_forwards"] else ""
        print(f"| {r['round']} | {r['case']} | {r['rep']} | {r['open_ms']:.1f} | {r['chunks']} | "
              f"{r['forward_host_ms']:.1f} / {r['rebuild_host_ms']:.1f} | {dev} | {r.get('open_steps', '-')} | "
              f"{r.get('decode_tok_s', 0):.1f} | {r['late'] or ''} | "
              f"{', '.join(f'{k} {v:.1f}' for k, v in r['parts_host_ms'].items())}{slow} |")
    alone = [r["open_ms"] for r in rows if r["case"] == "open alone"]
    print(f"open alone: median {statistics.median(alone):.1f} ms")
    arm = ("-cudnn" if a.cudnn else "") + ("-masked" if a.masked_window else "") + ("-blocks" if a.blocks_window else "")
    path = write_rows(a.out, f"open-cost-{a.doc or 'random'}-{a.length}{arm}-", "open_cost", a, rows, sys.argv[1:])
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
