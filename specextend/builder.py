"""EngineConfig -> a ready Engine with its in-process draft (CLI, benchmarks, tests)."""

from __future__ import annotations

from specextend.config import EngineConfig
from specextend.draft.inprocess import InProcessDraft
from specextend.engine import Engine
from specextend.models.loader import LoadedModel, load_model


class IncompatibleModels(ValueError):
    pass


def check_pair(target: LoadedModel, draft: LoadedModel) -> None:
    """The draft must speak the target's token ids."""
    if target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
        raise IncompatibleModels(f"tokenizer mismatch: draft {draft.name!r} and target {target.name!r} "
                                 "use different vocabularies")
    if draft.args.vocab_size > target.args.vocab_size:
        raise IncompatibleModels("the draft's vocabulary is larger than the target's")


def load_target(config: EngineConfig) -> LoadedModel:
    return load_model(config.target, "target", config.dtype, config.device, config.attention_backend,
                      cuda_graphs=config.cuda_graphs, torch_compile=config.torch_compile,
                      full_graphs=config.full_graphs)


def load_draft(config: EngineConfig, target: LoadedModel) -> LoadedModel:
    draft = load_model(config.draft, "draft", config.dtype, config.device, config.attention_backend,
                       vocab_size=target.args.vocab_size, target_weights=target.decoder.w,
                       cuda_graphs=config.cuda_graphs, torch_compile=config.torch_compile,
                       full_graphs=config.full_graphs)
    check_pair(target, draft)
    return draft


def build_engine(config: EngineConfig, target: LoadedModel | None = None) -> Engine:
    target = target or load_target(config)
    draft = None
    if config.mode != "ar":
        draft = InProcessDraft(load_draft(config, target).decoder, prefill_chunk=config.prefill_chunk)
    return Engine(config, target, draft)
