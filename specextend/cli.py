"""Command line: `specextend generate ...` and `specextend fetch-models`.

Flags use DESIGN's configuration names with dashes. Errors print one line and exit non-zero.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from specextend.config import (ATTENTION_BACKENDS, DTYPES, MODES, EngineConfig, RetrievalConfig, SamplingParams,
                               TreeConfig)


class CliError(Exception):
    pass


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text with speculative decoding (in-process)")
    p.add_argument("--target", default="default", help="model spec: default, random:<preset>, folder, .gguf, hub id")
    p.add_argument("--draft", default="default")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--prompt-file", type=Path)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--mode", choices=MODES, default="sd")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    t, r = TreeConfig(), RetrievalConfig()
    p.add_argument("--tree-nodes", type=int, default=t.nodes)
    p.add_argument("--tree-depth", type=int, default=t.depth)
    p.add_argument("--tree-topk", type=int, default=t.topk)
    p.add_argument("--hybrid-attention", action="store_true", help="HTA verification (on in specextend mode)")
    p.add_argument("--retrieval", action="store_true", help="cross-model retrieval (on in specextend mode)")
    p.add_argument("--retrieval-chunk-size", type=int, default=r.chunk_size)
    p.add_argument("--retrieval-top-k", type=int, default=r.top_k)
    p.add_argument("--retrieval-every", type=int, default=r.every)
    p.add_argument("--retrieval-sink-chunks", type=int, default=r.sink_chunks)
    p.add_argument("--retrieval-recent-chunks", type=int, default=r.recent_chunks)
    p.add_argument("--draft-prefill-window", type=int, default=None,
                   help="sliding window of the draft's prefill (default 512 with retrieval, else 0 = full)")
    p.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="launch decode-time forwards op by op (on CUDA they run as piecewise graphs)")
    p.add_argument("--no-full-graphs", dest="full_graphs", action="store_false",
                   help="piecewise graphs (eager prefix attention per layer) instead of one graph per forward")
    p.add_argument("--torch-compile", action="store_true",
                   help="fuse the graphs' segments with torch.compile/Inductor (CUDA; compiles at first use)")
    p.add_argument("--dtype", choices=DTYPES, default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--prefill-chunk", type=int, default=2048)
    p.add_argument("--record-trace", type=Path, help="write per-step accepted lengths (JSON) here")
    p.add_argument("--replay-trace", type=Path, help="force accepted lengths from a recorded trace")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def engine_config(a: argparse.Namespace) -> EngineConfig:
    retrieval_on = a.retrieval or a.mode == "specextend"
    window = a.draft_prefill_window if a.draft_prefill_window is not None else (512 if retrieval_on else 0)
    retrieval = RetrievalConfig(enabled=retrieval_on, chunk_size=a.retrieval_chunk_size, top_k=a.retrieval_top_k,
                                every=a.retrieval_every, sink_chunks=a.retrieval_sink_chunks,
                                recent_chunks=a.retrieval_recent_chunks, draft_prefill_window=window)
    return EngineConfig(target=a.target, draft=a.draft, mode=a.mode,
                        tree=TreeConfig(a.tree_nodes, a.tree_depth, a.tree_topk), retrieval=retrieval,
                        hybrid_attention=a.hybrid_attention or a.mode == "specextend",
                        attention_backend=a.attention_backend, cuda_graphs=a.cuda_graphs,
                        torch_compile=a.torch_compile, full_graphs=a.full_graphs, dtype=a.dtype, device=a.device,
                        prefill_chunk=a.prefill_chunk, max_new_tokens=max(a.max_new_tokens, 1))


def _read_prompt(a) -> str:
    if a.prompt is not None:
        return a.prompt
    if not a.prompt_file.is_file():
        raise CliError(f"prompt file not found: {a.prompt_file}")
    return a.prompt_file.read_text(encoding="utf-8")


def _replay(a) -> list[int] | None:
    if a.replay_trace is None:
        return None
    try:
        trace = json.loads(a.replay_trace.read_text())
        lengths = [int(x) for x in trace["accepted_per_step"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CliError(f"cannot read trace {a.replay_trace}: {e}") from e
    if not lengths:
        raise CliError(f"trace {a.replay_trace} has no steps")
    return lengths


def cmd_generate(a) -> int:
    from specextend.builder import build_engine
    from specextend.engine import RequestError

    config = engine_config(a)
    text = _read_prompt(a)
    replay = _replay(a)
    engine = build_engine(config)
    tok = engine.target.tokenizer
    if a.chat:
        prompt_ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False)
    else:
        prompt_ids = tok.encode(text)
    params = SamplingParams(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_p=a.top_p,
                            top_k=a.top_k, seed=a.seed, ignore_eos=a.ignore_eos)
    try:
        ids, finish, stats = engine.generate(prompt_ids, params, replay=replay)
    except RequestError as e:
        raise CliError(str(e)) from e
    out = dict(text=tok.decode(ids, skip_special_tokens=True), token_ids=ids, finish_reason=finish,
               prompt_tokens=len(prompt_ids), mode=config.mode, target=engine.target.name,
               **stats.summary())
    if a.record_trace:
        a.record_trace.write_text(json.dumps(dict(
            target=config.target, draft=config.draft, mode=config.mode, prompt_tokens=len(prompt_ids),
            accepted_per_step=stats.accepted_per_step, context_per_step=stats.context_per_step)))
    if a.json:
        print(json.dumps(out))
    else:
        print(out["text"])
        print(f"\n[{stats.num_generated} tokens, {stats.tokens_per_s:.1f} tok/s, mean acceptance "
              f"{stats.mean_acceptance_length:.2f}, {stats.num_steps} steps{', replayed' if replay else ''}]",
              file=sys.stderr)
    return 0


def cmd_fetch(a) -> int:
    from specextend import fetch

    for which, path in fetch.fetch_all().items():
        print(f"{which}: {path}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="specextend", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    sub.add_parser("fetch-models", help="download and verify the default Qwen2.5-Coder GGUF pair")
    a = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from specextend.builder import IncompatibleModels
    from specextend.fetch import FetchError
    from specextend.models.loader import ModelLoadError

    try:
        return cmd_generate(a) if a.command == "generate" else cmd_fetch(a)
    except (CliError, ModelLoadError, IncompatibleModels, FetchError, ValueError) as e:
        print(f"specextend: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
