"""Constrained sampling: every sampled token keeps the output inside a small language, checked on the token's text.

- `JsonObject` (`response_format` json_object / json_schema): the reply is one JSON object, then it ends.
- `HermesCalls` (tools offered to a model that calls them in the Hermes/Qwen format): text is free, but after
  `<tool_call>` the call's body must be `{"name": "<an offered tool>", "arguments": ` then a JSON object closing
  the call's object, followed by `</tool_call>`. A small model's call then always parses and names a real tool;
  nothing outside a call is touched. A forced call (`tool_choice`) starts inside one.
- `QwenXmlCalls` (Qwen3-Coder's XML calls): after `<tool_call>`, `<function=NAME>` of an offered tool, then
  `<parameter=P>` blocks (P among the tool's schema properties where it declares any; values are free text up
  to `</parameter>`), `</function>`, `</tool_call>`.

Rejection sampling over the unconstrained sampler: draw a token; if its text cannot continue the language, mask
it out and draw again — a draw from the same filtered distribution renormalised over the tokens that remain, so
greedy stays greedy and sampling keeps its temperature. A model mostly proposes valid tokens, so a step costs one
draw; after MAX_DRAWS refusals the best-scoring valid token among the top FALLBACK_RANKS is taken. A
json_schema's own structure is not enforced, only JSON syntax with an object at the top.
"""

from __future__ import annotations

import functools
import json
from abc import ABC, abstractmethod
from typing import Protocol

import torch

from freetoken.engine.json_prefix import WHITESPACE, JsonPrefix
from freetoken.engine.json_schema import Node, SchemaPrefix, call_object, compile_schema
from freetoken.engine.sampling import Sampler, SamplingParams
from freetoken.engine.tokenizer import Tokenizer

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


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


def call_head(name: str) -> str:
    """How a Hermes call of `name` starts, as the chat templates write it (and `tool_choice` openings too)."""
    return f'{{"name": {json.dumps(name)}, "arguments": '


class CallsInText(ABC):
    """Free text watched for `<tool_call>`; a subclass defines how a call goes on (`_open`, `_call_char`) and
    returns to FREE (mode 0) once the call is closed. Only free text may end."""

    FREE = 0

    def feed(self, text: str) -> bool:
        return all(self._char(c) for c in text)

    def _char(self, c: str) -> bool:
        if self.mode != self.FREE:
            return self._call_char(c)
        self.tail = (self.tail + c)[-len(CALL_OPEN):]
        if self.tail == CALL_OPEN:
            self._open()
        return True

    @abstractmethod
    def _open(self) -> None:
        """Enters a call: `<tool_call>` was just read."""

    @abstractmethod
    def _call_char(self, c: str) -> bool:
        """Reads one character inside a call; False where no valid call continues with it."""

    @property
    def can_end(self) -> bool:
        return self.mode == self.FREE

    must_end = False


class HermesCalls(CallsInText):
    """Free text in which each `<tool_call>` … `</tool_call>` holds one call object: the head of a call of one
    of `names` (any name if none given), then JSON to the object's end (whitespace around it)."""

    FREE, CALL, CLOSE = range(3)

    def __init__(self, opened: str | None = None, names: tuple[str, ...] = (),
                 schemas: tuple[tuple[str, str], ...] = ()) -> None:
        """`opened`: the reply starts inside a call whose opening (the text after `<tool_call>`, e.g. a forced
        call's name) the prompt already wrote. `schemas`: (name, parameters schema as JSON text) of the tools
        whose arguments must also satisfy their schema (the others' arguments are any JSON object)."""
        self.heads = frozenset(call_head(n) for n in names)
        self.calls = {call_head(n): call_object(n, compile_schema(text)) for n, text in schemas}
        self.mode, self.tail, self.json, self.matched, self.head = self.FREE, "", JsonPrefix(), 0, None
        if opened is not None:
            self._open()
            if not self.feed(opened) or self.mode != self.CALL:
                raise ValueError(f"a call opening that starts no call of {sorted(names)}: {opened!r}")

    def copy(self) -> HermesCalls:
        other = HermesCalls.__new__(HermesCalls)
        other.heads, other.mode, other.tail, other.matched = self.heads, self.mode, self.tail, self.matched
        other.calls = self.calls
        other.json, other.head = self.json.copy(), self.head
        return other

    def _open(self) -> None:
        self.mode, self.json = self.CALL, JsonPrefix()
        self.head = "" if self.heads else None  # the head is matched against the offered tools' first

    def _head_char(self, c: str) -> bool:
        if not self.head and c in WHITESPACE:
            return True
        head = self.head + c
        if not any(h.startswith(head) for h in self.heads):
            return False
        self.head = head
        if head in self.heads:  # a whole head: the arguments (and the call's object) go on as JSON
            if head in self.calls:  # ... valid under the tool's parameters schema
                self.json = SchemaPrefix(self.calls[head])
            self.json.feed(head)
            self.head = None
        return True

    def _call_char(self, c: str) -> bool:
        if self.mode == self.CALL:
            if self.head is not None:
                return self._head_char(c)
            if not self.json.feed(c):
                return False
            if self.json.complete:
                self.mode, self.matched = self.CLOSE, 0
            return True
        if self.matched == 0 and c in WHITESPACE:
            return True
        if c != CALL_CLOSE[self.matched]:
            return False
        self.matched += 1
        if self.matched == len(CALL_CLOSE):
            self.mode, self.tail = self.FREE, ""
        return True


class QwenXmlCalls(CallsInText):
    """Free text in which each `<tool_call>` … `</tool_call>` holds one XML call of an offered tool."""

    FREE, FUNCTION, BODY, NAME, VALUE, CLOSE = range(6)

    def __init__(self, opened: str | None = None, tools: tuple[tuple[str, tuple[str, ...]], ...] = ()) -> None:
        """`tools`: (name, parameter names) pairs; no parameter names: any. `opened`: the reply starts inside a
        call, after this text the prompt wrote."""
        self.params = {name: params for name, params in tools}
        self.mode, self.tail, self.pending, self.function = self.FREE, "", "", ""
        if opened is not None:
            self.mode = self.FUNCTION
            if not self.feed(opened) or self.mode == self.FREE:
                raise ValueError(f"a call opening that starts no call of {sorted(self.params)}: {opened!r}")

    def copy(self) -> QwenXmlCalls:
        other = QwenXmlCalls.__new__(QwenXmlCalls)
        other.params, other.mode, other.tail = self.params, self.mode, self.tail
        other.pending, other.function = self.pending, self.function
        return other

    def _open(self) -> None:
        self.mode, self.pending = self.FUNCTION, ""

    def _options(self) -> list[str]:
        """The literal texts the current stretch must be one of (`pending` holds what matched so far)."""
        if self.mode == self.FUNCTION:
            return [f"<function={name}>" for name in self.params]
        if self.mode == self.BODY:
            names = self.params.get(self.function) or ()
            return [f"<parameter={p}>" for p in names] + ["</function>"] if names else ["<parameter=", "</function>"]
        return [CALL_CLOSE]

    def _call_char(self, c: str) -> bool:
        if self.mode == self.VALUE:  # free text up to </parameter>
            self.tail = (self.tail + c)[-len("</parameter>"):]
            if self.tail == "</parameter>":
                self.mode, self.pending = self.BODY, ""
            return True
        if self.mode == self.NAME:  # a tool that declares no parameters: any name up to '>', not empty
            if c == ">" and self.pending:
                self.mode, self.tail, self.pending = self.VALUE, "", ""
                return True
            self.pending += c
            return c not in "\n>"
        if not self.pending and c in WHITESPACE:
            return True
        pending = self.pending + c
        options = self._options()
        if not any(o.startswith(pending) for o in options):
            return False
        self.pending = pending
        if pending in options:
            self.pending = ""
            if self.mode == self.FUNCTION:
                self.mode, self.function = self.BODY, pending[len("<function="):-1]
            elif pending == "</function>":
                self.mode = self.CLOSE
            elif pending == CALL_CLOSE:
                self.mode, self.tail = self.FREE, ""
            elif pending == "<parameter=":
                self.mode = self.NAME
            else:
                self.mode, self.tail = self.VALUE, ""
        return True


def language_for(params: SamplingParams) -> Language:
    """The language a reply with these parameters is constrained to."""
    if params.json_object:
        return JsonObject(compile_schema(params.json_schema) if params.json_schema else None)
    if params.call_format == "hermes":
        return HermesCalls(params.call_opening, tuple(name for name, _ in params.call_tools), params.call_schemas)
    if params.call_format == "qwen-xml":
        return QwenXmlCalls(params.call_opening, params.call_tools)
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
