"""A tiny Qwen2-architecture GGUF file written in-process with the `gguf` package (tests only):
a byte-level BPE tokenizer of 256 byte tokens, a few merges and the Qwen chat tokens, and
Q8_0-quantised matrices, so that transformers converts it as it does a real checkpoint."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import quantize

EMBED, LAYERS, HEADS, KV_HEADS, FFN = 64, 2, 4, 2, 96
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _byte_tokens() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    merges = ["Ġ t", "h e", "Ġt he", "i n", "e r"]
    tokens = _byte_tokens() + ["".join(m.split()) for m in merges] + SPECIAL
    vocab = len(tokens)
    w = GGUFWriter(str(path), "qwen2")
    w.add_name("tiny-qwen2")
    w.add_context_length(256)
    w.add_embedding_length(EMBED)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([TokenType.NORMAL] * (vocab - len(SPECIAL)) + [TokenType.CONTROL] * len(SPECIAL))
    w.add_token_merges(merges)
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}")

    def matrix(name: str, rows: int, cols: int) -> None:
        data = rng.standard_normal((rows, cols), dtype=np.float32) * 0.1
        q = quantize(data, GGMLQuantizationType.Q8_0)
        w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=GGMLQuantizationType.Q8_0)

    def vector(name: str, n: int, base: float = 0.0) -> None:
        w.add_tensor(name, (base + rng.standard_normal(n, dtype=np.float32) * 0.1).astype(np.float32))

    head_dim = EMBED // HEADS
    matrix("token_embd.weight", vocab, EMBED)
    for i in range(LAYERS):
        b = f"blk.{i}."
        vector(b + "attn_norm.weight", EMBED, 1.0)
        matrix(b + "attn_q.weight", HEADS * head_dim, EMBED)
        matrix(b + "attn_k.weight", KV_HEADS * head_dim, EMBED)
        matrix(b + "attn_v.weight", KV_HEADS * head_dim, EMBED)
        vector(b + "attn_q.bias", HEADS * head_dim)
        vector(b + "attn_k.bias", KV_HEADS * head_dim)
        vector(b + "attn_v.bias", KV_HEADS * head_dim)
        matrix(b + "attn_output.weight", EMBED, HEADS * head_dim)
        vector(b + "ffn_norm.weight", EMBED, 1.0)
        matrix(b + "ffn_gate.weight", FFN, EMBED)
        matrix(b + "ffn_up.weight", FFN, EMBED)
        matrix(b + "ffn_down.weight", EMBED, FFN)
    vector("output_norm.weight", EMBED, 1.0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
