"""GGUF vocabulary metadata small enough to write by hand: a byte-level BPE (every byte one token, a few merges)
and a sentencepiece one with byte fallback (`<0x00>`…`<0xFF>`, a few ASCII pieces), so that any character outside
the pieces is spelled through byte tokens that each hold part of it."""

from __future__ import annotations

from tokenizers import pre_tokenizers

UNKNOWN, CONTROL, BYTE, NORMAL = 2, 3, 6, 1  # llama.cpp's token types


def byte_level_metadata(pre: str, extra_tokens: list[tuple[str, int]] = ()) -> dict:
    """GPT-2-style: the 256 byte characters, "12", "123" and "45", then `extra_tokens` (token, type)."""
    tokens = pre_tokenizers.ByteLevel.alphabet() + ["12", "123", "45"] + [t for t, _ in extra_tokens]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * (len(tokens) - len(extra_tokens)) + [t for _, t in extra_tokens],
        "tokenizer.ggml.merges": ["1 2", "12 3", "4 5"],
    }


def byte_fallback_metadata(pieces: list[str], add_space_prefix: bool = False) -> dict:
    """Sentencepiece-style: <unk>, <s>, </s> (ids 0-2), the 256 byte tokens (ids 3-258), then `pieces` ("▁" for a
    space), longer pieces merging first."""
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    types = [UNKNOWN, CONTROL, CONTROL, *[BYTE] * 256, *[NORMAL] * len(pieces)]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * 259 + [float(len(p)) for p in pieces],
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_space_prefix": add_space_prefix,
        "tokenizer.ggml.add_bos_token": False,
    }
