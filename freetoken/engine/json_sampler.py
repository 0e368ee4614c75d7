"""Constrained sampling: every sampled token keeps the output inside a small language, checked on the token's text.

- `JsonObject` (`response_format` json_object / json_schema): the reply is one JSON object, then it ends.
- the tool-call languages of call_languages.py and tag_calls.py (Hermes/Qwen JSON, Mistral, Llama 3, DeepSeek;
  Qwen3-Coder XML, GLM): text is free, but a call must be a call of an offered tool in the model's own format,
  its arguments valid under the tool's schema.

Rejection sampling over the unconstrained sampler: draw a token; if its text cannot continue the language, mask
it out and draw again — a draw from the same filtered distribution renormalised over the tokens that remain, so
greedy stays greedy and sampling keeps its temperature. A model mostly proposes valid tokens, so a step costs one
draw; after MAX_DRAWS refusals the best-scoring valid token among the top FALLBACK_RANKS is taken.
"""

from __future__ import annotations

import functools
from typing import Protocol

import torch

from freetoken.engine.call_languages import DeepseekCalls, HarmonyCalls, HermesCalls, Llama3Calls, MistralCalls
from freetoken.engine.dsml_calls import DsmlCalls
from freetoken.engine.json_prefix import JsonPrefix
from freetoken.engine.json_schema import Node, SchemaPrefix, compile_schema
from freetoken.engine.sampling import Sampler, SamplingParams
from freetoken.engine.tag_calls import GlmCalls, QwenXmlCalls
from freetoken.engine.tokenizer import Tokenizer


class TokenTexts:
    """A token's text as it reads inside a longer output: decoded after a fixed ordinary token and diffed, so a
    sentencepiece token keeps the leading space it loses when decoded first. Cached per id."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.anchor = tokenizer.encode("a")[-1]
        self.anchor_text = tokenizer.decode([self.anchor])
        self._cache: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self._cache.get(token)
        if text is None:
            both = self.tokenizer.decode([self.anchor, token])
            text = both[len(self.anchor_text):] if both.startswith(self.anchor_text) else both
            self._cache[token] = text
        return text


@functools.lru_cache(maxsize=4)
def token_texts(tokenizer: Tokenizer) -> TokenTexts:
    """One cache of token texts per tokenizer, shared by every constrained reply."""
    return TokenTexts(tokenizer)


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


class ConstrainedSampler:
    MAX_DRAWS = 16
    FALLBACK_RANKS = 8192

    def __init__(self, sampler: Sampler, texts: TokenTexts, eos: frozenset[int], language: Language):
        self.sampler, self.texts, self.eos, self.language = sampler, texts, eos, language

    def __call__(self, logits: torch.Tensor) -> int:
        """logits [V] → a token id that keeps the output in the language (advancing its state)."""
        if self.language.must_end and self.eos:
            return max(self.eos, key=lambda t: float(logits[t]))
        masked = None
        for _ in range(self.MAX_DRAWS):
            token = self.sampler(logits if masked is None else masked)
            if self._take(token):
                return token
            if masked is None:
                masked = logits.clone()
            masked[token] = float("-inf")
        ranked = torch.argsort(masked, descending=True)[:self.FALLBACK_RANKS].tolist()
        for token in ranked:
            if self._take(token):
                return token
        # nothing among the likeliest tokens continues (a vocabulary without the characters needed): end the
        # reply rather than emit text outside the language
        return min(self.eos) if self.eos else ranked[0]

    def _take(self, token: int) -> bool:
        if token in self.eos:
            return self.language.can_end
        text = self.texts(token)
        if not text:  # no progress: fine in free text, never inside a constrained stretch (it could loop)
            return self.language.can_end and not self.language.must_end
        trial = self.language.copy()
        if not trial.feed(text):
            return False
        self.language = trial
        return True
