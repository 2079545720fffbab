"""The per-step path under concurrent sessions (docs/architecture.md, "Wire protocol"): N sessions'
draft steps issued at once from a pool of 8 threads, as `scheduler.Batcher` issues a round's draft
steps, through the product's client and the ZeroMQ step channel to a draft that does no work (the
null draft of rpc_roundtrip.py, served in a process of its own); timed from the round's start until
its last answer. What a round of N steps costs beyond one step is what the path itself adds under
load, before any draft compute.

  python benchmarks/rpc_concurrent.py --sessions 1,2,4,8 --rounds 400

Prints a table (median and p90 of a round in us, and the median's increment per step beyond the
first) and writes JSON under results/rpc/.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Optional, Sequence

sys.path.insert(0, str(Path(__file__).parent))
from rpc_roundtrip import (ACCEPTED, BOUND, CHUNK_IDS, OUT, PARAMS, TREE_TOKENS, draft_server,  # noqa: E402
                           percentile, write_record)

from specextend.draft.base import Retrieval  # noqa: E402
from specextend.rpc import GrpcDraftBackend  # noqa: E402
from specextend.rpc.auth import new_token  # noqa: E402

THREADS = 8  # the Batcher's draft-call pool (scheduler.Batcher, draft_threads)


def rounds_of(client: GrpcDraftBackend, sids: list[str], pool: ThreadPoolExecutor, rounds: int,
              first: int) -> list[float]:
    """Each round's wall time in us: every session of `sids` steps at once (step numbers from `first`)."""
    retrieval = Retrieval(CHUNK_IDS, PARAMS.retrieval.chunk_size)
    out = []
    for k in range(first, first + rounds):
        t = time.perf_counter_ns()
        futures = [pool.submit(client.step, sid, k, ACCEPTED, retrieval, BOUND) for sid in sids]
        wait(futures)
        out.append((time.perf_counter_ns() - t) / 1e3)
        for f in futures:
            assert f.result().step == k and f.result().tokens == TREE_TOKENS
    return out


def measure(counts: list[int], rounds: int, warmup: int, switch_interval: Optional[float]) -> dict[int, list[float]]:
    token = new_token()
    samples: dict[int, list[float]] = {n: [] for n in counts}
    with draft_server(token, False, switch_interval) as (address, *_), ThreadPoolExecutor(THREADS) as pool:
        client = GrpcDraftBackend(address, timeout_s=5.0, token=token, transport="zmq")
        sids = [f"s{i}" for i in range(max(counts))]
        for sid in sids:
            client.open(sid, list(range(1024)), PARAMS)
        step = 0
        rounds_of(client, sids, pool, warmup, step)
        step += warmup
        for _ in range(5):  # interleaved: a loaded host slows every count alike
            for n in counts:
                samples[n] += rounds_of(client, sids[:n], pool, rounds // 5, step)  # (the null draft takes
                step += rounds // 5  # step numbers as they come: the others need not catch up)
        assert client.step_endpoint  # the ZeroMQ channel, not gRPC's fallback
        for sid in sids:
            client.close(sid)
        client.shutdown()
    return samples


def main(argv: Optional[Sequence[str]] = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", default="1,2,4,8", help="comma-separated numbers of sessions stepping at once")
    ap.add_argument("--rounds", type=int, default=400, help="timed rounds per count")
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--switch-interval", type=float, default=None, help="sys.setswitchinterval in both processes")
    ap.add_argument("--out", type=Path, default=OUT / "rpc_concurrent-cpu.json")
    args = ap.parse_args(argv)
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    counts = sorted({int(x) for x in args.sessions.split(",")})
    samples = measure(counts, args.rounds, args.warmup, args.switch_interval)
    one = statistics.median(samples[counts[0]])
    print(f"{'sessions':>8} {'rounds':>7} {'median us':>10} {'p90 us':>8} {'us a step beyond the first':>27}")
    results = {}
    for n in counts:
        xs = samples[n]
        med = statistics.median(xs)
        extra = (med - one) / (n - counts[0]) if n > counts[0] else 0.0
        results[n] = dict(n=len(xs), median_us=med, p90_us=percentile(xs, 0.9), per_extra_step_us=extra)
        print(f"{n:>8} {len(xs):>7} {med:>10.0f} {results[n]['p90_us']:>8.0f} {extra:>27.0f}")
    return write_record(args.out, dict(suite="rpc_concurrent", threads=THREADS, rounds=results))


if __name__ == "__main__":
    main()
