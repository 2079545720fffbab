"""Byte-level tokenizer for the tiny random presets, built offline in-process.

Ids 0..255 are the raw bytes (GPT-2 byte-to-unicode alphabet, BPE without merges, ByteLevel
pre-tokenizer and decoder), followed by three ChatML special tokens. Any text round-trips:
`decode(encode(text)) == text`. The result is a `transformers.PreTrainedTokenizerFast` with a
Qwen-style ChatML chat template; it saves with `save_pretrained` and reloads with `AutoTokenizer`.
"""

from __future__ import annotations

import functools

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

NUM_BYTE_TOKENS = 256
ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ENDOFTEXT_ID = 256  # EOS and pad
IM_START_ID = 257
IM_END_ID = 258  # end of a chat turn: also an EOS when generating chat replies
EOS_TOKEN_IDS = (ENDOFTEXT_ID, IM_END_ID)
TINY_VOCAB_SIZE = 259

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _byte_to_unicode() -> dict:
    """GPT-2's reversible byte -> printable unicode character map (as used by ByteLevel)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(NUM_BYTE_TOKENS):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(NUM_BYTE_TOKENS + extra)
            extra += 1
    return chars


@functools.lru_cache(maxsize=None)
def build_byte_tokenizer() -> PreTrainedTokenizerFast:
    """The shared tiny-preset tokenizer (cached: treat it as read-only)."""
    vocab = {ch: b for b, ch in _byte_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in (ENDOFTEXT, IM_START, IM_END)])
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=ENDOFTEXT,
        pad_token=ENDOFTEXT,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHATML_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 30,
    )
    ids = hf.convert_tokens_to_ids([ENDOFTEXT, IM_START, IM_END])
    assert ids == [ENDOFTEXT_ID, IM_START_ID, IM_END_ID] and len(hf) == TINY_VOCAB_SIZE, ids
    return hf
