"""Chat prompts -> token ids, with message content encoded as text (docs/architecture.md, *Serving surface*).

The chat template places the special tokens of the turn structure (`<|im_start|>`, ...). A
special token's string inside a message's content must not become that special id, or a user
could close their turn and forge a system turn. So each special-token string in the content is
swapped for a placeholder before the template renders, and encoded afterwards as ordinary text
(`split_special_tokens`). Content without special-token strings encodes exactly as
`encode(apply_chat_template(...))` does.
"""

from __future__ import annotations

import re
import uuid


def _special_strings(tokenizer) -> list[str]:
    added = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    return sorted(added | set(tokenizer.all_special_tokens), key=len, reverse=True)  # longest match first


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    """[{role, content: str}] -> ids of the prompt with the generation prompt appended.
    Template errors propagate (the caller maps them to a 400)."""
    specials = _special_strings(tokenizer)
    found: list[str] = []
    nonce = uuid.uuid4().hex  # placeholders no content can contain by accident

    def hide(match: re.Match) -> str:
        found.append(match.group(0))
        return f"\ue000{nonce}:{len(found) - 1}\ue001"

    if specials:
        pattern = re.compile("|".join(map(re.escape, specials)))
        messages = [{**msg, "content": pattern.sub(hide, msg["content"])} for msg in messages]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if not found:
        return tokenizer.encode(text, add_special_tokens=False)
    ids: list[int] = []
    for i, part in enumerate(re.split(f"\ue000{nonce}:(\\d+)\ue001", text)):
        if i % 2:  # a special-token string from some content: text tokens
            ids += tokenizer.encode(found[int(part)], add_special_tokens=False, split_special_tokens=True)
        elif part:
            ids += tokenizer.encode(part, add_special_tokens=False)
    return ids
