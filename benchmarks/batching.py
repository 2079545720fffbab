"""Batched steps across sessions (docs/architecture.md, "Batched steps"): aggregate decode tokens/s
of N concurrent sessions driven by one scheduler.Batcher, in process: one session per forward
(target and draft), the target's forwards batched (up to 8 sessions) with the draft's steps run one
at a time, and both batched (the draft worker runs queued steps of different sessions together).

  python benchmarks/batching.py --target random:llama-68m --sessions 1,4,8 --device cpu

Speculative modes use a random draft and replay the acceptance (`--replay`, labelled replayed):
random weights accept nothing. Prints a table and writes JSON next to this script's results.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from specextend.builder import build_engine
from specextend.config import EngineConfig, SamplingParams
from specextend.draft.worker import GATHER_S
from specextend.scheduler import Batcher

OUT = Path(__file__).parent / "results" / "batching"


def run(engine, n: int, max_batch: int, prompt_len: int, new_tokens: int, replay, draft_batch: int = 1,
        gather_s: float = 0.0) -> dict:
    b = Batcher(engine.target.decoder, max_batch)
    if engine.draft is not None:
        engine.draft.max_batch, engine.draft.gather_s = draft_batch, gather_s
        before = engine.draft.stats()
    done = threading.Event()
    ends, tokens = [], [0]

    def sink(item):
        if item is None or isinstance(item, BaseException):
            ends.append(item)
            if len(ends) == n:
                done.set()
        else:
            tokens[0] += len(item.token_ids)
        return True

    g = torch.Generator().manual_seed(n)
    vocab = engine.target.args.vocab_size
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    for i in range(n):
        ids = torch.randint(vocab, (prompt_len,), generator=g).tolist()
        b.add(engine.session(ids, params, replay=replay), sink)
    th = threading.Thread(target=b.run, daemon=True)
    th.start()
    done.wait()
    wall = time.perf_counter() - t0
    b.shutdown()
    th.join()
    bad = [e for e in ends if e is not None]
    if bad:
        raise bad[0]
    row = dict(sessions=n, max_batch=max_batch, tokens=tokens[0], wall_s=wall, tokens_per_s=tokens[0] / wall,
               forwards=b.forwards, mean_calls_per_forward=b.calls / max(b.forwards, 1))
    if engine.draft is not None:
        st = engine.draft.stats()
        fwd, calls = st.step_forwards - before.step_forwards, st.step_calls - before.step_calls
        row.update(draft_max_batch=draft_batch, draft_gather_s=gather_s, draft_steps=st.batched_steps - before.batched_steps,
                   draft_batches=st.step_batches - before.step_batches, draft_forwards=fwd,
                   draft_calls_per_forward=calls / max(fwd, 1))
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="random:llama-68m")
    p.add_argument("--draft", default="random:llama-68m")
    p.add_argument("--modes", default="ar,sd")
    p.add_argument("--sessions", default="1,4,8")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--replay", type=int, default=3, help="accepted draft tokens per step in speculative modes")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    a = p.parse_args(argv)
    rows = []
    for mode in a.modes.split(","):
        cfg = EngineConfig(target=a.target, draft=a.draft, mode=mode, device=a.device, dtype=a.dtype,
                           tree_policy="fixed")
        engine = build_engine(cfg)
        replay = None if mode == "ar" else [a.replay]
        run(engine, 2, 8, 16, 4, replay, 8)  # warm-up
        # (target batch, draft batch, the draft's gather wait)
        plans = ([(1, 1, 0.0), (8, 8, 0.0)] if mode == "ar" else
                 [(1, 1, 0.0), (8, 1, 0.0), (8, 8, 0.0), (8, 8, GATHER_S)])
        for n in [int(x) for x in a.sessions.split(",")]:
            got = [run(engine, n, mb, a.prompt_len, a.new_tokens, replay, db, gs) for mb, db, gs in plans]
            for r in got:
                rows.append(dict(mode=mode, replayed=replay is not None, **r))
            cells = [f"{r['tokens_per_s']:7.1f} tok/s ({r['mean_calls_per_forward']:.1f}"
                     + (f"/{r['draft_calls_per_forward']:.1f}" if "draft_calls_per_forward" in r else "") + ")"
                     for r in got]
            print(f"{mode:4s} sessions {n:2d}: " + "  ".join(f"{mb}/{db}{'w' if gs else ''}: {c}"
                                                        for (mb, db, gs), c in zip(plans, cells))
                  + f"  -> {got[-1]['tokens_per_s'] / got[0]['tokens_per_s']:.2f}x", flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    device = a.device if a.device == "cpu" else torch.cuda.get_device_name()
    meta = dict(commit=commit, device=device, date=datetime.date.today().isoformat(),
                command="python benchmarks/batching.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                threads=torch.get_num_threads())
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"batching-{a.device}.json"
    path.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
