"""UTF-8 that may stop inside a character: complete characters, the pending tail, and what the tail can become."""

from __future__ import annotations

import pytest

from freetoken.engine.utf8_tail import code_points, first_chars, split_utf8


@pytest.mark.parametrize(("data", "split"), [
    (b"", ("", b"")),
    (b"caf\xc3\xa9", ("café", b"")),
    (b"caf\xc3", ("caf", b"\xc3")),
    (b"\xe2\x86", ("", b"\xe2\x86")),
    (b"\xc3\xa9\xf0\x9f\xa4", ("é", b"\xf0\x9f\xa4")),
    (b"\xed\x9f", ("", b"\xed\x9f")),  # U+D7C0-U+D7FF: Hangul, not surrogates
    (b"\xef\xbf\xbd", ("\ufffd", b"")),  # a real U+FFFD is a character like any other
])
def test_complete_characters_and_the_pending_tail(data: bytes, split: tuple[str, bytes]) -> None:
    assert split_utf8(data) == split


@pytest.mark.parametrize("data", [
    b"\xa9",  # a continuation byte with no lead
    b"\xc3a",  # a lead byte cut short by an ASCII one
    b"\xc0", b"\xc1", b"\xe0\x80", b"\xf0\x80",  # only overlong forms start so
    b"\xed\xa0", b"\xed\xbf\xbf",  # surrogates (Python's incremental decoder keeps b"\xed\xa0" pending)
    b"\xf4\x90", b"\xf5", b"\xff",  # beyond U+10FFFF
])
def test_bytes_no_character_starts_with_are_refused(data: bytes) -> None:
    assert split_utf8(data) is None


def test_the_characters_a_tail_can_become() -> None:
    assert code_points(b"\xc3") == range(0xC0, 0x100)
    assert code_points(b"\xe2\x86") == range(0x2180, 0x21C0)
    assert code_points(b"\xf4") == range(0x100000, 0x110000)
    assert code_points(b"\xe0") == range(0x800, 0x1000) and code_points(b"\xc1") == range(0)
    assert first_chars(b"\xe2") == ("\u2000", "\u2070")  # the first character, then the first letter or digit
    assert first_chars(b"\xc3") == ("À",) and first_chars(b"\xed") == ("\ud000",)
    for tail in (b"\xc3", b"\xe2\x86", b"\xf0\x9f\xa4", b"\xed"):
        assert all(c.encode().startswith(tail) for c in first_chars(tail))
