"""Prefill with the FlashAttention project's kernels (attention_backend=flash: flash-attn-4 on Hopper)
against PyTorch's SDPA (attention_backend=torch), on one GPU, one run.

Two tables: (1) one layer's causal attention over the whole prompt, SDPA's flash kernel
(`F.scaled_dot_product_attention`, is_causal, K/V repeated to the query heads) against the flash backend's one call; (2) the
model's whole chunked prefill (time to first token without the server), the same weights with
either backend, the last position's logits compared. The first flash call's compile time is
reported apart (the CuTe-DSL kernels compile at first use; the served app's warm-up pays it).

  python benchmarks/prefill_flash.py --preset llama-3.1-8b --lengths 16384,32768,65536,130000 \
      --out benchmarks/results/kernels/prefill-1x-nvidia-h100.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from specextend.attention.backends import get_backend
from specextend.bench.kernels import timed  # median wall time, the device synchronized around each call
from specextend.bench.record import meta
from specextend.models.loader import load_model
from specextend.target import TargetSession

CUDA = torch.device("cuda")


def attention_rows(h: int, g: int, d: int, lengths: list[int], reps: int) -> list[dict]:
    flash = get_backend("flash", "cuda")
    rows = []
    for n in lengths:
        q = torch.randn(h, n, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(g, n, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(g, n, d, device="cuda", dtype=torch.bfloat16)
        kr, vr = k.repeat_interleave(h // g, 0)[None], v.repeat_interleave(h // g, 0)[None]  # [1, H, N, D]
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            sdpa = timed(lambda: F.scaled_dot_product_attention(q[None], kr, vr, is_causal=True), CUDA, reps, 1)
        fa = timed(lambda: flash.attend_end_causal(q, k, v, d ** -0.5, False), CUDA, reps, 1)
        flops = 4 * h * d * n * n / 2  # causal: half the score matrix, QK^T and PV
        rows.append(dict(tokens=n, sdpa_ms=1e3 * sdpa, flash_ms=1e3 * fa, speedup=sdpa / fa,
                         flash_tflops=flops / fa / 1e12))
        print(f"attention {n:7d} tokens: SDPA {1e3 * sdpa:8.2f} ms, {flash.kernel.name} {1e3 * fa:8.2f} ms "
              f"({sdpa / fa:.2f}x, {flops / fa / 1e12:.0f} TFLOP/s)", flush=True)
    return rows


@torch.inference_mode()
def prefill_rows(preset: str, lengths: list[int], chunk: int) -> tuple[list[dict], float]:
    model = load_model(f"random:{preset}", "target", "bfloat16", "cuda", attention_backend="torch",
                       execution="eager")
    dec = model.decoder
    backends = {"torch": dec.backend, "flash": get_backend("flash", "cuda")}
    prompt = torch.randint(0, 1000, (max(lengths),), generator=torch.Generator().manual_seed(0)).tolist()
    sess = TargetSession(dec, max(lengths) + 8, hybrid=True)

    def prefill(n: int, name: str):
        dec.backend = backends[name]
        sess.cache.truncate(0)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        logits = sess.prefill(prompt[:n], chunk, capture=True)
        torch.cuda.synchronize()
        return time.perf_counter() - t0, logits.float()

    compile_s = prefill(chunk * 2, "flash")[0]  # first use: the flash variants compile here
    prefill(chunk * 2, "torch")
    rows = []
    for n in lengths:
        t_torch, l_torch = prefill(n, "torch")
        t_flash, l_flash = prefill(n, "flash")
        same = int(l_torch.argmax()) == int(l_flash.argmax())
        rows.append(dict(tokens=n, chunk=chunk, torch_s=t_torch, flash_s=t_flash, speedup=t_torch / t_flash,
                         same_argmax=same, max_logit_diff=float((l_torch - l_flash).abs().max())))
        print(f"prefill {n:7d} tokens (chunks of {chunk}): torch {t_torch:7.2f} s, flash {t_flash:7.2f} s "
              f"({t_torch / t_flash:.2f}x), same argmax {same}, max |dlogit| {rows[-1]['max_logit_diff']:.3f}",
              flush=True)
    return rows, compile_s


def plot(run: dict, path: str) -> None:
    """Attention ms and whole-prefill s against prompt tokens, both backends (log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, rows, keys, unit, title in (
            (axes[0], run["attention"], ("sdpa_ms", "flash_ms"), "ms", "one layer's causal attention"),
            (axes[1], run["prefill"], ("torch_s", "flash_s"), "s", "whole chunked prefill")):
        n = [r["tokens"] for r in rows]
        for key, label in zip(keys, ("PyTorch SDPA", run["meta"]["kernel"])):
            ax.plot(n, [r[key] for r in rows], marker="o", label=label)
        ax.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel=unit, title=title)
        ax.legend()
    g = run["meta"]["geometry"]
    fig.suptitle(f"{g['preset']} geometry, {run['meta']['device']}, {run['meta']['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama-3.1-8b")
    ap.add_argument("--lengths", default="16384,32768,65536,130000")
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out")
    ap.add_argument("--plot", help="redraw the plot of a recorded run (JSON) and exit")
    a = ap.parse_args()
    if a.plot:
        with open(a.plot) as f:
            return plot(json.load(f), a.plot.removesuffix(".json") + ".png")
    lengths = [int(x) for x in a.lengths.split(",")]
    from specextend.models.presets import hf_config

    cfg = hf_config(a.preset)
    h, g = cfg.num_attention_heads, cfg.num_key_value_heads
    d = cfg.hidden_size // h
    t0 = time.perf_counter()
    kernel = get_backend("flash", "cuda").kernel
    import_s = time.perf_counter() - t0
    attention = attention_rows(h, g, d, lengths, a.reps)
    torch.cuda.empty_cache()
    prefill, compile_s = prefill_rows(a.preset, lengths, a.chunk)
    print(f"{kernel.name}: import {import_s:.1f} s; first prefill with it (compiles) {compile_s:.1f} s")
    print("\n| tokens | SDPA attention ms | flash attention ms | x | prefill torch s | prefill flash s | x |")
    print("|---|---|---|---|---|---|---|")
    for r, p in zip(attention, prefill):
        print(f"| {r['tokens']} | {r['sdpa_ms']:.2f} | {r['flash_ms']:.2f} | {r['speedup']:.2f} | "
              f"{p['torch_s']:.2f} | {p['flash_s']:.2f} | {p['speedup']:.2f} |")
    run = dict(meta=meta("prefill_flash", "cuda", [], kernel=kernel.name,
                         geometry=dict(preset=a.preset, heads=h, kv_heads=g, head_dim=d), import_s=import_s,
                         first_prefill_s=compile_s), attention=attention, prefill=prefill)
    run["meta"]["command"] = " ".join(["python", *sys.argv])
    if a.out:
        with open(a.out, "w") as f:
            json.dump(run, f, indent=1)
        plot(run, a.out.removesuffix(".json") + ".png")


if __name__ == "__main__":
    main()
