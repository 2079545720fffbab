"""Context lookup offline: how many target steps a request's greedy answer takes when every step
verifies only what lookup proposes (no draft), for several lookup policies, on the target's own
greedy outputs (docs/architecture.md, "Context lookup").

The outputs come from plain decoding of the benchmark prompts (`--outputs FILE` caches them: the
real 1.5B target on two CPU cores takes minutes a prompt). A step proposes chains from the context
(prompt + tokens so far), joined into one tree (lookup.graft); the target would accept the longest
path that matches its own next tokens and add one token of its own, so a step emits the accepted
length + 1 tokens. Lossless by construction (the target verifies whatever is proposed): only the
step count and the nodes verified a step differ between policies.

    python benchmarks/lookup_offline.py --length 4096 --docs nodejs,shakespeare,python --outputs /tmp/greedy.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable, Sequence

from specextend.lookup import NGRAMS, ContextIndex, RequestLookup, graft

Policy = Callable[[Sequence[int]], list[list[int]]]  # context -> chains


def _occurrences(ids: Sequence[int], n: int, limit: int) -> list[int]:
    """Positions just after the latest `limit` earlier occurrences of the last n tokens, latest first."""
    L = len(ids)
    if L <= n:
        return []
    suffix, out = list(ids[L - n:]), []
    for i in range(L - n - 1, -1, -1):
        if list(ids[i:i + n]) == suffix:
            out.append(i + n)
            if len(out) == limit:
                break
    return out


def scan_policy(ns: Sequence[int], k: int, chains: int = 1) -> Policy:
    """The continuations after the latest `chains` occurrences of the last n tokens, for the
    longest n that occurred, each up to k tokens (distinct chains only)."""
    def propose(ids: Sequence[int]) -> list[list[int]]:
        for n in sorted(ns, reverse=True):
            found, out = _occurrences(ids, n, 8 * chains), []
            for i in found:
                c = list(ids[i:min(i + k, len(ids))])
                if c and c not in out:
                    out.append(c)
                if len(out) == chains:
                    break
            if out:
                return out
        return []
    return propose


def index_policy(k: int, ns: Sequence[int] = (3, 2)) -> Policy:
    """Production's index (lookup.ContextIndex), rebuilt per context: its continuation."""
    def propose(ids: Sequence[int]) -> list[list[int]]:
        c = ContextIndex(list(ids), max(ids) + 1, ns).continuation(k)
        return [c] if c else []
    return propose


def simulate_gated(prompt: Sequence[int], out: Sequence[int], k: int, cost, ns: Sequence[int] = NGRAMS) -> dict:
    """Production's plain steps (lookup.RequestLookup): the index's chain, verified only where its
    gate says it pays at `cost` (seconds of a forward of so many rows), else one plain token."""
    lookup = RequestLookup(ContextIndex(list(prompt), max(list(prompt) + list(out)) + 1, ns), k, cost)
    i = steps = lookup_steps = nodes = from_chains = 0
    seconds = 0.0
    while i < len(out):
        chain = lookup.chain()
        accepted = 0
        while accepted < len(chain) and i + accepted < len(out) and chain[accepted] == out[i + accepted]:
            accepted += 1
        lookup.commit(out[i:i + accepted + 1], accepted)
        steps += 1
        lookup_steps += bool(chain)
        nodes += len(chain)
        from_chains += accepted
        seconds += cost(len(chain) + 1)
        i += accepted + 1
    return dict(steps=steps, lookup_steps=lookup_steps, nodes=nodes, from_chains=from_chains,
                tokens_per_step=len(out) / steps, modeled_speedup=len(out) * cost(1) / seconds)


def simulate(prompt: Sequence[int], out: Sequence[int], propose: Policy, cost=None) -> dict:
    """Steps to emit `out` when each step verifies propose(context)'s tree (and, with `cost`, the
    modeled speed over plain decoding: a step costs cost(its rows))."""
    i = steps = lookup_steps = nodes = from_chains = 0
    seconds = 0.0
    while i < len(out):
        ctx = list(prompt) + list(out[:i])
        tokens, parents = [], []
        for c in propose(ctx):
            tokens, parents, _ = graft(tokens, parents, c)
        node, accepted = -1, 0
        children = {}
        for j, (t, p) in enumerate(zip(tokens, parents)):
            children.setdefault((p, t), j)
        while i + accepted < len(out) and (node, out[i + accepted]) in children:
            node = children[(node, out[i + accepted])]
            accepted += 1
        steps += 1
        lookup_steps += bool(tokens)
        nodes += len(tokens)
        from_chains += accepted
        seconds += cost(len(tokens) + 1) if cost is not None else 0.0
        i += accepted + 1
    return dict(steps=steps, lookup_steps=lookup_steps, nodes=nodes, from_chains=from_chains,
                tokens_per_step=len(out) / steps, modeled_speedup=len(out) * cost(1) / seconds if cost else None)


POLICIES: dict[str, Policy] = {
    "index n3,2 k8 (until 2026-11-27)": index_policy(8),
    "index n3,2,1 k8": index_policy(8, (3, 2, 1)),
    "n3,2 k8": scan_policy((3, 2), 8),
    "n3,2 k16": scan_policy((3, 2), 16),
    "n3,2 k32": scan_policy((3, 2), 32),
    "n4,3,2 k8": scan_policy((4, 3, 2), 8),
    "n3,2,1 k8": scan_policy((3, 2, 1), 8),
    "n3 k8": scan_policy((3,), 8),
    "n3,2 k8 x2 chains": scan_policy((3, 2), 8, 2),
    "n3,2 k8 x3 chains": scan_policy((3, 2), 8, 3),
    "n4,3,2 k16 x2 chains": scan_policy((4, 3, 2), 16, 2),
}


def greedy_outputs(target: str, docs: list[str], length: int, new_tokens: int) -> dict:
    """{doc: {"prompt": ids, "out": ids}} from plain decoding on the CPU."""
    from specextend.bench.texts import documents, prompt_ids
    from specextend.builder import build_engine
    from specextend.config import EngineConfig, SamplingParams
    from specextend.models.loader import read_meta

    engine = build_engine(EngineConfig(target=target, mode="ar", device="cpu"))
    tokenizer = read_meta(target, "target").tokenizer
    result = {}
    for doc in documents(docs):
        prompt = prompt_ids(tokenizer, doc, length)
        out, _, _ = engine.generate(prompt, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
        result[doc.name] = dict(prompt=prompt, out=out)
        print(f"{doc.name}: {len(prompt)} prompt tokens, {len(out)} generated", flush=True)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="default")
    p.add_argument("--docs", default="nodejs,shakespeare,python")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--outputs", type=Path, help="greedy outputs: read if it exists, else written")
    p.add_argument("--out", type=Path, help="results JSON")
    p.add_argument("--cost-ms", default="2.34,0.036", help="a,b: a target forward of r rows costs a + b r ms (the "
                   "1.5B at 16K on an H200: 2.38 ms for one row, ~3.1 for 21)")
    a = p.parse_args(argv)
    if a.outputs is not None and a.outputs.exists():
        data = json.loads(a.outputs.read_text())
    else:
        data = greedy_outputs(a.target, a.docs.split(","), a.length, a.new_tokens)
        if a.outputs is not None:
            a.outputs.write_text(json.dumps(data))
    ca, cb = (float(x) for x in a.cost_ms.split(","))

    def cost(rows: int) -> float:
        return 1e-3 * (ca + cb * rows)

    rows = []
    for name, propose in POLICIES.items():
        for doc, d in data.items():
            rows.append(dict(policy=name, doc=doc, **simulate(d["prompt"], d["out"], propose, cost)))
    gated = "index n3,2,1 k8 gated (default)"
    for doc, d in data.items():
        rows.append(dict(policy=gated, doc=doc, **simulate_gated(d["prompt"], d["out"], 8, cost)))
    print(f"cost of a forward of r rows: {ca} + {cb} r ms; cells: steps (lookup steps, nodes a lookup step), "
          "tokens a step, modeled speed over plain decoding")
    print("| policy | " + " | ".join(data) + " |")
    print("|---|" + "---|" * len(data))
    for name in list(POLICIES) + [gated]:
        cells = []
        for r in (r for r in rows if r["policy"] == name):
            per = r["nodes"] / max(r["lookup_steps"], 1)
            cells.append(f"{r['steps']} ({r['lookup_steps']}, {per:.1f}): {r['tokens_per_step']:.2f}, "
                         f"{r['modeled_speedup']:.2f}x")
        print(f"| {name} | " + " | ".join(cells) + " |")
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(dict(rows=rows, meta=dict(command="python benchmarks/lookup_offline.py "
                                                              + " ".join(sys.argv[1:]), length=a.length,
                                                              new_tokens=a.new_tokens, target=a.target,
                                                              cost_ms=[ca, cb])), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
