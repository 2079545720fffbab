"""Concurrent requests through the served app (docs/architecture.md, "Batched steps"): the same N
requests sent one after another, then all at once, over HTTP with the official `openai` client
against the real Ray Serve app; prints the wall times and their ratio, checks each concurrent
output against its sequential one, writes JSON under results/concurrency/.

  python benchmarks/concurrency.py --modes ar,sd,specextend --requests 8 --new-tokens 64

Defaults: the tiny pair in float64 on the CPU (outputs must then be equal token for token). The
replica batches the sessions' target forwards (max_batch_sessions) and the draft worker their
draft steps; one at a time, each request pays a whole forward per step alone.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import socket
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

from specextend import round_log
from specextend.bench import record
from specextend.bench.app_wait import wait_ready

OUT = Path(__file__).parent / "results" / "concurrency"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def complete(client, model: str, prompt: list[int], max_tokens: int, specs: Optional[list] = None) -> list[int]:
    """The completion's token ids; its `speculative_decoding` object appended to `specs` (if given)."""
    r = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                  extra_body=dict(ignore_eos=True, return_token_ids=True))
    if specs is not None:
        specs.append((r.model_extra or {}).get("speculative_decoding") or {})
    return list(r.choices[0].model_extra["token_ids"])


SPEC_KEYS = ("num_steps", "plain_steps", "open_steps", "probe_steps", "unready_steps", "lookup_steps",
             "mean_tree_nodes", "mean_acceptance_length", "target_wait_ms_per_step", "draft_queue_ms_per_step",
             "transport_ms_per_step", "draft_ms_per_step", "verify_ms_per_step", "draft_open_ms",
             "target_prefill_ms", "max_step_ms")


def spec_summary(specs: list) -> dict:
    """Means over requests of what each response's `speculative_decoding` object says (SPEC_KEYS),
    and each kind of step's steps, tokens and ms summed over them."""
    specs = [s for s in specs if s]
    if not specs:
        return {}
    out = {k: statistics.mean(float(s.get(k) or 0.0) for s in specs) for k in SPEC_KEYS}
    kinds: dict = {}
    for s in specs:
        for kind, v in (s.get("step_kinds") or {}).items():
            acc = kinds.setdefault(kind, {"steps": 0, "tokens": 0, "ms": 0.0})
            for f in acc:
                acc[f] += v.get(f, 0)
    out["step_kinds"] = kinds
    return out


def measure(url: str, prompts: list[list[int]], new_tokens: int, rounds: int = 1) -> dict:
    """`rounds` times: the requests one after another, then all at once; the median of each, the
    ratio of the medians (and each round's), and whether every concurrent output equals its
    sequential one in every round."""
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    complete(client, model, prompts[0][:16], 4)  # warm-up
    seq_s, con_s, equal = [], [], len(prompts)
    for _ in range(rounds):
        seq_specs, con_specs = [], []  # (the last round's)
        t0, w0 = time.perf_counter(), time.time()
        sequential = [complete(client, model, p, new_tokens, seq_specs) for p in prompts]
        seq_s.append(time.perf_counter() - t0)
        t0, w1 = time.perf_counter(), time.time()
        with ThreadPoolExecutor(len(prompts)) as pool:
            concurrent = list(pool.map(lambda p: complete(client, model, p, new_tokens, con_specs), prompts))
        con_s.append(time.perf_counter() - t0)
        windows = dict(sequential=(w0, w1), concurrent=(w1, time.time()))  # (the last round's, wall clock)
        equal = min(equal, sum(a == b for a, b in zip(sequential, concurrent)))
    t_seq, t_con = statistics.median(seq_s), statistics.median(con_s)
    return dict(sequential_s=t_seq, concurrent_s=t_con, ratio=t_con / t_seq, tokens=sum(map(len, concurrent)),
                equal=equal, requests=len(prompts), rounds=rounds, round_ratios=[c / s for c, s in zip(con_s, seq_s)],
                sequential_spec=spec_summary(seq_specs), concurrent_spec=spec_summary(con_specs), windows=windows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="random:llama-tiny")
    p.add_argument("--draft", default="random:llama-tiny-draft")
    p.add_argument("--modes", default="ar,sd,specextend")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--dtype", default="float64")
    p.add_argument("--num-gpus", type=float, default=0.0)
    p.add_argument("--rounds", type=int, default=1, help="sequential-then-concurrent rounds per mode (medians)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="an app argument for every mode (repeatable), e.g. max_batch_tokens=1024")
    p.add_argument("--round-log-sync", action="store_true",
                   help="with --round-log: each round first waits for the device (sync_s), so advance_s is host work")
    p.add_argument("--tag", default="", help="the JSON file's suffix: concurrency-<device>[-TAG].json")
    p.add_argument("--round-log", action="store_true",
                   help="the replica logs its batcher's rounds (specextend/round_log.py); the last round's "
                        "sequential and concurrent windows are summed per mode")
    p.add_argument("--draft-in-replica", action="store_true",
                   help="the draft in the replica's process (app argument draft_in_replica; num_gpus below 1)")
    a = p.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray import serve

    from deploy.app import specextend

    log_dir = None
    if a.round_log:  # (before ray.init: the local cluster's workers, the replica's too, inherit it)
        log_dir = tempfile.mkdtemp(prefix="rounds-")
        os.environ[round_log.ENV] = log_dir
        if a.round_log_sync:
            os.environ[round_log.SYNC_ENV] = "1"
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(a.prompt_len)] for _ in range(a.requests)]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    rows = []
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for mode in a.modes.split(","):
            settings = dict(target=a.target, draft=a.draft, mode=mode, num_gpus=a.num_gpus, dtype=a.dtype,
                            max_new_tokens=max(a.new_tokens, 64), max_concurrent_sessions=max(16, a.requests),
                            retrieval_chunk_size=16, retrieval_top_k=4)
            if a.draft_in_replica and mode in ("sd", "specextend"):
                settings["draft_in_replica"] = True
            settings.update(kv.split("=", 1) for kv in a.set)  # (strings: the app's settings coerce them)
            serve.run(specextend(settings), name="concurrency", route_prefix="/")
            wait_ready(url, 600, app="concurrency")
            r = measure(url, prompts, a.new_tokens, a.rounds)
            serve.delete("concurrency")
            rows.append(r := dict(mode=mode, **r))  # (the round log's summaries below land in it too)
            print(f"{mode:10s} {a.requests} requests x {a.new_tokens} tokens: one after another {r['sequential_s']:6.2f} s, "
                  f"at once {r['concurrent_s']:6.2f} s -> {r['ratio']:.2f}x the time; "
                  f"{r['equal']}/{r['requests']} outputs equal"
                  + (f" (medians of {a.rounds} rounds; each round {', '.join(f'{x:.2f}x' for x in r['round_ratios'])})"
                     if a.rounds > 1 else ""), flush=True)
            for when in ("sequential", "concurrent"):
                if log_dir is not None:
                    logged = round_log.read(log_dir, *r["windows"][when])
                    r[f"{when}_rounds"] = rs = round_log.summary(logged)
                    if when == "concurrent":  # (each round of the burst, to take it apart offline)
                        r["concurrent_round_list"] = logged
                    print(f"  {when:10s} rounds: " + ", ".join(
                        f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in rs.items()), flush=True)
                sp = r[f"{when}_spec"]
                if sp and sp["num_steps"] + sp["plain_steps"]:
                    print(f"  {when:10s} per request: " + ", ".join(f"{k} {sp[k]:.1f}" for k in SPEC_KEYS)
                          + f"; steps by kind {sp['step_kinds']}", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    commit = record.commit()
    device = "cpu" if not a.num_gpus else "gpu"
    meta = dict(commit=commit, device=device, date=datetime.date.today().isoformat(), cores=os.cpu_count(),
                command="python benchmarks/concurrency.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"concurrency-{device}{'-' + a.tag if a.tag else ''}.json"
    path.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")
    print(f"wrote {path}")
    return 0 if all(r["equal"] == r["requests"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
