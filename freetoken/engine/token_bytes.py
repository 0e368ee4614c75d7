"""A token's bytes as they read inside a longer output (`Tokenizer.token_bytes`): what constrained sampling checks.

A token's text is read decoded after a fixed ordinary token and diffed, so a sentencepiece token keeps the leading
space it loses when decoded first. A token holding part of a UTF-8 character decodes to U+FFFD instead; its raw bytes
are read off the vocabulary: `<0xNN>` of a byte-fallback vocabulary is byte NN, a byte-level BPE piece maps each
character back through the GPT-2 byte alphabet (a piece with a character outside it, an added token like
`<｜tool▁sep｜>`, is its own UTF-8, as the `tokenizers` ByteLevel decoder reads it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from freetoken.engine.tokenizer import Tokenizer


def gpt2_byte_alphabet() -> dict[str, int]:
    """The character GPT-2's byte-level BPE writes for each byte → that byte: printable bytes stand for themselves,
    the others are shifted to U+0100 and up."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(shifted)}


class TokenBytes:
    """Token id → the bytes it adds to an output it does not start; cached per id."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.anchor = tokenizer.encode("a")[-1]
        self.anchor_text = tokenizer.decode([self.anchor])
        decoder = tokenizer.backend.decoder  # its JSON names ByteLevel, alone or inside a Sequence
        byte_level = decoder is not None and b'"ByteLevel"' in decoder.__getstate__()
        self.alphabet = gpt2_byte_alphabet() if byte_level else None
        self._cache: dict[int, bytes] = {}

    def __call__(self, token: int) -> bytes:
        data = self._cache.get(token)
        if data is None:
            data = self._cache[token] = self._read(token)
        return data

    def _read(self, token: int) -> bytes:
        if token in self.tokenizer.byte_fallback_ids:
            return bytes([int(self.tokenizer.id_to_token(token)[3:5], 16)])
        both = self.tokenizer.decode([self.anchor, token])
        text = both[len(self.anchor_text):] if both.startswith(self.anchor_text) else both
        if "\ufffd" in text and self.alphabet is not None:  # part of a character, or a real U+FFFD: the piece says
            piece = self.tokenizer.id_to_token(token) or ""
            if all(c in self.alphabet for c in piece):
                return bytes(self.alphabet[c] for c in piece)
        return text.encode("utf-8")
