"""What a replica reads from a request before admitting it (docs/architecture.md, "Serving surface"):
its prompt's token ids, its sampling parameters within the server's limits, and its speculation
settings. A bad value is a BadRequestError (a 400 naming the field). Imports no torch (the
replica's module may not: serving/replica.py)."""

from __future__ import annotations

from specextend.config import SamplingParams
from specextend.models.chat import encode_chat
from specextend.serving.errors import BadRequestError


def tokenize_prompt(tokenizer, req: dict) -> list[int]:
    """The replica calls it in a worker thread unless the prompt is short (`items.short_prompt`):
    megabytes of text take seconds to tokenize (the fast tokenizer releases the GIL, so the event
    loop keeps serving). Chat content is encoded as text."""
    if req.get("messages") is not None:
        try:
            return encode_chat(tokenizer, req["messages"])
        except Exception as e:  # noqa: BLE001 - template errors are the request's fault
            raise BadRequestError(f"cannot apply the chat template: {e}", "messages") from e
    if req.get("prompt_ids") is not None:
        return [int(i) for i in req["prompt_ids"]]
    return tokenizer.encode(req["prompt"])


def sampling_params(req: dict, prompt_len: int, max_new_tokens: int, max_context: int) -> SamplingParams:
    """`max_new_tokens`: the server's limit; `max_context`: the target's."""
    max_tokens = req.get("max_tokens")
    if max_tokens is None:  # as vLLM: up to the end of the context, within the server's limit
        max_tokens = max(1, min(max_new_tokens, max_context - prompt_len))
    elif max_tokens > max_new_tokens:
        raise BadRequestError(f"max_tokens {max_tokens} exceeds the limit {max_new_tokens}", "max_tokens")
    top_k = req.get("top_k") or 0
    try:
        return SamplingParams(max_new_tokens=max_tokens, temperature=req.get("temperature", 1.0),
                              top_p=req.get("top_p", 1.0), top_k=max(top_k, 0), seed=req.get("seed"),
                              ignore_eos=bool(req.get("ignore_eos")))
    except ValueError as e:
        raise BadRequestError(str(e)) from e


def speculation(req: dict, benchmark_references: bool, tree_nodes: int) -> dict:
    """`benchmark_references`: the app's setting; `tree_nodes`: the server's tree size."""
    spec = req.get("speculative_decoding") or {"enabled": True, "max_tree_nodes": None}
    if spec.get("reference_token_ids") is not None and not benchmark_references:
        raise BadRequestError("reference_token_ids is for benchmarks: the app's benchmark_references is off",
                              "speculative_decoding.reference_token_ids")
    n = spec.get("max_tree_nodes")
    if n is not None and n > tree_nodes:
        raise BadRequestError(f"max_tree_nodes {n} exceeds the server's tree_nodes {tree_nodes}",
                              "speculative_decoding.max_tree_nodes")
    return spec
