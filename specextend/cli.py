"""Command line: `specextend generate ...`, `specextend fetch-models` and `specextend bench ...`.

The engine's flags are the configuration tree's flat names with dashes, derived by schema.py.
Errors print one line and exit non-zero.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

from pydantic import ValidationError

from specextend.config import EngineConfig, SamplingParams
from specextend.schema import add_arguments, error_line, flat_model, from_arguments


class CliError(Exception):
    pass


# The engine's flags: the flat view of config.EngineConfig (specextend.schema), nothing declared here.
CliSettings = flat_model("CliSettings", EngineConfig, "cli")


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text with speculative decoding (in-process)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--prompt-file", type=Path)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    # the request's own parameters
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    add_arguments(p, CliSettings)
    p.add_argument("--record-trace", type=Path, help="write per-step accepted lengths (JSON) here")
    p.add_argument("--replay-trace", type=Path, help="force accepted lengths from a recorded trace")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def engine_config(a: argparse.Namespace) -> EngineConfig:
    try:
        cfg = from_arguments(CliSettings, a).to_config()
    except ValidationError as e:
        raise CliError(error_line(e)) from None
    return dataclasses.replace(cfg, max_new_tokens=max(cfg.max_new_tokens, a.max_new_tokens, 1))


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
    from specextend.request_limits import RequestError

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
    from specextend.bench.cli import add_parser as add_bench, cmd_bench

    add_bench(sub)
    argv = sys.argv[1:] if argv is None else list(argv)
    a = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from specextend.bench.texts import TextUnavailable
    from specextend.builder import IncompatibleModels
    from specextend.fetch import FetchError
    from specextend.models.loader import ModelLoadError

    try:
        if a.command == "bench":
            return cmd_bench(a, argv)
        return cmd_generate(a) if a.command == "generate" else cmd_fetch(a)
    except (CliError, ModelLoadError, IncompatibleModels, FetchError, TextUnavailable, ValueError) as e:
        print(f"specextend: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
