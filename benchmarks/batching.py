"""Batched steps across sessions (docs/architecture.md, "Batched steps"): aggregate decode tokens/s
of N concurrent sessions driven by one scheduler.Batcher, in process: one session per forward
(target and draft), the target's forwards batched eagerly (the rows of every call through eager
matrix products), the same batched through the full-step graphs (CUDA: FullStepGraphs.forward_batch),
and for speculative modes the draft's steps batched too (the draft worker runs queued steps of
different sessions together).

  python benchmarks/batching.py --target random:llama-68m --sessions 1,4,8 --device cpu
  python benchmarks/batching.py --target random:llama-3.1-8b --draft random:llama-68m --device cuda \
      --dtype bfloat16 --modes ar,specextend --sessions 1,4,8,16 --prompt-len 4096,16384

Decode tokens/s count the tokens emitted after every session has its first token, over the time
from then to the last; prefill is not in them. `fwd a/b ms`: a target forward's time (the device's,
on CUDA) against the time per forward of the decode: the rest is the device idling while the host
advances the sessions (and, in speculative modes, drafts). Beside `ar` the bytes-moved ceiling: a step of B
sessions reads the weights once and B caches, at the copy bandwidth measured here. Speculative
modes use a random draft and replay the acceptance (`--replay`, labelled replayed): random weights
accept nothing. Prints a table and writes JSON next to this script's results.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import torch

from specextend.bench import record
from specextend.bench.kernels import copy_bandwidth
from specextend.bench.texts import documents, window_prompts

from specextend.builder import build_engine
from specextend.config import EngineConfig, SamplingParams
from specextend.draft.worker import GATHER_S
from specextend import round_log
from specextend.governor import FREE, ORDER, PLAIN, TREES, Governor
from specextend.models.full_graphs import FullStepGraphs
from specextend.warmup import warm_up
from specextend.scheduler import Batcher

OUT = Path(__file__).parent / "results" / "batching"
sys.path.insert(0, str(Path(__file__).parent))
from draft_rounds import print_profiles, profile_control  # noqa: E402


WAIT_OPENS = [True]  # (--opens)


def run(engine, n: int, max_batch: int, prompt_len: int, new_tokens: int, replay, draft_batch: int = 1,
        gather_s: float = 0.0, graph_batch: bool = False, governor=False, on_decode=None,
        profiler=None, doc: str = "") -> dict:
    """One run of n sessions; `on_decode()` is called when every session has its first token;
    `governor`: the batcher checks the sessions' choices as a served replica's does (governor.py;
    True, the order of its measurement's regimes, or a Governor kept from run to run); `doc`: the
    sessions' prompts are windows of that document (bench/texts.py) instead of random tokens;
    `profiler` (torch.profiler's): started on this thread, which stops it, once decoding starts."""
    gov = (governor if isinstance(governor, Governor) else Governor(order=governor) if isinstance(governor, tuple)
           else Governor()) if governor else None
    # (an in-process draft shares the device: a round held to trees waits for its opens, as a replica's
    # with draft_in_replica does; --opens beside: they run beside the rounds)
    b = Batcher(engine.target.decoder, max_batch, governor=gov, wait_opens=engine.draft is not None and WAIT_OPENS[0])
    graphs = engine.target.decoder.graphs
    if isinstance(graphs, FullStepGraphs):
        graphs.batching = graph_batch
    if engine.draft is not None:
        engine.draft.max_batch, engine.draft.gather_s = draft_batch, gather_s
        before = engine.draft.stats()
    done, decoding = threading.Event(), threading.Event()
    ends, tokens = [], [0]
    started: dict = {}  # each session that emitted: its RequestStats (its steps by kind)
    decode = dict(t0=None, tokens=0, t1=None)  # after every session's first token

    def sink(item):
        if item is None or isinstance(item, BaseException):
            ends.append(item)
            if len(ends) == n:
                done.set()
        else:
            now = time.perf_counter()
            tokens[0] += len(item.token_ids)
            if decode["t0"] is not None:
                decode["tokens"] += len(item.token_ids)
                decode["t1"] = now
            started[id(item.stats)] = item.stats
            if decode["t0"] is None and len(started) == n:
                decode["t0"] = now
                marks.append(len(b.spans))
                decoding.set()
                if on_decode is not None:
                    on_decode()
        return True

    g = torch.Generator().manual_seed(n)
    vocab = engine.target.args.vocab_size
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    t0, wall0 = time.perf_counter(), time.time()
    marks: list = []  # (time, forwards) when decoding starts (every session has its first token)
    docs = window_prompts(engine.target.tokenizer, documents([doc])[0], prompt_len, n) if doc else None
    for i in range(n):
        ids = docs[i] if docs else torch.randint(vocab, (prompt_len,), generator=g).tolist()
        load = b.new_load()  # (as the replica's sessions: told of the shared forwards, lent a cache slot)
        b.add(engine.session(ids, params, replay=replay, load=load), sink, load)
    th = threading.Thread(target=b.run, daemon=True, name="batcher")
    th.start()
    if profiler is not None:
        decoding.wait()
        profiler.start()
    done.wait()
    wall = time.perf_counter() - t0
    b.shutdown()
    th.join()
    bad = [e for e in ends if e is not None]
    if bad:
        raise bad[0]
    dt = (decode["t1"] or 0) - (decode["t0"] or 0)
    spans = list(b.spans)[marks[0] if marks else 0:]
    busy = sum(s.seconds() for s in spans)  # the decode's target forwards, device time on CUDA
    row = dict(sessions=n, max_batch=max_batch, graph_batch=graph_batch, governor=gov.summary() if gov else None,
               tokens=tokens[0], wall_s=wall,
               tokens_per_s=tokens[0] / wall, decode_tokens_per_s=decode["tokens"] / dt if dt > 0 else 0.0,
               forwards=b.forwards, mean_calls_per_forward=b.calls / max(b.forwards, 1),
               decode_forwards=len(spans), forward_ms=1e3 * busy / max(len(spans), 1),
               round_ms=1e3 * dt / max(len(spans), 1))
    row["steps"] = {k: sum(getattr(st, k) for st in started.values())  # (every session's, prefill to end)
                    for k in ("num_steps", "plain_steps", "open_steps", "lookup_steps", "ahead_steps")}
    if b.round_log.on:  # SPECEXTEND_ROUND_LOG: this run's rounds, from the first decode round, summed up
        b.round_log.close()
        since = wall0 + (decode["t0"] or t0) - t0
        row["rounds"] = round_log.summary(round_log.read(str(b.round_log.path.parent), since, time.time()))
    if engine.draft is not None:
        st = engine.draft.stats()
        fwd, calls = st.step_forwards - before.step_forwards, st.step_calls - before.step_calls
        row.update(draft_max_batch=draft_batch, draft_gather_s=gather_s, draft_steps=st.batched_steps - before.batched_steps,
                   draft_batches=st.step_batches - before.step_batches, draft_forwards=fwd,
                   draft_calls_per_forward=calls / max(fwd, 1))
        trees = engine.draft.model.tree_graphs  # (None: no tree graphs)
        if trees is not None:  # whole expansions run batched (draft/tree_batch.py), sessions they carried
            row.update(draft_tree_batches=trees.batches.replays, draft_tree_batch_sessions=trees.batches.sessions)
    return row


def plan_label(mb: int, db: int, gs: float, gb: bool, gv=False) -> str:
    """A plan's cell label: target batch / draft batch, w(ait to gather), g(raphs), G(overnor; Gf:
    its measurement's free window first, as before 2026-12-02's order)."""
    order = "f" if isinstance(gv, tuple) and gv[0] == FREE else ""
    return f"{mb}/{db}{'w' if gs else ''}{'g' if gb else ''}{'G' + order if gv else ''}"


def print_kernels(title: str, prof, row: dict, top: int) -> list:
    """The `top` kernels by device time in a profiled run's decode, per round (decode forward), beside
    the round's wall time; returns them as rows for the JSON."""
    rounds = max(row["decode_forwards"], 1)
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    events.sort(key=lambda e: -e.self_device_time_total)
    busy = sum(e.self_device_time_total for e in events) / rounds  # us of kernels a round
    print(f"{title}: {rounds} rounds of {row['round_ms']:.1f} ms, kernels {busy / 1e3:.2f} ms a round")
    out = []
    for e in events[:top]:
        us, calls = e.self_device_time_total / rounds, e.count / rounds
        out.append(dict(kernel=e.key, us_per_round=us, calls_per_round=calls))
        print(f"  {us:9.1f} us {calls:7.1f} x  {e.key[:110]}")
    return out


def ceiling(engine, n: int, prompt_len: int, new_tokens: int, bw: float) -> float:
    """Plain decoding's tokens/s if a step of n sessions took the time to read the weights once and
    n caches (at the mean context of the decode) at bandwidth bw (the floor of bench/kernels.py)."""
    if not bw:
        return 0.0
    dec = engine.target.decoder
    weights = dec.args.num_params() * dec.w.embed.element_size()
    kv = dec.args.kv_bytes_per_token(dec.dtype) * (prompt_len + new_tokens / 2)
    return n * bw / (weights + n * kv)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="random:llama-68m")
    p.add_argument("--draft", default="random:llama-68m")
    p.add_argument("--modes", default="ar,sd")
    p.add_argument("--sessions", default="1,4,8")
    p.add_argument("--prompt-len", default="256", help="comma-separated prompt lengths")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--replay", type=int, default=3, help="accepted draft tokens per step in speculative modes "
                   "(0: none, the draft's own acceptance: a real pair, with --docs)")
    p.add_argument("--docs", default="", help="each session's prompt a window of this document (nodejs, "
                   "shakespeare, python: bench/texts.py), not random tokens")
    p.add_argument("--tag", default="", help="the JSON file's suffix: batching-<device>[-adaptive][-TAG].json")
    p.add_argument("--governor-persist", action="store_true",
                   help="one governor for a mode's timed runs, as a served replica keeps its own from burst to "
                        "burst (its verdicts by batch size carry; --sessions 4,8,16 grows the load)")
    p.add_argument("--production-only", action="store_true",
                   help="only the plan a served replica runs (graphed target batch; the draft's batch of 8 "
                        "with its gather wait)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tree-policy", default="fixed", choices=["fixed", "adaptive"])
    p.add_argument("--plain-ahead", default="on", choices=["on", "off", "both"],
                   help="ar: plain steps queued a token ahead (on), the twin that reads each token first (off), or "
                        "both in turn on the same engine (rows `ar` and `ar-twin`)")
    p.add_argument("--graph-batch-only", action="store_true",
                   help="only the plan that batches the target through the full-step graphs (and, alone, the step graphs)")
    p.add_argument("--batch-trees", default="default", choices=["default", "on", "off"],
                   help="the draft worker's batch_trees (draft/tree_batch.py): batched steps' whole expansions as one graph")
    p.add_argument("--governor", default="off", choices=["off", "on", "both"],
                   help="speculative modes: the batcher's governor (governor.py; a served replica's default: on), "
                        "or each plan without and with it (cells marked G)")
    p.add_argument("--governor-order", default="now", choices=["now", "both"],
                   help=f"the governor's measurement: its regimes in today's order ({', '.join(ORDER)}), or "
                        "each governed plan also with the free window first (cells marked Gf)")
    p.add_argument("--profile", choices=["cpu", "wall"], default=None,
                   help="each plan's timed run again, its decode under yappi (this clock): each thread's busiest "
                        "functions")
    p.add_argument("--kernels", type=int, default=0, metavar="N",
                   help="CUDA: each plan's timed run again, its decode under torch.profiler: the N kernels "
                        "(target's and draft's) that took the most device time, per round")
    p.add_argument("--opens", choices=["wait", "beside"], default="wait",
                   help="with the governor, a round held to trees while drafts open waits for the opens (a "
                        "replica's with the draft in its process) or runs beside them (before 2026-12-03)")
    p.add_argument("--switch-interval-ms", type=float, default=0.0,
                   help="sys.setswitchinterval, as the app's switch_interval_ms (0: the interpreter's, 5 ms): the "
                        "longest the batcher's thread waits for the interpreter lock while a draft thread holds it")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads on the CPU (0: torch's): 1 as in a served replica, whose actor "
                        "Ray starts with OMP_NUM_THREADS=1; with more, a thread's team of threads that another "
                        "thread's torch work left behind (the warm-up's) slowed the batcher's forwards 3.5x")
    a = p.parse_args(argv)
    if a.kernels and a.device == "cpu":  # (the batcher thread's CPU operators are not recorded: --profile)
        p.error("--kernels profiles CUDA kernels; on the CPU use --profile")
    if a.device == "cpu" and a.threads:
        torch.set_num_threads(a.threads)
    WAIT_OPENS[0] = a.opens == "wait"
    if a.switch_interval_ms:  # (as a replica's switch_interval_ms)
        sys.setswitchinterval(a.switch_interval_ms / 1e3)
    rows = []
    bw = copy_bandwidth(torch.device(a.device)) if a.device != "cpu" else 0.0  # no ceiling on the CPU
    lengths = [int(x) for x in a.prompt_len.split(",")]
    commit = record.commit()
    device = a.device if a.device == "cpu" else torch.cuda.get_device_name()
    meta = dict(commit=commit, device=device, date=datetime.date.today().isoformat(),
                command="python benchmarks/batching.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                threads=torch.get_num_threads(), copy_bandwidth=bw, switch_interval_s=sys.getswitchinterval(),
                opens=a.opens)
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"batching-{a.device}{'-adaptive' if a.tree_policy == 'adaptive' else ''}{'-' + a.tag if a.tag else ''}.json"
    for mode in a.modes.split(","):
        cfg = EngineConfig(target=a.target, draft=a.draft, mode=mode, device=a.device, dtype=a.dtype,
                           tree_policy=a.tree_policy)
        engine = build_engine(cfg)
        replay = None if mode == "ar" or not a.replay else [a.replay]
        if engine.draft is not None and a.batch_trees != "default":
            engine.draft.batch_trees = a.batch_trees == "on"
        graphed = isinstance(engine.target.decoder.graphs, FullStepGraphs)
        sessions = [int(x) for x in a.sessions.split(",")]
        warm_up(engine, list(range(1, 65)), max(sessions))  # as a served replica starts: every shape captured
        if engine.draft is not None:  # (the draft's opens timed at start-up: warmup.warm_opens)
            meta.setdefault("opens_timed_s", {})[mode] = {n: round(x, 4) for n, x in engine.open_costs.timed().items()}
        aheads = {"on": [True], "off": [False], "both": [True, False]}[a.plain_ahead] if mode == "ar" else [True]
        kept = None  # (--governor-persist: the mode's governor)
        for length, n, ahead in ((x, y, z) for x in lengths for y in sessions for z in aheads):
            engine.config = replace(engine.config, plain_ahead=ahead)  # (interleaved: the same engine)
            label = mode if ahead else f"{mode}-twin"
            # (target batch, draft batch, the draft's gather wait, the target's batch through graphs)
            plans = [(1, 1, 0.0, False), (n, 1 if mode == "ar" else 8, 0.0, False)]
            if graphed:
                plans.append((n, plans[-1][1], 0.0, True))
            if mode != "ar":
                plans.append((n, 8, GATHER_S, graphed))
                if graphed:  # the draft's steps one at a time, each through its tree graphs
                    plans.append((n, 1, 0.0, True))
            if a.graph_batch_only:
                plans = [pl for pl in plans if pl[3]] or plans[-1:]
            if a.production_only:  # (the replica's: batched through graphs where captured, the draft's gather)
                plans = list(dict.fromkeys(  # (one session's plans coincide: each once)
                    pl for pl in plans if pl[0] == n and pl[3] == graphed and (mode == "ar" or pl[2] == GATHER_S)))
            govs = {"off": [False], "on": [True], "both": [False, True]}[a.governor] if mode != "ar" else [False]
            if a.governor_order == "both":  # (each governed plan with the measurement's order as now, then free first)
                govs = [g for v in govs for g in ([v, (FREE, PLAIN, TREES)] if v else [v])]
            if a.governor_persist:  # (the mode's own governor, carried from one timed run to the next)
                kept = kept or Governor()
                govs = [kept if g is True else g for g in govs]
            plans = [(*pl, g) for pl in plans for g in govs]  # (+ the batch's governor)
            got = []
            for mb, db, gs, gb, gv in plans:  # each plan's shapes captured first (a short run), then timed
                run(engine, n, mb, 16, 4, replay, db, gs, gb)
                got.append(run(engine, n, mb, length, a.new_tokens, replay, db, gs, gb, gv, doc=a.docs))
                if a.profile:  # the same run's decode again under yappi: each thread's busiest functions
                    run(engine, n, mb, length, a.new_tokens, replay, db, gs, gb, gv,
                        on_decode=lambda: profile_control(("start", a.profile)))
                    got[-1]["profile"] = profile_control(("stop", 40))
                    print_profiles(f"{label} L {length} plan {plan_label(mb, db, gs, gb)}",
                                   {n: got[-1]["profile"]})
                if a.kernels:  # the same run's decode again under torch.profiler: the device's kernels
                    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
                    again = run(engine, n, mb, length, a.new_tokens, replay, db, gs, gb, gv, profiler=prof)
                    prof.stop()
                    got[-1]["kernels"] = print_kernels(
                        f"{label} L {length} sessions {n} plan {plan_label(mb, db, gs, gb, gv)}", prof, again,
                        a.kernels)
            top = ceiling(engine, n, length, a.new_tokens, bw) if mode == "ar" else 0.0
            for r in got:
                rows.append(dict(mode=label, plain_ahead=ahead, prompt_len=length, replayed=replay is not None, docs=a.docs,
                                 tree_policy=a.tree_policy,
                                 ceiling_tokens_per_s=top, **r))
            cells = [f"{r['decode_tokens_per_s']:7.1f} tok/s ({r['mean_calls_per_forward']:.1f}"
                     + (f"/{r['draft_calls_per_forward']:.1f}" if "draft_calls_per_forward" in r else "")
                     + (f", tree batches {r['draft_tree_batches']}" if r.get("draft_tree_batches") else "")
                     + f", fwd {r['forward_ms']:.1f}/{r['round_ms']:.1f} ms)" for r in got]
            best = max(r["decode_tokens_per_s"] for r in got)
            print(f"{label:10s} L {length:6d} sessions {n:2d}: "
                  + "  ".join(f"{plan_label(mb, db, gs, gb, gv)}: {c}"
                              for (mb, db, gs, gb, gv), c in zip(plans, cells))
                  + f"  -> {best / max(got[0]['decode_tokens_per_s'], 1e-9):.2f}x"
                  + (f", {best / top:.0%} of the {top:.0f} tok/s ceiling" if top else ""), flush=True)
            path.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")  # a cut run keeps its rows
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
