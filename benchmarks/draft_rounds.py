"""A round of N sessions' draft steps on the real draft worker, where its time goes
(docs/architecture.md, "Draft side"): the draft as the draft actor builds it (`load_pair`,
`builder.draft_worker`, warmed up), N sessions opened on prompts of L tokens, then rounds in which
every session steps at once from a pool of 8 threads, as `scheduler.Batcher` issues a round's draft
steps. Each step sends the accepted path of the session's last tree (`--replay` nodes along its
first branch) and a bonus token the tree did not hold (a miss, as without overlap), with a
retrieval selection every `retrieval_every` steps, as the target does.

Paths: `direct` (the worker called in this process, as in-process serving does) and `zmq` (the
worker behind the product's draft server in a process of its own, reached through the product's
client and ZeroMQ step channel, as a served replica reaches its draft actor). A round is timed from
its first call to its last answer. `--profile cpu|wall` then runs the same rounds again under
yappi in the draft's process and prints each thread's busiest functions (own time) and its total:
what a round of N steps costs on the host beside its device time.

  python benchmarks/draft_rounds.py --draft random:llama-68m-succ --target random:llama-3.1-8b-succ \
      --device cuda --dtype bfloat16 --sessions 1,2,4,8 --prompt-len 4096 --paths direct,zmq --profile cpu

Prints a table (median and p90 of a round in ms, per step) and writes JSON under results/draft/.
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Optional, Sequence

sys.path.insert(0, str(Path(__file__).parent))
from rpc_roundtrip import percentile, write_record  # noqa: E402

from specextend.config import EngineConfig  # noqa: E402
from specextend.draft.base import DraftSessionParams, DraftTree, Retrieval  # noqa: E402

OUT = Path(__file__).parent / "results" / "draft"
THREADS = 8  # the Batcher's draft-call pool (scheduler.Batcher)
CALLERS_OF = 8  # a profile names the callers of this many of a thread's busiest functions


def config_of(a) -> EngineConfig:
    return EngineConfig(target=a.target, draft=a.draft, mode="specextend", device=a.device, dtype=a.dtype)


def load_worker(cfg: EngineConfig):
    """The draft and its worker as the draft actor makes them (alone on their device)."""
    from specextend.builder import draft_worker, load_pair

    _, model = load_pair(cfg, roles=("draft",), light=("target", "draft"))
    return draft_worker(cfg, model, beside_target=False), model


class Sessions:
    """N sessions' prompts and what each sends next: its last tree's first branch and a bonus token."""

    def __init__(self, n: int, prompt_len: int, vocab: int, replay: int, cfg: EngineConfig, seed: int = 0):
        rng = random.Random(seed)
        self.vocab, self.replay, self.rng = vocab, replay, rng
        self.ret = cfg.retrieval
        self.ids = [f"s{i}" for i in range(n)]
        self.prompts = {sid: [rng.randrange(vocab) for _ in range(prompt_len)] for sid in self.ids}
        self.length = {sid: prompt_len for sid in self.ids}
        self.last: dict[str, Optional[DraftTree]] = {sid: None for sid in self.ids}
        self.step = 0  # the next round's step number

    def call(self, sid: str, k: int) -> tuple:
        """(accepted tokens, retrieval or None) of session `sid`'s step k."""
        tree, path = self.last[sid], []
        if tree is not None:  # the first branch, `replay` deep
            node = -1
            for _ in range(self.replay):
                child = next((i for i, p in enumerate(tree.parents) if p == node), None)
                if child is None:
                    break
                path.append(tree.tokens[child])
                node = child
        accepted = path + [self.rng.randrange(self.vocab)]
        self.length[sid] += len(accepted)
        retrieval = None
        if k % self.ret.every == 0:  # sorted chunk ids of the committed context, the last included
            chunks = self.length[sid] // self.ret.chunk_size
            pick = sorted(self.rng.sample(range(chunks - 1), min(self.ret.top_k - 1, chunks - 1)) + [chunks - 1])
            retrieval = Retrieval(tuple(pick), self.ret.chunk_size)
        return accepted, retrieval


def rounds_of(backend, s: Sessions, pool: ThreadPoolExecutor, rounds: int) -> list[float]:
    """Each round's wall time in ms: every session steps at once."""
    out = []
    for k in range(s.step, s.step + rounds):
        calls = {sid: s.call(sid, k) for sid in s.ids}
        t = time.perf_counter()
        futures = {sid: pool.submit(backend.step, sid, k, acc, ret, None) for sid, (acc, ret) in calls.items()}
        wait(futures.values())
        out.append((time.perf_counter() - t) * 1e3)
        for sid, f in futures.items():
            s.last[sid] = f.result()
    s.step += rounds
    return out


def measure(backend, vocab: int, counts: list[int], a, cfg: EngineConfig, control=None) -> dict:
    """Per count: the rounds' wall times (ms); fresh sessions for each count. `control(msg)`: asks
    the draft's process to start or stop its profile (None in process: yappi here)."""
    params = DraftSessionParams(cfg.tree, cfg.retrieval, max_new_tokens=(a.rounds + a.warmup) * (a.replay + 1) + 64)
    out, profiles = {}, {}
    with ThreadPoolExecutor(THREADS) as pool:
        for n in counts:
            s = Sessions(n, a.prompt_len, vocab, a.replay, cfg, seed=n)
            for sid in s.ids:
                backend.open(sid, s.prompts[sid], params)
            rounds_of(backend, s, pool, a.warmup)
            out[n] = rounds_of(backend, s, pool, a.rounds)
            if a.profile and n in a.profile_counts:
                control(("start", a.profile))
                rounds_of(backend, s, pool, a.rounds)
                profiles[n] = control(("stop", a.top))
            for sid in s.ids:
                backend.close(sid)
    return dict(rounds=out, profiles=profiles)


def profile_control(msg):
    """Starts yappi with the clock named, or stops it and returns each thread's summary."""
    import yappi

    if msg[0] == "start":
        yappi.clear_stats()
        yappi.set_clock_type(msg[1])
        yappi.start(builtins=True)
        return None
    yappi.stop()
    top, threads = msg[1], []
    name = lambda f: f"{Path(f.module).name}:{f.lineno} {f.name}"  # noqa: E731
    for t in yappi.get_thread_stats():
        stats = sorted(yappi.get_func_stats(filter_callback=lambda f, i=t.id: f.ctx_id == i),  # (ctx_id=0 reads
                       key=lambda f: f.tsub, reverse=True)  # as no filter)
        if t.ttot < 1e-3:
            continue
        callers: dict = {}  # a function's full name -> [(caller, seconds in it from there, calls)]
        for f in stats:
            for c in f.children:
                callers.setdefault(c.full_name, []).append((name(f), c.ttot, c.ncall))
        threads.append(dict(name=t.name, id=t.id, total_s=t.ttot, top=[
            dict(fn=name(f), own_s=f.tsub, total_s=f.ttot, calls=f.ncall,
                 callers=sorted(callers.get(f.full_name, []), key=lambda c: -c[1])[:3] if k < CALLERS_OF else [])
            for k, f in enumerate(stats[:top])]))
    return sorted(threads, key=lambda t: -t["total_s"])


def serve(a, pipe) -> None:
    """The draft's process: the worker behind the product's server and step channel."""
    from specextend.rpc import DraftServerThread

    cfg = config_of(a)
    worker, model = load_worker(cfg)
    server = DraftServerThread(worker, host="127.0.0.1", port=0, model=model.name, token=a.token, step_channel="ipc")
    pipe.send((server.address, model.args.vocab_size))
    while (msg := pipe.recv()) is not None:
        pipe.send(profile_control(msg))
    server.stop()


def run_zmq(a, counts: list[int]) -> dict:
    from specextend.rpc import GrpcDraftBackend

    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=serve, args=(a, there), daemon=True)
    proc.start()
    try:
        address, vocab = here.recv()
        client = GrpcDraftBackend(address, timeout_s=30.0, token=a.token, transport="zmq")

        def control(msg):
            here.send(msg)
            return here.recv()
        got = measure(client, vocab, counts, a, config_of(a), control)
        assert client.step_endpoint  # the ZeroMQ channel, not gRPC's fallback
        client.shutdown()
        return got
    finally:
        here.send(None)
        proc.join(30)


def print_profiles(path: str, profiles: dict) -> None:
    for n, threads in profiles.items():
        print(f"\n{path}, {n} sessions, yappi: each thread's total and busiest functions (own s)")
        for t in threads:
            print(f"  thread {t['name']} ({t['id']}): {t['total_s']:.3f} s")
            for f in t["top"]:
                print(f"    {f['own_s']:8.4f} {f['total_s']:8.4f} {f['calls']:7d}  {f['fn']}")
                for who, secs, calls in f.get("callers", []):
                    print(f"{'':38}<- {secs:8.4f} s {calls:6d} x {who}")


def main(argv: Optional[Sequence[str]] = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", default="random:llama-tiny-draft")
    ap.add_argument("--target", default="random:llama-tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--sessions", default="1,2,4,8", help="comma-separated numbers of sessions stepping at once")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--replay", type=int, default=3, help="accepted draft tokens a step (its last tree's first branch)")
    ap.add_argument("--rounds", type=int, default=40, help="timed rounds per count")
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--paths", default="direct,zmq")
    ap.add_argument("--profile", choices=["cpu", "wall"], default=None, help="a yappi pass after the timed rounds")
    ap.add_argument("--profile-sessions", default="", help="the counts profiled (default: the largest)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    counts = sorted({int(x) for x in a.sessions.split(",")})
    a.profile_counts = {int(x) for x in a.profile_sessions.split(",") if x} or {counts[-1]}
    from specextend.rpc.auth import new_token
    a.token = new_token()
    results = {}
    for path in a.paths.split(","):
        if path == "direct":
            cfg = config_of(a)
            worker, model = load_worker(cfg)
            got = measure(worker, model.args.vocab_size, counts, a, cfg, profile_control)
            worker.shutdown()
        elif path == "zmq":
            got = run_zmq(a, counts)
        else:
            raise SystemExit(f"unknown path {path!r} (direct, zmq)")
        results[path] = got
        print(f"\n{path}: {'sessions':>8} {'median ms':>10} {'p90 ms':>8} {'ms a step':>10}")
        for n, xs in got["rounds"].items():
            med = statistics.median(xs)
            print(f"{path}: {n:>8} {med:>10.2f} {percentile(xs, 0.9):>8.2f} {med / n:>10.2f}")
        print_profiles(path, got["profiles"])
    table = {p: {n: dict(median_ms=statistics.median(xs), p90_ms=percentile(xs, 0.9), rounds=xs)
                 for n, xs in r["rounds"].items()} for p, r in results.items()}
    device = a.device
    if device != "cpu":
        import torch
        device = torch.cuda.get_device_name()
    out = a.out or OUT / f"draft_rounds-{'cpu' if a.device == 'cpu' else 'gpu'}.json"
    return write_record(out, dict(suite="draft_rounds", device=device, draft=a.draft, prompt_len=a.prompt_len,
                                  replay=a.replay, table=table,
                                  profiles={p: r["profiles"] for p, r in results.items()}))


if __name__ == "__main__":
    main()
