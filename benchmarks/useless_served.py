"""A draft that cannot pay, served (docs/architecture.md, "Adaptive speculation"): the tiny target
with a random 68M draft (one draft forward costs far more than a target step), `mode=specextend`
against `mode=ar`, both as real Serve apps over HTTP, requests interleaved between the two apps.

  python benchmarks/useless_served.py --reps 5 --new-tokens 128

Decode tokens/s of each request from the client's clock, after its first `--skip` tokens (the
first few steps), over the streamed chunks' arrivals; the median over requests, and its ratio.
The goal (issue 14): `specextend` within 5% of `ar`. Each request's prompt is new random tokens;
every `specextend` output must equal `ar`'s for the same prompt (checked: float32, a tie would
show). Writes JSON under results/regimes/.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

from specextend.bench import record

OUT = Path(__file__).parent / "results" / "regimes"


def stream(client, model: str, prompt: list[int], n: int) -> tuple[list[int], list[tuple[float, int]]]:
    """The request's token ids and each chunk's (arrival, tokens so far)."""
    ids, arrivals = [], []
    for ch in client.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0, stream=True,
                                        extra_body=dict(ignore_eos=True, return_token_ids=True)):
        got = (ch.choices[0].model_extra.get("token_ids") or []) if ch.choices else []
        if got:
            ids += list(got)
            arrivals.append((time.perf_counter(), len(ids)))
    return ids, arrivals


def rate_after(arrivals: list[tuple[float, int]], skip: int) -> float:
    """Tokens per second from the chunk that completed the first `skip` tokens to the last chunk."""
    t0, n0 = next((t, n) for t, n in arrivals if n >= skip)
    t1, n1 = arrivals[-1]
    return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="random:llama-tiny")
    p.add_argument("--draft", default="random:llama-68m")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--skip", type=int, default=8, help="tokens before the rate is taken")
    a = p.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from openai import OpenAI
    from ray import serve

    from deploy.app import specextend
    from specextend.bench.app_wait import wait_ready

    sys.path.insert(0, str(Path(__file__).parent))
    from concurrency import free_port

    modes = ("ar", "specextend")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    rng = random.Random(0)
    rates: dict[str, list[float]] = {m: [] for m in modes}
    equal = 0
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        clients = {}
        for mode in modes:
            settings = dict(target=a.target, draft=a.draft, mode=mode, num_gpus=0, dtype="float32",
                            max_new_tokens=a.new_tokens)
            serve.run(specextend(settings), name=mode, route_prefix=f"/{mode}")
            wait_ready(f"{url}/{mode}", 600, app=mode)
            client = OpenAI(base_url=f"{url}/{mode}/v1", api_key="unused", max_retries=0, timeout=600)
            clients[mode] = (client, client.models.list().data[0].id)
        for rep in range(a.reps):
            prompt = [rng.randrange(256) for _ in range(a.prompt_len)]
            outs = {}
            for mode in modes:
                ids, arrivals = stream(*clients[mode], prompt, a.new_tokens)
                outs[mode] = ids
                rates[mode].append(rate_after(arrivals, a.skip))
                print(f"{mode:10s} request {rep}: {len(ids)} tokens, {rates[mode][-1]:7.1f} tok/s after {a.skip}",
                      flush=True)
            equal += outs["ar"] == outs["specextend"]
    finally:
        serve.shutdown()
        ray.shutdown()
    med = {m: statistics.median(v) for m, v in rates.items()}
    ratio = med["specextend"] / med["ar"]
    print(f"medians: ar {med['ar']:.1f}, specextend {med['specextend']:.1f} tok/s -> {ratio:.3f}x; "
          f"{equal}/{a.reps} outputs equal")
    meta = dict(commit=record.commit(), device="cpu", date=datetime.date.today().isoformat(), cores=os.cpu_count(),
                command="python benchmarks/useless_served.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / "useless-served-cpu.json"
    path.write_text(json.dumps(dict(meta=meta, rates=rates, medians=med, ratio=ratio, equal=equal, reps=a.reps),
                               indent=1) + "\n")
    print(f"wrote {path}")
    return 0 if equal == a.reps else 1


if __name__ == "__main__":
    raise SystemExit(main())
