"""Bytes that may stop inside a UTF-8 character: their complete characters, the incomplete tail, and the characters
that tail can still become.

Constrained sampling reads tokens as bytes, because a byte-fallback token (`<0xE2>`) or a byte-level BPE piece may
hold part of a character, and its language reads only whole characters. A tail is valid only while some Unicode
scalar value (not a surrogate, at most U+10FFFF, shortest form) is encoded with it as a prefix: RFC 3629's table,
stricter than Python's incremental decoder, which keeps b"\\xed\\xa0" (a surrogate's start) pending.
"""

from __future__ import annotations

import codecs
import functools

_SURROGATES = range(0xD800, 0xE000)
_SMALLEST = {2: 0x80, 3: 0x800, 4: 0x10000}  # below these a sequence of that length is an overlong form


def split_utf8(data: bytes) -> tuple[str, bytes] | None:
    """`data` → (its complete characters, the incomplete tail, at most 3 bytes); None when it is not UTF-8 so far:
    an invalid byte or sequence, or a tail no character starts with."""
    if data.isascii():  # most tokens
        return data.decode("ascii"), b""
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        text = decoder.decode(data, final=False)
    except UnicodeDecodeError:
        return None
    tail = decoder.getstate()[0]
    return (text, tail) if not tail or starts_a_character(tail) else None


def starts_a_character(tail: bytes) -> bool:
    """Whether some character's encoding starts with `tail`."""
    points = code_points(tail)
    # surrogates fill a tail's range whole or sit at one end of it (b"\xed": U+D000-U+DFFF), so its ends decide
    return bool(points) and (points[0] not in _SURROGATES or points[-1] not in _SURROGATES)


def code_points(tail: bytes) -> range:
    """The code points whose UTF-8 encoding starts with `tail` (a lead byte and continuation bytes; empty when
    none does). The encoding keeps code point order, so they are one range (surrogates in it are not characters)."""
    lead = tail[0]
    length = 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
    if not 0xC0 <= lead < 0xF8 or len(tail) >= length:
        return range(0)
    bits = lead & (0x7F >> length)
    for byte in tail[1:]:
        bits = bits << 6 | (byte & 0x3F)
    free = 6 * (length - len(tail))  # the bits the missing continuation bytes will bring
    low, high = bits << free, (bits << free) | ((1 << free) - 1)
    return range(max(low, _SMALLEST[length]), min(high, 0x10FFFF) + 1)


@functools.lru_cache(maxsize=4096)
def first_chars(tail: bytes) -> tuple[str, ...]:
    """The first character `tail` can become and, if another, the first letter or digit: probes of whether a
    language accepts some character starting with `tail` (one that takes any character accepts the first; one that
    takes names may want a letter)."""
    chars = (chr(cp) for cp in code_points(tail) if cp not in _SURROGATES)
    first = next(chars, None)
    if first is None:
        return ()
    word = first if first.isalnum() else next((c for c in chars if c.isalnum()), None)
    return (first,) if word in (None, first) else (first, word)
