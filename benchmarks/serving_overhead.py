"""What the serving path costs per token (docs/architecture.md, "Serving surface"): plain decoding
(`ar`) of one prompt with a fast model, in process and through each layer of the served path:

  engine    Engine.stream in this process: the floor
  replica   SpecExtendReplica.generate in this process, no Ray: the engine thread (Batcher) ->
            SessionPump -> asyncio -> TextStream, one item per batch of ready steps
  handle    the real Serve app, called through a streaming DeploymentHandle from this driver: adds
            Ray's streaming generator (every yielded item is one object reported to the caller)
  http      the real Serve app over HTTP (proxy -> ingress -> handle -> replica), SSE read by httpx

  python benchmarks/serving_overhead.py --model random:llama-tiny --new-tokens 512

Decode tokens/s is taken from the client's clock between the first and the last token's arrival;
"x engine" is the median over runs of a layer's rate over an in-process run made just before it;
items/token is how many replica items (handle) or SSE chunks (http) carried them. The step of a
fast model (random:llama-tiny: ~1.4 ms on a 2-core CPU) makes per-token costs visible. Every layer
must return the engine's tokens (checked). Prints a table and writes JSON under results/serve/.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

from specextend.bench import record

OUT = Path(__file__).parent / "results" / "serve"
LAYERS = ("engine", "replica", "handle", "http")


def _row(layer: str, arrivals: list[tuple[float, int]], ids: list[int], t0: float) -> dict:
    """arrivals: (time, tokens) of each item that carried tokens."""
    (t_first, n_first), t_last = arrivals[0], arrivals[-1][0]
    n = sum(k for _, k in arrivals)
    rate = (n - n_first) / max(t_last - t_first, 1e-9)
    gaps = [b[0] - a[0] for a, b in zip(arrivals, arrivals[1:])]
    return dict(layer=layer, tokens=n, items=len(arrivals), items_per_token=len(arrivals) / n,
                decode_tokens_per_s=rate, ms_per_token=1e3 / rate, ttft_s=t_first - t0,
                median_item_gap_ms=1e3 * statistics.median(gaps) if gaps else 0.0, token_ids=ids)


def run_engine(engine, prompt: list[int], params) -> dict:
    t0 = time.perf_counter()
    arrivals, ids = [], []
    for ev in engine.stream(prompt, params):
        if ev.token_ids:
            arrivals.append((time.perf_counter(), len(ev.token_ids)))
            ids += ev.token_ids
    return _row("engine", arrivals, ids, t0)


def run_replica(replica, req: dict) -> dict:
    async def go():
        t0 = time.perf_counter()
        arrivals, ids = [], []
        async for item in replica.generate(dict(req)):
            if item.get("token_ids"):
                arrivals.append((time.perf_counter(), len(item["token_ids"])))
                ids += item["token_ids"]
        return _row("replica", arrivals, ids, t0)

    return asyncio.run(go())


def run_handle(handle, req: dict) -> dict:
    t0 = time.perf_counter()
    arrivals, ids = [], []
    for item in handle.options(stream=True).generate.remote(dict(req)):
        if item.get("token_ids"):
            arrivals.append((time.perf_counter(), len(item["token_ids"])))
            ids += item["token_ids"]
    return _row("handle", arrivals, ids, t0)


def run_http(client, url: str, prompt: list[int], new_tokens: int) -> dict:
    body = dict(prompt=prompt, max_tokens=new_tokens, temperature=0, ignore_eos=True, stream=True,
                return_token_ids=True, stream_options={"include_usage": True})
    t0 = time.perf_counter()
    arrivals, ids = [], []
    with client.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                if choice.get("token_ids"):
                    arrivals.append((time.perf_counter(), len(choice["token_ids"])))
                    ids += choice["token_ids"]
    return _row("http", arrivals, ids, t0)


def best(rows: list[dict]) -> dict:
    """The run with the median decode rate (runs on a shared 2-core machine are noisy)."""
    return sorted(rows, key=lambda r: r["decode_tokens_per_s"])[len(rows) // 2]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="random:llama-tiny")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--layers", default=",".join(LAYERS))
    p.add_argument("--port", type=int, default=0, help="0: a free port")
    p.add_argument("--stream-interval-ms", type=float, default=None, help="the app's (default: its default)")
    p.add_argument("--label", default="", help="a suffix for the JSON's name (e.g. before, after)")
    p.add_argument("--switch-interval", type=float, default=None,
                   help="this process's GIL switch interval in seconds (the replica layer's; default Python's)")
    a = p.parse_args(argv)
    if a.switch_interval is not None:
        sys.setswitchinterval(a.switch_interval)
    layers = a.layers.split(",")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import torch

    torch.set_num_threads(1)  # as the replica (Ray gives a 0.5-CPU actor one thread)
    from specextend.config import EngineConfig, SamplingParams
    from specextend.engine import Engine
    from specextend.models.loader import load_model

    target = load_model(a.model, dtype="float32", attention_backend="auto")
    vocab = target.args.vocab_size
    prompt = [(7 * i + 3) % vocab for i in range(a.prompt_tokens)]
    settings = dict(target=a.model, mode="ar", num_gpus=0, dtype="float32", max_new_tokens=max(a.new_tokens, 256),
                    max_prompt_tokens=max(a.prompt_tokens, 256), kv_cache_memory_gb=1)
    if a.stream_interval_ms is not None:
        settings["stream_interval_ms"] = a.stream_interval_ms
    req = dict(prompt_ids=prompt, max_tokens=a.new_tokens, temperature=0.0, top_p=1.0, top_k=None, seed=None,
               stop=[], ignore_eos=True, speculative_decoding={"enabled": True, "max_tree_nodes": None},
               request_id="bench", return_prompt_ids=False)
    params = SamplingParams(max_new_tokens=a.new_tokens, temperature=0.0, ignore_eos=True)
    engine = Engine(EngineConfig(mode="ar", dtype="float32"), target)
    runs: dict[str, list[dict]] = {}

    def measure(layer: str, fn) -> None:
        """Each run of a layer right after one in-process run: on a shared machine the load
        drifts, so the ratio of the pair is steadier than either rate."""
        fn()  # warm-up
        runs[layer] = []
        for _ in range(a.repeats):
            floor = run_engine(engine, prompt, params) if layer != "engine" else None
            r = fn()
            r["x_engine"] = r["decode_tokens_per_s"] / floor["decode_tokens_per_s"] if floor else 1.0
            runs[layer].append(r)
        r = best(runs[layer])
        print(f"{layer:8s} {r['decode_tokens_per_s']:8.1f} tok/s  {r['ms_per_token']:6.3f} ms/token  "
              f"{r['items_per_token']:.2f} items/token  x{statistics.median(x['x_engine'] for x in runs[layer]):.3f} "
              "in-process", flush=True)

    if "engine" in layers:
        measure("engine", lambda: run_engine(engine, prompt, params))
    if "replica" in layers:
        from specextend.serving.replica import SpecExtendReplica

        replica = SpecExtendReplica(settings)
        measure("replica", lambda: run_replica(replica, req))
        replica.engine_thread.shutdown()
    if "handle" in layers or "http" in layers:
        import httpx
        import ray
        from ray import serve

        from deploy.app import specextend

        port = a.port or _free_port()
        ray.init(address="local", include_dashboard=False, log_to_driver=False, num_cpus=2)
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            serve.run(specextend(dict(settings)), name="bench", route_prefix="/")
            if "handle" in layers:
                handle = serve.get_deployment_handle("SpecExtend", app_name="bench")
                measure("handle", lambda: run_handle(handle, req))
            if "http" in layers:
                with httpx.Client() as client:
                    url = f"http://127.0.0.1:{port}"
                    measure("http", lambda: run_http(client, url, prompt, a.new_tokens))
        finally:
            serve.shutdown()
            ray.shutdown()
    return report(a, argv, runs)


def report(a, argv, runs: dict[str, list[dict]]) -> int:
    rows = {layer: best(rs) for layer, rs in runs.items()}
    ref = next(iter(rows.values()))["token_ids"]
    same = {layer: r["token_ids"] == ref for layer, r in rows.items()}
    print(f"\n{'layer':8s} | {'decode tok/s':>12s} | {'ms/token':>8s} | {'+ms/token':>9s} | {'x engine':>8s} | "
          f"{'items/token':>11s} | {'TTFT ms':>7s} | same tokens")
    prev = None
    for layer, r in rows.items():
        extra = r["ms_per_token"] - prev["ms_per_token"] if prev else 0.0
        ratio = statistics.median(x["x_engine"] for x in runs[layer])
        print(f"{layer:8s} | {r['decode_tokens_per_s']:12.1f} | {r['ms_per_token']:8.3f} | {extra:+9.3f} | "
              f"{ratio:8.3f} | {r['items_per_token']:11.2f} | {1e3 * r['ttft_s']:7.1f} | {same[layer]}")
        prev = r
    commit = record.commit()
    meta = dict(commit=commit, device="cpu", cpus=os.cpu_count(), date=datetime.date.today().isoformat(),
                model=a.model, stream_interval_ms=a.stream_interval_ms, prompt_tokens=a.prompt_tokens, new_tokens=a.new_tokens, repeats=a.repeats,
                command="python benchmarks/serving_overhead.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    out = [{k: v for k, v in r.items() if k != "token_ids"} for rs in runs.values() for r in rs]
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"overhead-cpu{'-' + a.label if a.label else ''}.json"
    summary = {layer: {k: v for k, v in r.items() if k != "token_ids"} | {
        "same_tokens": same[layer], "x_engine_median": statistics.median(x["x_engine"] for x in runs[layer])}
        for layer, r in rows.items()}
    path.write_text(json.dumps(dict(meta=meta, summary=summary, runs=out), indent=1) + "\n")
    print(f"wrote {path}")
    return 0 if all(same.values()) else 1


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


if __name__ == "__main__":
    raise SystemExit(main())
