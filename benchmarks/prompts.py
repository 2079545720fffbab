"""Real-text prompts for the benchmarks: the first L tokens of a document, then a question, in the
tokenizer's chat template (the same ids in-process and over HTTP)."""

from __future__ import annotations

QUESTION = "\n\nSummarize the documentation above, then show a short code example that uses it."


def chat_prompt(tokenizer, text: str, length: int) -> list[int]:
    doc = tokenizer.decode(tokenizer.encode(text)[:length])
    return tokenizer.apply_chat_template([{"role": "user", "content": doc + QUESTION}],
                                         add_generation_prompt=True, tokenize=True, return_dict=False)


def gguf_tokenizer(path: str):
    """The tokenizer stored in a .gguf file (no weights loaded)."""
    from pathlib import Path

    from transformers import AutoTokenizer

    p = Path(path)
    return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
