"""Constrained sampling: every sampled token keeps the output inside a small language, checked on the token's bytes.

- `JsonObject` (`response_format` json_object / json_schema): the reply is one JSON object, then it ends.
- the tool-call languages of call_languages.py and tag_calls.py (Hermes/Qwen JSON, Mistral, Llama 3, DeepSeek;
  Qwen3-Coder XML, GLM): text is free, but a call must be a call of an offered tool in the model's own format,
  its arguments valid under the tool's schema.

Rejection sampling over the unconstrained sampler: draw a token; if its bytes cannot continue the language, mask
it out and draw again — a draw from the same filtered distribution renormalised over the tokens that remain, so
greedy stays greedy and sampling keeps its temperature. A model mostly proposes valid tokens, so a step costs one
draw; after MAX_DRAWS refusals the best-scoring valid token among the top FALLBACK_RANKS is taken.

Tokens are read as bytes (`Tokenizer.token_bytes`) because a byte-fallback or byte-level token may hold part of a
UTF-8 character: the language reads whole characters only, and the incomplete tail of the output waits (`pending`)
until a later token completes it. A token may leave a tail only if it is valid UTF-8 so far (utf8_tail.py) and a
character starting with it is found that continues the language (`_continues`); the reply cannot end while a tail
is pending.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Protocol

import torch

from freetoken.engine.call_languages import (
    DEEPSEEK_SEP,
    DSML,
    DeepseekCalls,
    HarmonyCalls,
    HermesCalls,
    Llama3Calls,
    MistralCalls,
)
from freetoken.engine.dsml_calls import DsmlCalls
from freetoken.engine.json_prefix import JsonPrefix
from freetoken.engine.json_schema import Node, SchemaPrefix, compile_schema
from freetoken.engine.sampling import Sampler, SamplingParams
from freetoken.engine.tag_calls import GlmCalls, QwenXmlCalls
from freetoken.engine.utf8_tail import first_chars, split_utf8


class Language(Protocol):
    def copy(self) -> Language: ...
    def feed(self, text: str) -> bool: ...  # False: no valid output continues with `text`
    @property
    def can_end(self) -> bool: ...  # the output may stop here
    @property
    def must_end(self) -> bool: ...  # the output is finished: only end-of-sequence follows


class JsonObject:
    """One JSON object (leading whitespace allowed), then the end; valid under `schema` when one is given."""

    def __init__(self, schema: Node | None = None) -> None:
        self.json = JsonPrefix() if schema is None else SchemaPrefix(schema)

    def copy(self) -> JsonObject:
        other = JsonObject.__new__(JsonObject)
        other.json = self.json.copy()
        return other

    def feed(self, text: str) -> bool:
        return self.json.feed(text)

    @property
    def can_end(self) -> bool:
        return self.json.complete

    must_end = can_end


def language_for(params: SamplingParams) -> Language:
    """The language a reply with these parameters is constrained to (`call_single`: its first call ends it)."""
    language = _language(params)
    if params.call_single:
        language.single = True  # (Llama 3's and Harmony's replies hold one call anyway)
    return language


def _language(params: SamplingParams) -> Language:
    if params.json_object:
        return JsonObject(compile_schema(params.json_schema) if params.json_schema else None)
    names = tuple(name for name, _ in params.call_tools)
    if params.call_format == "hermes":
        return HermesCalls(params.call_opening, names, params.call_schemas)
    if params.call_format == "qwen-xml":
        return QwenXmlCalls(params.call_opening, params.call_tools, params.call_schemas)
    if params.call_format == "glm":
        return GlmCalls(params.call_opening, params.call_tools, params.call_schemas)
    if params.call_format in ("deepseek", "deepseek-fenced"):
        return DeepseekCalls(params.call_opening, names, params.call_schemas,
                             fenced=params.call_format == "deepseek-fenced")
    if params.call_format in ("mistral-json", "mistral-args"):
        return MistralCalls(params.call_opening, names, params.call_schemas, args=params.call_format == "mistral-args")
    if params.call_format == "llama3":
        return Llama3Calls(params.call_opening, names, params.call_schemas)
    if params.call_format == "harmony":
        return HarmonyCalls(params.call_opening, names, params.call_schemas)
    if params.call_format in ("dsml", "dsml-function-calls"):
        return DsmlCalls(params.call_opening, params.call_tools, params.call_schemas,
                         function_calls=params.call_format == "dsml-function-calls")
    raise ValueError(f"no constrained language for call format {params.call_format!r}")


def literal_chars(params: SamplingParams) -> frozenset[str]:
    """The non-ASCII characters the request's constraint spells out (schema enums and keys, tool and parameter
    names, a forced call's opening, DeepSeek's markers): where a language takes only given characters, these are
    the ones to probe an incomplete UTF-8 tail with."""
    texts = [params.json_schema, *(schema for _, schema in params.call_schemas), params.call_opening or "",
             *(name for name, _ in params.call_tools), *(p for _, names in params.call_tools for p in names),
             DEEPSEEK_SEP, DSML]
    return frozenset(c for text in map(_unescaped, texts) for c in text if not c.isascii())


def _unescaped(text: str) -> str:
    """JSON text with its `\\u` escapes written out (an enum's "caf\\u00e9" is generated as "café")."""
    try:
        return json.dumps(json.loads(text), ensure_ascii=False)
    except ValueError:
        return text


class ConstrainedSampler:
    MAX_DRAWS = 16
    FALLBACK_RANKS = 8192

    def __init__(self, sampler: Sampler, token_bytes: Callable[[int], bytes], eos: frozenset[int],
                 language: Language, literals: frozenset[str] = frozenset()):
        self.sampler, self.token_bytes, self.eos, self.language = sampler, token_bytes, eos, language
        self.literals = literals  # characters to probe a pending tail with (see `literal_chars`)
        self.pending = b""  # the output's incomplete UTF-8 tail, not yet fed to the language

    def __call__(self, logits: torch.Tensor) -> int:
        """logits [V] → a token id that keeps the output in the language (advancing its state)."""
        if self.language.must_end and self.eos and not self.pending:
            return max(self.eos, key=lambda t: float(logits[t]))
        masked = None
        for _ in range(self.MAX_DRAWS):
            token = self.sampler(logits if masked is None else masked)
            if self._take(token):
                return token
            if masked is None:
                masked = logits.clone()
            masked[token] = float("-inf")
        # a pending character must be completed: look through the whole vocabulary for its continuation bytes
        ranked = torch.argsort(masked, descending=True)[:None if self.pending else self.FALLBACK_RANKS].tolist()
        for token in ranked:
            if self._take(token):
                return token
        # nothing among the likeliest tokens continues (a vocabulary without the characters needed): end the
        # reply rather than emit text outside the language
        return min(self.eos) if self.eos else ranked[0]

    def _take(self, token: int) -> bool:
        if token in self.eos:
            return self.language.can_end and not self.pending
        data = self.token_bytes(token)
        if not data:  # no progress: fine in free text, never inside a constrained stretch (it could loop)
            return self.language.can_end and not self.language.must_end and not self.pending
        split = split_utf8(self.pending + data)
        if split is None:  # not UTF-8: a stray continuation byte, a bad lead byte, a surrogate, an overlong form
            return False
        text, tail = split
        trial = self.language.copy()
        if text and not trial.feed(text):
            return False
        if tail and not self._continues(trial, tail):
            return False
        self.language, self.pending = trial, tail
        return True

    def _continues(self, language: Language, tail: bytes) -> bool:
        """Whether some character starting with `tail` continues `language`, probed with the first such character,
        the first letter or digit, and the literal characters: a language that refuses the first two takes only
        characters it was given (an enum's, a name's), and those are among the literals."""
        probes = (*first_chars(tail), *(c for c in self.literals if c.encode("utf-8").startswith(tail)))
        return any(language.copy().feed(c) for c in probes)
