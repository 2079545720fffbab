"""Step times at scale (the `kernels` suite; docs/architecture.md, "Baselines"): an AR decode step,
a tree verify with HTA and with plain masked attention, and a draft step over the full cache and
over the retrieval working cache, at each committed length, each against its memory floor
(weights + KV cache read once at the measured copy bandwidth). Random weights at real geometries:
every kernel takes the time it would take with real weights. The models run with the execution plan
the engine uses (CUDA graphs on a GPU)."""

from __future__ import annotations

import statistics
import time

import torch

from specextend.config import RetrievalConfig, TreeConfig
from specextend.draft.base import DraftSessionParams
from specextend.draft.session import DraftSession
from specextend.models.graphed import replay_seconds
from specextend.models.loader import load_model
from specextend.target import TargetSession


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn, dev, reps: int, warmup: int = 2) -> float:
    """Median wall time (s) of fn(), the device synchronized around each call."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        _sync(dev)
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def graph_us(fn, reps: int = 10, per_graph: int = 1, warmup: int = 1) -> float:
    """Median device time (us) of one call of fn(): `per_graph` calls captured in a CUDA graph,
    replayed between CUDA events (no host launch cost inside the timed region, as in the step
    graphs). `warmup` calls on a side stream first (Triton compiles, cuBLAS handles)."""
    def calls(n):
        for _ in range(n):
            fn()
    return replay_seconds(lambda: calls(per_graph), lambda: calls(warmup), reps) * 1e6 / per_graph


def copy_bandwidth(dev: torch.device) -> float:
    """Bytes read + written per second by a large device copy."""
    n = (1 << 30) if dev.type == "cuda" else (1 << 26)
    a = torch.empty(n, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    return 2 * n / timed(lambda: b.copy_(a), dev, 10)


def dense_tree(nodes: int, topk: int) -> list[int]:
    """Parents of a dense tree: each level's first `topk` nodes get `topk` children, up to `nodes`."""
    parents, frontier = [], [-1]
    while len(parents) < nodes:
        nxt = []
        for p in frontier[:topk]:
            for _ in range(min(topk, nodes - len(parents))):
                parents.append(p)
                nxt.append(len(parents) - 1)
        frontier = nxt
    return parents


@torch.inference_mode()
def _length(target, draft, length: int, tree: TreeConfig, reps: int, bw: float, prefill_chunk: int) -> dict:
    dec = target.decoder
    dev = dec.device
    prompt = torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(length)).tolist()
    weight_bytes = dec.args.num_params() * dec.w.embed.element_size()
    kv_tok = dec.args.kv_bytes_per_token(dec.dtype)
    sess = TargetSession(dec, length + 4 * tree.nodes + 8, hybrid=True)
    row = dict(length=length, prefill_s=timed(lambda: (sess.cache.truncate(0), sess.prefill(prompt, prefill_chunk)),
                                               dev, 1, 0))

    def ar_step():
        sess.decode(7)
        sess.cache.truncate(length)

    row["ar_step_ms"] = 1e3 * timed(ar_step, dev, reps)
    parents = dense_tree(tree.nodes, tree.topk)
    tokens = [11] * len(parents)
    for hybrid in (True, False):
        sess.hybrid = hybrid
        key = "verify_hta_ms" if hybrid else "verify_masked_ms"
        row[key] = 1e3 * timed(lambda: sess.verify(5, tokens, parents, capture=False), dev, reps)
    row["floor_ms"] = 1e3 * (weight_bytes + (length + len(parents) + 1) * kv_tok) / bw
    row["verify_hta_over_floor"] = row["verify_hta_ms"] / row["floor_ms"]
    for name, retrieval in (("full", RetrievalConfig(enabled=False)),
                            ("cmr", RetrievalConfig(enabled=True))):
        ds = DraftSession(draft.decoder, prompt, DraftSessionParams(tree, retrieval, max_new_tokens=8 * reps + 64),
                          prefill_chunk=prefill_chunk)
        k = [0]

        def step():
            ds.step(k[0], [3], None)
            k[0] += 1

        row[f"draft_step_{name}_ms"] = 1e3 * timed(step, dev, reps, warmup=1)
        row[f"draft_cache_{name}"] = ds.cache_tokens
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return row


def run(target_spec: str, draft_spec: str, lengths: list[int], reps: int, dtype: str = "auto",
        device: str = "auto", tree: TreeConfig = TreeConfig(), prefill_chunk: int = 2048, progress=print) -> dict:
    target = load_model(target_spec, "target", dtype, device)
    draft = load_model(draft_spec, "draft", dtype, device, vocab_size=target.args.vocab_size,
                       target_weights=target.decoder.w)
    bw = copy_bandwidth(target.decoder.device)
    rows = []
    for length in lengths:
        rows.append(_length(target, draft, length, tree, reps, bw, prefill_chunk))
        r = rows[-1]
        progress(f"L={length}: AR {r['ar_step_ms']:.2f} ms, verify HTA {r['verify_hta_ms']:.2f} / masked "
                 f"{r['verify_masked_ms']:.2f} ms (floor {r['floor_ms']:.2f}), draft full "
                 f"{r['draft_step_full_ms']:.2f} / retrieval {r['draft_step_cmr_ms']:.2f} ms")
    return dict(rows=rows, copy_bandwidth_Bps=bw, dtype=str(target.decoder.dtype),
                tree=[tree.nodes, tree.depth, tree.topk])


def table(result: dict) -> str:
    lines = ["| L | AR step ms | verify HTA ms | verify masked ms | floor ms | HTA / floor | draft full ms | "
             "draft retrieval ms |", "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['length']} | {r['ar_step_ms']:.2f} | {r['verify_hta_ms']:.2f} | "
                     f"{r['verify_masked_ms']:.2f} | {r['floor_ms']:.2f} | {r['verify_hta_over_floor']:.2f} | "
                     f"{r['draft_step_full_ms']:.2f} | {r['draft_step_cmr_ms']:.2f} |")
    return "\n".join(lines)
