"""The disaggregated deployment under load: the real Serve app (target replica on one GPU, its draft
actor on another, gRPC between them), requests over HTTP at several input lengths.

  python benchmarks/serve_bench.py --lengths 8192,16384 target=random:llama-3.1-8b \
      draft=random:llama-68m num_gpus=1 replay_accept_length=3

Reports tokens/s, time to first token, mean acceptance length and the per-step split from each
response's `speculative_decoding` object, and where each model process runs (nvidia-smi).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time

import requests


def wait_ready(url: str, timeout_s: float) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        try:
            if requests.get(url + "/health", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(2)
    raise TimeoutError("the app did not become ready")


def one_request(url: str, model: str, prompt_ids: list[int], max_tokens: int, ignore_eos: bool = True) -> dict:
    body = dict(model=model, prompt=prompt_ids, max_tokens=max_tokens, temperature=0, ignore_eos=ignore_eos,
                stream=True, stream_options={"include_usage": True}, return_token_ids=True)
    t0 = time.perf_counter()
    ttft, spec, usage, ids = None, None, None, []
    with requests.post(url + "/v1/completions", json=body, stream=True, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                if ttft is None and (choice.get("text") or choice.get("token_ids")):
                    ttft = time.perf_counter() - t0
                ids += choice.get("token_ids") or []
            spec = chunk.get("speculative_decoding") or spec
            usage = chunk.get("usage") or usage
    wall = time.perf_counter() - t0
    n = len(ids)
    return dict(prompt_tokens=len(prompt_ids), tokens=n, token_ids=ids, wall_s=wall, ttft_s=ttft, tokens_per_s=n / wall,
                decode_tokens_per_s=(n - 1) / (wall - ttft) if ttft else None, speculative_decoding=spec)


def gpu_processes() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory,gpu_bus_id",
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return "nvidia-smi unavailable"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--lengths", default="8192,16384")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--text-file", default=None, help="real text (chat prompt of its first L tokens); else random ids")
    p.add_argument("--tokenizer", default=None, help=".gguf whose tokenizer builds the --text-file prompts")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false")
    p.add_argument("app_args", nargs="*", help="key=value app arguments (the configuration's flat names, specextend/config.py)")
    a = p.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray import serve

    from deploy.app import specextend

    args = dict(kv.split("=", 1) for kv in a.app_args)
    ray.init()
    serve.start(http_options={"host": "127.0.0.1", "port": a.port})
    t0 = time.perf_counter()
    serve.run(specextend(args), name="specextend", blocking=False)
    url = f"http://127.0.0.1:{a.port}"
    wait_ready(url, 900)
    startup = time.perf_counter() - t0
    model = requests.get(url + "/v1/models").json()["data"][0]["id"]
    placement = gpu_processes()
    rows = []
    for L in [int(x) for x in a.lengths.split(",")]:
        prompt = [(i * 7919 + L) % 250 for i in range(L)]
        if a.text_file:
            from prompts import chat_prompt, gguf_tokenizer

            prompt = chat_prompt(gguf_tokenizer(a.tokenizer), open(a.text_file, encoding="utf-8").read(), L)
        one_request(url, model, prompt[:256], 8, a.ignore_eos)  # warm-up
        r = one_request(url, model, prompt, a.max_tokens, a.ignore_eos)
        rows.append(dict(length=L, **r))
        print(f"L={L}: {r}", flush=True)
    print(f"\nstart-up {startup:.0f} s; GPU processes (pid, name, memory, bus):\n{placement}")
    print("| L | tok/s | decode tok/s | TTFT s | mean acc. len | steps | target wait ms/step (incl. gRPC) | "
          "verify ms/step | ready | ahead depth | draft cache |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        s = r["speculative_decoding"] or {}
        print(f"| {r['length']} | {r['tokens_per_s']:.1f} | {r['decode_tokens_per_s'] or 0:.1f} | {r['ttft_s'] or 0:.3f} | "
              f"{s.get('mean_acceptance_length', 0):.2f} | {s.get('num_steps')} | "
              f"{s.get('target_wait_ms_per_step', 0):.2f} | {s.get('verify_ms_per_step', 0):.2f} | "
              f"{s.get('tree_ready_fraction', 0):.2f} | {s.get('draft_ahead_depth', 0):.2f} | "
              f"{s.get('draft_cache_tokens')} |")
    print(json.dumps(dict(app_args=args, startup_s=startup, placement=placement, rows=rows,
                          date=time.strftime("%Y-%m-%d"))))
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
