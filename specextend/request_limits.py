"""What one request may ask of an engine, and what it costs (a mixin of Engine: it reads the
engine's `config` and `target`): the prompt's and the answer's limits, checked before a session
starts, and the KV cache a request needs (admission control)."""

from __future__ import annotations

from typing import Optional, Sequence

from specextend.config import SamplingParams


class RequestError(ValueError):
    """A request the engine cannot serve as asked (too long, bad ids); maps to HTTP 400 naming
    `param`, the request field at fault."""

    def __init__(self, message: str, param: str = "prompt") -> None:
        super().__init__(message)
        self.param = param


class RequestLimits:
    @property
    def max_prompt_tokens(self) -> int:
        limit = self.target.max_context
        if self.config.max_prompt_tokens:
            limit = min(limit, self.config.max_prompt_tokens)
        return limit

    def capacity(self, prompt_len: int, max_new_tokens: int) -> int:
        return prompt_len + max_new_tokens + self.config.tree.nodes + self.config.lookup_tokens + 2

    def kv_bytes(self, prompt_len: int, max_new_tokens: int) -> int:
        """Target KV bytes one request needs (admission control)."""
        per_tok = self.target.args.kv_bytes_per_token(self.target.decoder.dtype)
        return self.capacity(prompt_len, max_new_tokens) * per_tok

    def check_request(self, prompt_ids: Sequence[int], params: SamplingParams,
                      reference: Optional[Sequence[int]] = None) -> None:
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        if len(prompt_ids) > self.max_prompt_tokens:
            raise RequestError(f"the prompt has {len(prompt_ids)} tokens; the limit is {self.max_prompt_tokens}")
        if params.max_new_tokens > self.config.max_new_tokens:
            raise RequestError(f"max_tokens {params.max_new_tokens} exceeds the limit {self.config.max_new_tokens}",
                               "max_tokens")
        if len(prompt_ids) + params.max_new_tokens > self.target.max_context:
            raise RequestError(f"prompt ({len(prompt_ids)}) + max_tokens ({params.max_new_tokens}) exceeds "
                               f"the model's context of {self.target.max_context} tokens", "max_tokens")
        vocab = self.target.args.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise RequestError(f"prompt token ids must be in [0, {vocab})")
        if reference is not None and not params.greedy:
            raise RequestError("reference tokens (benchmarks) need greedy decoding (temperature 0)", "temperature")

