"""OpenAI-compatible request and response models (the subset specextend serves, plus vLLM's
`return_token_ids`, `ignore_eos` and `top_k` extensions).

Fields we accept but do not implement are listed in UNSUPPORTED: a request that sets one to
anything but its neutral value gets a 400 naming it. Unknown fields are ignored, as OpenAI and
vLLM do.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Annotated, Any, Callable, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from specextend.serving.errors import BadRequestError

if TYPE_CHECKING:  # the ingress imports this module and never torch
    from specextend.stats import RequestStats


def _omit_none(value: Any) -> bool:
    return value is None


def _unicode(value: str) -> str:
    """JSON may carry lone UTF-16 surrogates ("\\ud800"): not text a tokenizer can encode."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"invalid Unicode text: a lone surrogate at character {e.start}") from None
    return value


Text = Annotated[str, AfterValidator(_unicode)]
# Chat roles (docs/architecture.md, *Serving surface*): OpenAI's `developer` is rendered as `system`;
# `tool` needs tools, which are not supported.
ROLES = ("system", "user", "assistant", "developer")


class StreamOptions(BaseModel):
    include_usage: bool = False


class SpeculativeDecodingRequest(BaseModel):
    """Per-request control of speculation: `{"enabled": false}` decodes plainly, `{"max_tree_nodes":
    N}` bounds the draft tree (1 <= N <= the app's tree_nodes). Unknown keys are a 400."""

    model_config = ConfigDict(extra="forbid")
    enabled: bool = True
    max_tree_nodes: Optional[int] = Field(None, ge=1)
    # benchmarks only (the app's `benchmark_references`), greedy: the tokens to emit where the
    # target's own choice differs (served ar's output, so that every mode decodes the same text)
    reference_token_ids: Optional[list[int]] = None


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None  # None: the served model
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=-1)  # vLLM extension; -1 or 0: off
    seed: Optional[int] = Field(None, ge=-(2**63), lt=2**63)  # signed 64-bit, as vLLM: distinct generators
    stop: Optional[Union[Text, list[Text]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    return_token_ids: bool = False  # vLLM extension: generated (and prompt) token ids
    ignore_eos: bool = False  # vLLM extension
    user: Optional[str] = None  # accepted, ignored
    n: int = 1
    logit_bias: Optional[dict[str, float]] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    speculative_decoding: Optional[SpeculativeDecodingRequest] = None  # specextend extension

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def sampling(self) -> dict:
        return {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "top_k": self.top_k, "seed": self.seed, "stop": self.stop_list(), "ignore_eos": self.ignore_eos,
                "speculative_decoding": (self.speculative_decoding or SpeculativeDecodingRequest()).model_dump()}


# field -> (is the value unsupported?, why)
UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "n": (lambda v: v != 1, "only n=1 is supported"),
    "best_of": (lambda v: v not in (None, 1), "only best_of=1 is supported"),
    "logprobs": (lambda v: v not in (None, False), "logprobs are not supported"),
    "top_logprobs": (lambda v: v not in (None, 0), "top_logprobs are not supported"),
    "echo": (lambda v: bool(v), "echo is not supported"),
    "suffix": (lambda v: bool(v), "suffix is not supported"),
    "tools": (lambda v: bool(v), "tools are not supported"),
    "tool_choice": (lambda v: v not in (None, "none"), "tool_choice is not supported"),
    "response_format": (lambda v: v is not None and v.get("type", "text") != "text",
                        "only response_format type 'text' is supported"),
    "logit_bias": (lambda v: bool(v), "logit_bias is not supported"),
    "presence_penalty": (lambda v: v != 0, "presence_penalty is not supported"),
    "frequency_penalty": (lambda v: v != 0, "frequency_penalty is not supported"),
}


def check_supported(req: BaseModel) -> None:
    for name, (bad, why) in UNSUPPORTED.items():
        if name in type(req).model_fields and bad(getattr(req, name)):
            raise BadRequestError(f"{why} (got {name}={getattr(req, name)!r})", name)


class CompletionRequest(SamplingFields):
    prompt: Union[Text, list[int], list[Text], list[list[int]]]
    best_of: Optional[int] = None
    logprobs: Optional[int] = None
    echo: bool = False
    suffix: Optional[str] = None

    def engine_prompt(self) -> dict:
        """{"prompt": str} or {"prompt_ids": [...]} of the one prompt (batches of >1: 400)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise BadRequestError(f"batched prompts are not supported (got {len(p)} prompts)", "prompt")
            p = p[0]
        return {"prompt": p} if isinstance(p, str) else {"prompt_ids": list(p)}


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: Optional[Text] = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal[ROLES]
    content: Optional[Union[Text, list[ContentPart]]] = None

    def template_dict(self) -> dict:
        content = self.content
        if isinstance(content, list):
            if any(part.type != "text" for part in content):
                raise BadRequestError("only text content parts are supported", "messages")
            content = "".join(part.text or "" for part in content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content or ""}


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None
    response_format: Optional[dict[str, Any]] = None

    def sampling(self) -> dict:
        out = super().sampling()
        out["max_tokens"] = self.max_completion_tokens or self.max_tokens
        return out


# ------------------------------------------------------------------ responses

class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose K/V came from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: Optional[PromptTokensDetails] = None


class StepKind(BaseModel):
    steps: int
    tokens: int  # emitted by those steps
    ms: float  # their wall time
    wait_ms: float = 0.0  # ... of which waiting for the draft's answer
    forward_ms: float = 0.0  # their target forwards' device time (0: not timed); the rest is host work


class SpeculativeDecoding(BaseModel):
    mean_acceptance_length: float
    num_steps: int
    retrieval_refreshes: int
    draft_cache_tokens: int
    fallback: bool
    draft_ms_per_step: float = 0.0  # includes the gRPC round trip
    verify_ms_per_step: float = 0.0
    target_wait_ms_per_step: float = 0.0  # the target's wait for a tree (draft work not hidden + transport)
    transport_ms_per_step: float = 0.0  # of which the round trip to the draft (the wait beyond the draft's own time)
    draft_queue_ms_per_step: float = 0.0  # of which the step waited for the draft's thread
    tree_ready_fraction: float = 0.0  # steps whose tree was drafted while the target verified
    prepared_fraction: float = 0.0  # of all steps, those whose tree came with a prepare (no step call)
    draft_ahead_depth: float = 0.0  # mean depth drafted ahead of the new root when asked
    plain_steps: int = 0  # plain decoding steps chosen because speculation did not pay (tree_policy=adaptive)
    unready_steps: int = 0  # plain decoding steps because the overlapping draft had no tree ready
    probe_steps: int = 0  # steps with the largest tree taken to re-measure it (tree_policy=adaptive)
    mean_tree_nodes: float = 0.0  # draft nodes verified per speculative step (the trees chosen)
    lookup_steps: int = 0  # steps without a draft tree that verified a context-lookup chain
    lookup_accepted: int = 0  # accepted tokens that only a context-lookup chain proposed
    told_steps: int = 0  # plain steps whose tokens the overlapping draft was sent at once (its pool follows them)
    ahead_steps: int = 0  # steps whose forward was queued before the host read the step before (plain, lookup)
    asked_steps: int = 0  # tree steps whose tree was asked for as soon as the verdict before was known
    snapshot_trees: int = 0  # tree steps whose tree came from the draft's latest pool snapshot, no call
    open_steps: int = 0  # plain steps decoded while the draft still prefilled the prompt (it joined after them)
    max_step_ms: float = 0.0  # the longest decode step, wall time
    draft_open_ms: float = 0.0  # the draft's open (its prefill of the prompt), as the target timed it
    target_prefill_ms: float = 0.0  # the target's prefill of the same prompt, beside the draft's
    # by kind of step: tree, plain, lookup (a plain step that verified a lookup chain), unready, open
    step_kinds: dict[str, StepKind] = Field(default_factory=dict)
    # the adaptive policy's mean predicted tokens/s of the tree and the plain steps it chose (beside
    # what step_kinds says they did)
    predicted_tok_per_s: dict[str, float] = Field(default_factory=dict)
    # the asked steps' mean times, ms: stats.ASK_PARTS (sent, call, draft, queued, flight, overlap, back)
    ask_ms: dict[str, float] = Field(default_factory=dict)
    # a kind of step's mean wall time by phase, ms (stats.PhaseClock: tree: wait, graft, verify, verdict,
    # ask, commit, retrieval, books; plain and lookup: step, books; "between": {"ms": between steps})
    phase_ms: dict[str, dict[str, float]] = Field(default_factory=dict)
    # with reference_token_ids: the tokens it overrode and the largest top-two gap where it did
    reference_overrides: Optional[int] = Field(None, exclude_if=lambda v: v is None)
    reference_max_gap: Optional[float] = Field(None, exclude_if=lambda v: v is None)
    # ... and the largest such gap in rounding steps of the target's dtype at the logits' magnitude
    reference_max_gap_steps: Optional[float] = Field(None, exclude_if=lambda v: v is None)
    # ... and each override: [output position, gap, gap in those steps, the target's token] (the
    # benchmarks settle one beyond a step by the target's float32 logits there: near_tie.settle_overrides)
    reference_override_at: Optional[list[tuple[int, float, Optional[float], Optional[int]]]] = Field(
        None, exclude_if=lambda v: v is None)
    replayed: Optional[bool] = Field(None, exclude_if=lambda v: v is None)  # benchmarks' acceptance replay


def spec_decoding(stats: RequestStats) -> dict:
    """A SpeculativeDecoding object's fields from a request's stats.RequestStats."""
    steps = max(stats.num_steps, 1)
    out = {"mean_acceptance_length": stats.mean_acceptance_length, "num_steps": stats.num_steps,
           "retrieval_refreshes": stats.retrieval_refreshes,
           "draft_cache_tokens": stats.draft_cache_tokens, "fallback": stats.fallback,
           "draft_ms_per_step": 1e3 * stats.draft_s / steps,  # includes the gRPC round trip
           "verify_ms_per_step": 1e3 * stats.verify_s / steps,
           "target_wait_ms_per_step": stats.target_wait_ms_per_step,
           "transport_ms_per_step": stats.transport_ms_per_step,
           "draft_queue_ms_per_step": stats.draft_queue_ms_per_step,
           "tree_ready_fraction": stats.tree_ready_fraction, "draft_ahead_depth": stats.draft_ahead_depth,
           "prepared_fraction": stats.prepared_steps / steps if stats.num_steps else 0.0,
           "plain_steps": stats.plain_steps, "probe_steps": stats.probe_steps,
           "unready_steps": stats.unready_steps,
           "mean_tree_nodes": stats.mean_tree_nodes,
           "lookup_steps": stats.lookup_steps, "lookup_accepted": stats.lookup_accepted,
           "told_steps": stats.told_steps, "asked_steps": stats.asked_steps, "ahead_steps": stats.ahead_steps,
           "snapshot_trees": stats.snapshot_trees, "open_steps": stats.open_steps, "max_step_ms": 1e3 * stats.max_step_s,
           "draft_open_ms": 1e3 * stats.draft_open_s, "target_prefill_ms": 1e3 * stats.target_prefill_s,
           "predicted_tok_per_s": stats.predicted_tok_per_s, "ask_ms": stats.ask_ms, "phase_ms": stats.phase_ms,
           "step_kinds": {k: {"steps": n, "tokens": t, "ms": 1e3 * sec, "wait_ms": 1e3 * w, "forward_ms": 1e3 * f}
                          for k, (n, t, sec, w, f) in stats.step_kinds.items()}}
    if stats.replayed:
        out["replayed"] = True
    out.update(stats.reference_summary)
    return out


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: Optional[Literal["stop", "length"]] = None
    token_ids: Optional[list[int]] = Field(None, exclude_if=_omit_none)
    prompt_token_ids: Optional[list[int]] = Field(None, exclude_if=_omit_none)


class DeltaMessage(BaseModel):
    role: Optional[Literal["assistant"]] = Field(None, exclude_if=_omit_none)
    content: Optional[str] = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: Optional[ChatMessageOut] = Field(None, exclude_if=_omit_none)  # non-streamed
    delta: Optional[DeltaMessage] = Field(None, exclude_if=_omit_none)  # streamed
    logprobs: None = None
    finish_reason: Optional[Literal["stop", "length"]] = None
    token_ids: Optional[list[int]] = Field(None, exclude_if=_omit_none)


class Response(BaseModel):
    """A completion / chat completion, or one streamed chunk of either."""

    id: str
    object: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[Union[CompletionChoice, ChatChoice]]
    usage: Optional[Usage] = Field(None, exclude_if=_omit_none)
    speculative_decoding: Optional[SpeculativeDecoding] = Field(None, exclude_if=_omit_none)
    prompt_token_ids: Optional[list[int]] = Field(None, exclude_if=_omit_none)  # chat (vLLM)


def request_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "specextend"
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
