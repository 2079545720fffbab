"""EngineConfig -> checked models and a ready Engine (the CLI, the replica, the draft actor, tests).

`load_pair` is the one way a process gets its models: it reads both specs' names, configs and
tokenizers, refuses a pair whose draft does not speak the target's token ids, and only then
loads the weights that process needs (the replica the target's, the draft actor the draft's).
"""

from __future__ import annotations

from typing import Optional

from specextend.config import EngineConfig
from specextend.draft.base import DraftSessionParams
from specextend.draft.worker import DraftWorker
from specextend.engine import Engine
from specextend.models.light_meta import same_vocab
from specextend.models.loader import LoadedModel, ModelMeta, load_model, read_meta
from specextend.prefix_cache import PrefixCache


class IncompatibleModels(ValueError):
    pass


def check_pair(target, draft) -> None:
    """The draft must speak the target's token ids (LoadedModel or ModelMeta, each with name,
    tokenizer and args)."""
    if not same_vocab(target.tokenizer, draft.tokenizer):  # (a LightTokenizer's: its recorded digest)
        raise IncompatibleModels(f"tokenizer mismatch: draft {draft.name!r} and target {target.name!r} "
                                 "use different vocabularies")
    if draft.args.vocab_size > target.args.vocab_size:
        raise IncompatibleModels(f"the draft {draft.name!r} has {draft.args.vocab_size} vocabulary rows, more than "
                                 f"the target {target.name!r} ({target.args.vocab_size}): its ids would index "
                                 "past the target's embedding")


def read_pair(config: EngineConfig, light: tuple[str, ...] = ()) -> tuple[ModelMeta, Optional[ModelMeta]]:
    """Both models' metadata, checked as a pair (no weights loaded); no draft in `ar` mode. `light`:
    the roles read from their model cache entries' light records where they exist (read_meta: no
    transformers): the draft's alone in the replica, which tokenizes with the target's tokenizer
    only; both in the draft actor, which never tokenizes."""
    target = read_meta(config.target, "target", cache=config.model_cache, light="target" in light)
    if not config.uses_draft:
        return target, None
    draft = read_meta(config.draft, "draft", vocab_size=target.args.vocab_size, cache=config.model_cache,
                      light="draft" in light)
    check_pair(target, draft)
    return target, draft


def check_specs(config: EngineConfig) -> None:
    """The app builder's check before deploying: the default pair is known to match (its files are
    pinned by sha256), any other is read and checked (seconds, no weights)."""
    if config.uses_draft and not (config.target == "default" and config.draft == "default"):
        read_pair(config)


def _load(meta: ModelMeta, config: EngineConfig, **kw) -> LoadedModel:
    return load_model(meta, meta.role, config.dtype, config.device, config.attention_backend,
                      execution=config.execution, **kw)


def load_pair(config: EngineConfig, roles: tuple[str, ...] = ("target", "draft"),
              metas: Optional[tuple[ModelMeta, Optional[ModelMeta]]] = None, light: tuple[str, ...] = (),
              ) -> tuple[Optional[LoadedModel], Optional[LoadedModel]]:
    """Checks the pair, then loads the weights of the `roles` asked for (None for the others);
    `metas`: read_pair's result, if the caller has it already; `light`: read_pair's (the roles of a
    process that never tokenizes with them: their tokenizers are then LightTokenizers)."""
    target_meta, draft_meta = metas if metas is not None else read_pair(config, light)
    target = _load(target_meta, config) if "target" in roles else None
    draft = None
    if draft_meta is not None and "draft" in roles:
        # a random tiny draft is the correlated copy of the (deterministic) tiny target
        draft = _load(draft_meta, config, vocab_size=target_meta.args.vocab_size,
                      target_weights=target.decoder.w if target is not None else None)
    return target, draft


def build_engine(config: EngineConfig) -> Engine:
    """In-process engine: both models in this process. `draft_overlap` is off unless set: on one GPU
    it pays where the target's forwards leave the device room (the real pair) and loses where they
    fill it (docs/architecture.md, "Overlapped drafting", one GPU)."""
    target, draft = load_pair(config)
    backend = draft_worker(config, draft) if draft is not None else None
    return Engine(config, target, backend, draft_args=draft.args if draft is not None else None)


def draft_worker(config: EngineConfig, draft: LoadedModel, beside_target: bool = True) -> DraftWorker:
    """The draft's worker as `config` says (in process, in the replica, in the draft actor), warmed
    up: with overlap, its background forwards' graphs are captured now, not on a request's path.
    `beside_target`: the target runs in this process too (the draft's thread then queues on a CUDA
    stream of its own: DraftWorker._setup)."""
    worker = DraftWorker(draft.decoder, name=draft.name, prefill_chunk=config.prefill_chunk, overlap=config.overlap,
                         prepare=config.draft_prepare, handover=config.draft_handover,
                         overlap_rows=config.draft_overlap_rows, prefix_cache=PrefixCache.of(config),
                         own_stream=beside_target)
    worker.warm_up(DraftSessionParams(config.tree, config.retrieval, max_new_tokens=64))
    return worker
