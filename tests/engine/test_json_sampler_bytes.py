"""Constrained sampling on token bytes, with vocabularies that spell a non-ASCII character only through byte tokens
(sentencepiece `<0xC3>` `<0xA9>`, GPT-2 byte-level "Ã" "©"): such a character can be generated where the language
takes it, the language only ever reads whole characters, and the reply cannot end halfway through one."""

from __future__ import annotations

import json

import pytest
import torch

from freetoken.engine.call_languages import HermesCalls
from freetoken.engine.json_sampler import ConstrainedSampler, JsonObject, language_for, literal_chars
from freetoken.engine.sampling import Sampler, SamplingParams
from freetoken.engine.tokenizer import Tokenizer
from support.tiny_vocabs import byte_fallback_metadata, byte_level_metadata

GREEDY = SamplingParams(temperature=0)
ASCII_PIECES = [chr(c) for c in range(ord("!"), ord("~") + 1)] + ["▁", "ca", "caf"]
DRINKS = ["café", "→", "日本", "tea"]


def _byte_fallback() -> tuple[Tokenizer, frozenset[int]]:
    return Tokenizer.from_gguf_metadata(byte_fallback_metadata(ASCII_PIECES)), frozenset({2})


def _byte_level() -> tuple[Tokenizer, frozenset[int]]:
    tokenizer = Tokenizer.from_gguf_metadata(byte_level_metadata("gpt2", [("<|endoftext|>", 3)]))
    return tokenizer, frozenset({tokenizer.token_to_id("<|endoftext|>")})


VOCABS = {"byte-fallback": _byte_fallback, "byte-level": _byte_level}


@pytest.fixture(params=sorted(VOCABS))
def vocab(request) -> tuple[Tokenizer, frozenset[int]]:
    return VOCABS[request.param]()


def _drinks_params(drinks: list[str] = DRINKS) -> SamplingParams:
    schema = {"type": "object", "properties": {"drink": {"enum": drinks}}, "required": ["drink"]}
    return SamplingParams(json_object=True, json_schema=json.dumps(schema))  # (json.dumps writes "caf\u00e9")


class Driver:
    """A greedy constrained reply whose logits, each step, rank the given tokens first (in order), the rest far
    below."""

    def __init__(self, vocab: tuple[Tokenizer, frozenset[int]], language, literals=frozenset()) -> None:
        self.tokenizer, self.eos = vocab
        self.sampler = ConstrainedSampler(Sampler(GREEDY, torch.device("cpu")), self.tokenizer.token_bytes, self.eos,
                                          language, literals)
        self.out: list[int] = []

    def step(self, *ranked: int) -> int:
        logits = torch.full((self.tokenizer.vocab_size,), -10.0)
        for rank, token in enumerate(ranked):
            logits[token] = 10.0 - rank
        token = self.sampler(logits)
        if token not in self.eos:
            self.out.append(token)
        return token

    def write(self, text: str) -> None:
        """Steps that each prefer the next token of `text` as the tokenizer spells it, which must be taken."""
        for token in self.tokenizer.encode(text):
            assert self.step(token) == token, (text, self.tokenizer.id_to_token(token))

    def byte(self, value: int) -> int:
        """The token of one byte: `<0xNN>`, or the byte-level character that stands for it."""
        return next(i for i in range(self.tokenizer.vocab_size) if self.tokenizer.token_bytes(i) == bytes([value]))

    @property
    def text(self) -> str:
        return self.tokenizer.decode(self.out)


@pytest.mark.parametrize("drink", DRINKS)
def test_an_enum_value_spelled_by_byte_tokens_is_generated_exactly(vocab, drink: str) -> None:
    params = _drinks_params()
    driver = Driver(vocab, language_for(params), literal_chars(params))
    reply = json.dumps({"drink": drink}, ensure_ascii=False)
    pieces = [driver.tokenizer.token_bytes(i) for i in driver.tokenizer.encode(reply)]
    if drink != "tea":  # the character exists only in pieces, each decoding alone to U+FFFD
        assert any(len(p) == 1 and p[0] >= 0x80 for p in pieces)
    driver.write(reply)
    assert driver.step(*driver.eos) in driver.eos
    assert driver.text == reply and json.loads(driver.text) == {"drink": drink}


def test_bytes_that_break_utf8_or_leave_the_enum_are_refused(vocab) -> None:
    params = _drinks_params(["café", "tea"])
    driver = Driver(vocab, language_for(params), literal_chars(params))
    byte = driver.byte
    driver.write('{"drink": ')
    assert driver.step(byte(0xC3), *driver.tokenizer.encode('"')) == driver.tokenizer.encode('"')[0]  # a string is due
    assert driver.step(byte(0xE6), byte(0xC3), *driver.tokenizer.encode("t")) == driver.tokenizer.encode("t")[0]
    driver = Driver(vocab, language_for(params), literal_chars(params))
    driver.write('{"drink": "caf')
    assert driver.step(byte(0xA9), byte(0xC0), byte(0xF5), byte(0xC3)) == byte(0xC3)  # a stray continuation, bad leads
    quote = driver.tokenizer.encode('"')[0]
    assert driver.step(*driver.eos, quote, byte(0xA8), byte(0xC3), byte(0xA9)) == byte(0xA9)  # not "caf" + "è"
    driver.write('"}')
    assert driver.text == '{"drink": "café"}'


def test_a_free_string_takes_any_character_but_never_a_surrogate(vocab) -> None:
    driver = Driver(vocab, JsonObject())
    byte = driver.byte
    driver.write('{"a": "')
    assert driver.step(byte(0xED)) == byte(0xED)  # U+D000-U+D7FF are Hangul
    assert driver.step(byte(0xA0), byte(0x9E)) == byte(0x9E)  # ED A0 starts a surrogate
    assert driver.step(byte(0x80)) == byte(0x80)
    driver.write('日"}')
    assert json.loads(driver.text) == {"a": "\ud780日"}


def test_the_reply_cannot_end_inside_a_character(vocab) -> None:
    """Free text may end anywhere, but not while a character is incomplete: its continuation is found even
    ranked last (the whole vocabulary is searched then), and then the end is taken."""
    driver = Driver(vocab, HermesCalls())
    driver.write("caf")
    assert driver.step(driver.byte(0xC3)) == driver.byte(0xC3)
    assert driver.sampler.language.can_end and driver.sampler.pending == b"\xc3"  # (the language saw "caf")
    driver.sampler.FALLBACK_RANKS = 4
    logits = torch.zeros(driver.tokenizer.vocab_size)
    logits[list(driver.eos)] = 10.0
    logits[driver.byte(0xA9)] = -10.0
    token = driver.sampler(logits)
    assert 0x80 <= driver.tokenizer.token_bytes(token)[0] < 0xC0 and driver.sampler.pending == b""
    driver.out.append(token)
    assert driver.step(*driver.eos) in driver.eos and "\ufffd" not in driver.text


def test_ascii_replies_are_sampled_as_before(vocab) -> None:
    params = _drinks_params()
    driver = Driver(vocab, language_for(params), literal_chars(params))
    driver.write('{"drink": "t')
    assert driver.step(*driver.tokenizer.encode("o"), *driver.tokenizer.encode("e")) == driver.tokenizer.encode("e")[0]
    driver.write('a"')
    assert driver.step(*driver.eos, *driver.tokenizer.encode("}")) not in driver.eos  # the object is still open
    assert driver.step(*driver.eos) in driver.eos and driver.text == '{"drink": "tea"}'
    tokenizer, _ = vocab
    anchor = tokenizer.encode("a")[-1]
    for token in range(tokenizer.vocab_size):  # a token of whole characters: the text it read as before, encoded
        text = tokenizer.decode([anchor, token])[len(tokenizer.decode([anchor])):]
        if "\ufffd" not in text:
            assert tokenizer.token_bytes(token) == text.encode(), tokenizer.id_to_token(token)


def test_literal_chars_are_what_the_request_names() -> None:
    params = SamplingParams(json_object=True, json_schema='{"enum": ["caf\\u00e9", "ok"]}')
    assert {"é", "｜", "▁"} == literal_chars(params)  # (DeepSeek's markers are always among them)
    tools = SamplingParams(call_format="hermes", call_tools=(("größe", ("länge",)),), call_opening="→")
    assert {"ö", "ß", "ä", "→"} <= literal_chars(tools)
