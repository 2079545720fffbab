"""Norms folded or not, on one text: every timed request (plain decoding and speculative decoding)
follows one reference answer (the engine's `reference`: a step emits the reference's token where the
target's choice differs), so that the two variants' speeds compare steps, not the continuations
their greedy answers happen to take (docs/architecture.md, "Kernels"; benchmarks/README.md, run AE).

    python benchmarks/fold_ab.py --fold off --refs /tmp/refs.json --out /tmp/ab0.json
    python benchmarks/fold_ab.py --fold on --refs /tmp/refs.json --out /tmp/ab1.json

The first call writes the references (its own plain answers) where --refs does not exist; the second
reads them. Each call warms up first (one plain and one speculative request on a short prompt): on a
fresh GPU machine the real pair's first build compiles its Triton kernels for minutes.
"""
import argparse
import json
import os
import sys
import time

from specextend.models import loader


def timed(eng, ids, params, speculate, ref=None):
    """-> decode tokens/s (after the first token), the request's stats."""
    t_first, n_first, n, last = None, 0, 0, None
    for ev in eng.stream(ids, params, speculate=speculate, reference=ref):
        n += len(ev.token_ids)
        if t_first is None and n:
            t_first, n_first = time.perf_counter(), n
        last = ev
    return (n - n_first) / max(time.perf_counter() - t_first, 1e-9), last.stats


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fold", choices=("on", "off"), required=True)
    p.add_argument("--refs", required=True, help="reference answers (JSON): read, or written where absent")
    p.add_argument("--out", required=True)
    p.add_argument("--target", default="default")
    p.add_argument("--draft", default="default")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--docs", default="python,nodejs")
    p.add_argument("--lengths", default="8192,16384")
    p.add_argument("--new-tokens", type=int, default=256)
    a = p.parse_args(argv)
    loader.FOLD_NORMS = a.fold == "on"
    from specextend.bench import texts
    from specextend.builder import build_engine
    from specextend.config import EngineConfig, SamplingParams

    eng = build_engine(EngineConfig(target=a.target, draft=a.draft, mode="specextend", tree_policy="adaptive",
                                    device=a.device, dtype=a.dtype))
    tok = eng.target.tokenizer
    params = SamplingParams(max_new_tokens=a.new_tokens, ignore_eos=True)
    docs = texts.documents(a.docs.split(","))
    prompts = {f"{d.name}-{n}": texts.prompt_ids(tok, d, int(n)) for d in docs for n in a.lengths.split(",")}
    warm = texts.prompt_ids(tok, docs[0], min(2048, min(int(n) for n in a.lengths.split(","))))
    for speculate in (False, True):
        timed(eng, warm, params, speculate)
    if os.path.exists(a.refs):
        refs = json.load(open(a.refs))
    else:
        refs = {k: eng.generate(ids, params, speculate=False)[0] for k, ids in prompts.items()}
        json.dump(refs, open(a.refs, "w"))
    command = "python benchmarks/fold_ab.py " + " ".join(sys.argv[1:] if argv is None else argv)
    out = dict(meta=dict(fold=a.fold, target=a.target, draft=a.draft, device=a.device, command=command), rows={})
    for k, ids in prompts.items():
        ar, _ = timed(eng, ids, params, False, refs[k])
        sp, st = timed(eng, ids, params, True, refs[k])
        gaps = [float(g) for g in st.reference_gaps or []]  # the target's top-two gap where the reference overrode it
        out["rows"][k] = dict(ar=ar, specextend=sp, overrides=len(gaps), max_gap=max(gaps, default=0.0))
        print(f"fold {a.fold} {k}: ar {ar:.1f} tok/s, specextend {sp:.1f} ({sp / ar:.2f}x), {len(gaps)} overrides "
              f"(largest gap {max(gaps, default=0.0):.3f})", flush=True)
    json.dump(out, open(a.out, "w"), indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
