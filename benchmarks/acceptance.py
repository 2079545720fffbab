"""Real-pair acceptance: mean accepted length with retrieval on and off, `sd` vs `specextend`.

Qwen2.5-Coder-1.5B-Instruct target + 0.5B draft (the default GGUF pair), float32, greedy, on long
technical text: Node.js API docs (/usr/share/doc/nodejs/api/*.md, MIT). Each document is cut to
exactly N tokens (target tokenizer) and wrapped in the chat template with a fixed question about
it. Every configuration uses the same draft tree; outputs of all configurations of one prompt must
be identical (the engine is lossless), which is checked and recorded instead of an extra AR run.

The target's prefill of a prompt is computed once and copied into later configurations of the
same prompt (it does not depend on the configuration); decode tok/s therefore excludes prefill.

Writes specextend/bench/traces/qwen2.5-coder-{config}-{len}.json (replayed by `specextend bench`;
the CLI's --record-trace format, all documents of that length concatenated, per-document detail
under "samples") and
benchmarks/results/acceptance-cpu.json; prints a table and the full JSON on the last line.

    python benchmarks/acceptance.py --lengths 1024,2048 --docs fs,stream
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

import specextend.engine as engine_mod
from specextend.bench.e2e import TRACES
from specextend.builder import load_pair
from specextend.config import EngineConfig, RetrievalConfig, SamplingParams, TreeConfig
from specextend.draft.worker import DraftWorker
from specextend.engine import Engine
from specextend.target import TargetSession

DOCS = Path("/usr/share/doc/nodejs/api")
HERE = Path(__file__).resolve().parent
QUESTION = ("\n\nSummarize the documentation above in a few sentences, then show a short code example "
            "that uses the API it describes.")
MARK = "\x00DOC\x00"


def configs(tree: TreeConfig) -> dict[str, EngineConfig]:
    """Same tree everywhere. sd+cmr: retrieval with the full draft prefill, plain verification;
    specextend: HTA + retrieval + 512-token sliding-window draft prefill (the mode's defaults)."""
    base = dict(dtype="float32", device="cpu", tree=tree)
    def r(k, window):
        return RetrievalConfig(enabled=True, top_k=k, draft_prefill_window=window)
    return {
        "sd": EngineConfig(mode="sd", **base),
        "sd+cmr": EngineConfig(mode="sd", retrieval=r(32, 0), **base),
        "specextend": EngineConfig(mode="specextend", retrieval=r(32, 512), **base),
        "sd+cmr-k16": EngineConfig(mode="sd", retrieval=r(16, 0), **base),
        "specextend-k16": EngineConfig(mode="specextend", retrieval=r(16, 512), **base),
    }


class _PrefillCache:
    """TargetSession whose prefill is computed once per prompt and then copied (benchmark only):
    the engine prefills chunk by chunk through `prefill_chunk_co`; on a hit the first chunk loads
    the whole cached prefix (K/V, last logits, captured last layer) and no chunk runs a forward."""
    store: dict = {}

    @classmethod
    def session_class(cls):
        class CachedTarget(TargetSession):
            def prefill_chunk_co(self, ids, lo, chunk, capture=False):
                key = (tuple(ids.tolist()), chunk)
                last = lo + chunk >= ids.numel()
                hit = cls.store.get(key)
                if hit is not None:
                    kv, logits, captured, _ = hit
                    if lo == 0:
                        self.cache.data[:, :, :, :kv.shape[3]] = kv
                        self.cache.length = kv.shape[3]
                    if last:
                        self.captured = captured
                        return logits.clone()
                    return None
                if lo == 0:
                    self._t0 = time.perf_counter()
                logits = yield from super().prefill_chunk_co(ids, lo, chunk, capture)
                if last:  # keep only the current prompt
                    n = self.cache.length
                    cls.store = {key: (self.cache.data[:, :, :, :n].clone(), logits.clone(), self.captured,
                                       time.perf_counter() - self._t0)}
                return logits
        return CachedTarget

    @classmethod
    def seconds(cls, prompt_ids, chunk) -> float:
        return cls.store[(tuple(prompt_ids), chunk)][3]


def prompt_ids(tok, doc: str, n: int) -> list[int]:
    text = (DOCS / f"{doc}.md").read_text(encoding="utf-8")
    doc_ids = tok.encode(text)
    if len(doc_ids) < n:
        raise SystemExit(f"{doc}.md has only {len(doc_ids)} tokens, fewer than {n}")
    wrapped = tok.apply_chat_template([{"role": "user", "content": MARK + QUESTION}], add_generation_prompt=True,
                                      tokenize=False)
    head, tail = wrapped.split(MARK)
    return tok.encode(head) + doc_ids[:n] + tok.encode(tail)


def first_diff(a: list[int], b: list[int]):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="1024,2048", help="document tokens per prompt, comma separated")
    p.add_argument("--docs", default="fs,stream", help="Node.js api/*.md names")
    p.add_argument("--configs", default="sd,sd+cmr,specextend,specextend-k16", help=f"of {list(configs(TreeConfig()))}")
    p.add_argument("--k16-max-length", type=int, default=2048, help="run the *-k16 configs only up to this length")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--tree", default="16,6,4", help="nodes,depth,topk")
    p.add_argument("--date", default="2026-11-22")
    p.add_argument("--out", type=Path, default=HERE)
    a = p.parse_args(argv)
    tree = TreeConfig(*[int(x) for x in a.tree.split(",")])
    all_cfgs = configs(tree)
    names = a.configs.split(",")
    lengths = [int(x) for x in a.lengths.split(",")]
    docs = a.docs.split(",")
    params = SamplingParams(max_new_tokens=a.new_tokens)  # greedy, stops at EOS like a user's request
    torch.manual_seed(0)

    t_start = time.perf_counter()
    base = EngineConfig(dtype="float32", device="cpu")
    target, draft = load_pair(base)
    load_s = time.perf_counter() - t_start
    print(f"loaded {target.name} + {draft.name} in {load_s:.0f} s; torch threads {torch.get_num_threads()}",
          file=sys.stderr, flush=True)
    engine_mod.TargetSession = _PrefillCache.session_class()

    rows, traces = [], {}

    def write() -> dict:
        total_s = time.perf_counter() - t_start
        (a.out / "results").mkdir(parents=True, exist_ok=True)
        for (name, n), tr in traces.items():
            (TRACES / f"qwen2.5-coder-{name}-{n}.json").write_text(json.dumps(tr) + "\n")
        result = dict(
            benchmark="acceptance", device=f"2-core CPU, float32 ({platform.processor() or platform.machine()})",
            date=a.date, command="python benchmarks/acceptance.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            target=target.name, draft=draft.name, tree=dict(nodes=tree.nodes, depth=tree.depth, topk=tree.topk),
            new_tokens=a.new_tokens, greedy=True, question=QUESTION.strip(), load_s=load_s, total_s=total_s,
            samples_per_cell=len(docs), docs=[f"/usr/share/doc/nodejs/api/{d}.md" for d in docs],
            note="target prefill computed once per prompt and copied into the other configurations",
            all_identical=all(r[f"identical_to_{names[0]}"] for r in rows), rows=rows)
        (a.out / "results" / "acceptance-cpu.json").write_text(json.dumps(result, indent=1) + "\n")
        return result

    for n in lengths:
        for doc in docs:
            ids = prompt_ids(target.tokenizer, doc, n)
            outputs = {}
            for name in names:
                if name.endswith("-k16") and n > a.k16_max_length:
                    continue
                cfg = all_cfgs[name]
                eng = Engine(cfg, target, DraftWorker(draft.decoder, prefill_chunk=cfg.prefill_chunk))
                t0 = time.perf_counter()
                out, finish, st = eng.generate(ids, params)
                wall = time.perf_counter() - t0
                outputs[name] = out
                acc = st.accepted_per_step
                half = len(acc) // 2
                rows.append(dict(
                    length=n, doc=doc, config=name, prompt_tokens=len(ids), new_tokens=len(out), finish=finish,
                    mean_acceptance_length=st.mean_acceptance_length, steps=st.num_steps,
                    accepted_first_half=(sum(acc[:half]) / half + 1) if half else None,
                    accepted_second_half=(sum(acc[half:]) / (len(acc) - half) + 1) if acc[half:] else None,
                    decode_tok_s=(len(out) - 1) / st.decode_s if st.decode_s else 0.0,
                    target_prefill_s=_PrefillCache.seconds(ids, cfg.prefill_chunk),
                    prefill_s=st.prefill_s, wall_s=wall,
                    draft_s=st.draft_s, verify_s=st.verify_s, draft_cache_tokens=st.draft_cache_tokens,
                    retrieval_refreshes=st.retrieval_refreshes, budget_tokens=cfg.retrieval.budget_tokens
                    if cfg.retrieval.enabled else None,
                    hybrid_attention=cfg.hybrid_attention,
                    draft_prefill_window=cfg.retrieval.draft_prefill_window,
                    fallback=st.fallback, accepted_per_step=acc, context_per_step=st.context_per_step))
                tr = traces.setdefault((name, n), dict(
                    target=target.name, draft=draft.name, mode=cfg.mode, config=name, prompt_tokens=len(ids),
                    accepted_per_step=[], context_per_step=[], samples=[]))
                tr["accepted_per_step"] += acc
                tr["context_per_step"] += st.context_per_step
                tr["samples"].append(dict(doc=f"nodejs/api/{doc}.md", prompt_tokens=len(ids),
                                          accepted_per_step=acc, context_per_step=st.context_per_step))
                print(f"[{time.perf_counter() - t_start:6.0f}s] {n} {doc} {name}: acc {st.mean_acceptance_length:.2f}"
                      f" steps {st.num_steps} wall {wall:.0f}s", file=sys.stderr, flush=True)
            ref_name = names[0]
            for r in rows:
                if r["length"] == n and r["doc"] == doc:
                    r["first_diff_vs_" + ref_name] = first_diff(outputs[r["config"]], outputs[ref_name])
                    r["identical_to_" + ref_name] = r["first_diff_vs_" + ref_name] is None
            result = write()  # after every prompt: a cut-short run keeps what it measured
            print(f"  output ({doc}, {n}): {target.tokenizer.decode(outputs[ref_name])!r}", file=sys.stderr)

    result, total_s = write(), time.perf_counter() - t_start
    hdr = f"{'len':>5} {'doc':<7} {'config':<15} {'acc.len':>7} {'steps':>5} {'tok/s':>6} {'draft_kv':>8} {'refr':>4} same"
    print(hdr)
    for r in rows:
        print(f"{r['length']:>5} {r['doc']:<7} {r['config']:<15} {r['mean_acceptance_length']:>7.2f} {r['steps']:>5}"
              f" {r['decode_tok_s']:>6.2f} {r['draft_cache_tokens']:>8} {r['retrieval_refreshes']:>4}"
              f" {'yes' if r['identical_to_' + names[0]] else 'NO@' + str(r['first_diff_vs_' + names[0]])}")
    print(f"total {total_s:.0f} s (load {load_s:.0f} s)")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
