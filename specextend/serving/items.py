"""What leaves a replica for a request, and when (docs/architecture.md, "Serving surface"): a
stream's items at the stream interval or its share of the replica's items a second, a whole
response's one item, held until its finish; and which prompts the event loop tokenizes itself."""

from __future__ import annotations

from typing import Optional

WHOLE_WAKE_S = 0.25  # how often the loop reads a whole response's steps (no stop strings) before its finish
INLINE_PROMPT = 4096  # prompt ids (or characters of text) that the event loop tokenizes itself


def short_prompt(req: dict) -> bool:
    """A prompt short enough to tokenize on the event loop (well under a millisecond), where a
    worker thread's round trip would wait for the interpreter lock twice behind the engine thread
    (up to the switch interval each)."""
    if req.get("messages") is not None:
        return sum(len(str(m.get("content") or "")) for m in req["messages"]) <= INLINE_PROMPT
    if req.get("prompt_ids") is not None:
        return len(req["prompt_ids"]) <= INLINE_PROMPT
    return len(req.get("prompt") or "") <= INLINE_PROMPT


def item_wait(interval: float, streams: int, item_s: float) -> float:
    """Seconds a stream's next item waits after its last: the stream interval, or, where `streams`
    share the replica's items a second (one every `item_s`), each one's share of them."""
    return max(interval, streams * item_s)


def merged(held: Optional[dict], item: dict) -> dict:
    """`item` after the held items before it: their text and token ids first, the first's prompt ids."""
    if held is None:
        return item
    out = {**item, "text": held["text"] + item["text"], "token_ids": held["token_ids"] + item["token_ids"]}
    if "prompt_token_ids" in held:
        out["prompt_token_ids"] = held["prompt_token_ids"]
    return out
