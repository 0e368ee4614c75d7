"""A tool call's arguments streamed as JSON text while the model writes the call (`OutputParser(stream_calls=)`).

Two call languages stream, read from the text after `<tool_call>`:
- Hermes / Qwen (`{"name": "…", "arguments": {…}}`, the head templates and the call constraint write): the
  arguments object's own text, as the model types it, up to the object's end.
- Qwen3-Coder XML (`<function=NAME>` then `<parameter=P>\nvalue\n</parameter>`…`</function>`): a JSON object
  built as the parameters arrive. A parameter the tool's schema types as a string streams its value as it forms
  (escaped into a JSON string: a file being written shows as it is typed); any other value is read whole at its
  closing tag, JSON where it reads as JSON (`tagged_value`, as the whole call's parse reads it).
Put together, a call's deltas are its arguments as JSON. Other languages come whole at the call's end.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod

_HERMES_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_FUNCTION_OPEN, _FUNCTION_CLOSE = "<function=", "</function>"
_PARAMETER_OPEN, _PARAMETER_CLOSE = "<parameter=", "</parameter>"


class StreamedCall(ABC):
    """One call streaming: its name, and the JSON text of its arguments streamed so far (`text`)."""

    def __init__(self, name: str):
        self.name, self.text = name, ""

    @abstractmethod
    def advance(self, body: str) -> str:
        """The arguments' JSON text that `body` (the call so far) adds to what was streamed."""

    def _out(self, text: str) -> str:
        self.text += text
        return text


class HermesArguments(StreamedCall):
    """The arguments object's own text, its nesting followed through strings and escapes to find its end."""

    def __init__(self, name: str, start: int):
        super().__init__(name)
        self.pos, self.depth, self.in_string, self.escaped, self.closed = start, 0, False, False, False

    def advance(self, body: str) -> str:
        at = self.pos
        while at < len(body) and not self.closed:
            ch = body[at]
            at += 1
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                self.closed = self.depth == 0
        text, self.pos = body[self.pos:at], at
        return self._out(text)


class XmlArguments(StreamedCall):
    """A Qwen3-Coder call's parameters as a JSON object. `texts`: the parameters the tool's schema types as
    strings (their values stream; the others are read whole)."""

    def __init__(self, name: str, start: int, texts: frozenset[str]):
        super().__init__(name)
        self.texts, self.pos, self.state = texts, start, "between"
        self.param, self.value_start, self.scan, self.first = "", 0, 0, True

    def advance(self, body: str) -> str:
        out = []
        while True:
            if self.state == "between":  # the next parameter, or the function's end
                opens, closes = body.find(_PARAMETER_OPEN, self.pos), body.find(_FUNCTION_CLOSE, self.pos)
                if closes >= 0 and (opens < 0 or closes < opens):
                    out.append("{}" if self.first else "}")
                    self.state, self.pos = "done", closes + len(_FUNCTION_CLOSE)
                elif opens >= 0:
                    self.state, self.pos = "name", opens + len(_PARAMETER_OPEN)
                else:
                    break
            elif self.state == "name":
                end = body.find(">", self.pos)
                if end < 0:
                    break
                self.param, self.pos, self.state = body[self.pos:end].strip(), end + 1, "open"
            elif self.state == "open":  # one newline after the tag is the format's, not the value's
                if self.pos >= len(body):
                    break
                self.pos += body[self.pos] == "\n"
                out.append(("{" if self.first else ", ") + json.dumps(self.param, ensure_ascii=False) + ": " +
                           ('"' if self.param in self.texts else ""))
                self.first, self.value_start, self.scan, self.state = False, self.pos, self.pos, "value"
            elif self.state == "value":
                if not self._value(body, out):
                    break
            else:
                break
        return self._out("".join(out))

    def _value(self, body: str, out: list[str]) -> bool:
        """Streams the current value; True once its closing tag was read."""
        end = body.find(_PARAMETER_CLOSE, self.scan)
        text = self.param in self.texts
        if end < 0:
            self.scan = max(self.value_start, len(body) - len(_PARAMETER_CLOSE))
            if text:  # all but what could still be the value's last newline and the start of its closing tag
                safe = len(body) - _held_back(body[self.pos:])
                if safe > self.pos:
                    out.append(_escaped(body[self.pos:safe]))
                    self.pos = safe
            return False
        value_end = end - 1 if end > self.value_start and body[end - 1] == "\n" else end
        if text:
            out.append(_escaped(body[self.pos:value_end]) + '"')
        else:
            out.append(json.dumps(tagged_value(body[self.value_start:value_end], False), ensure_ascii=False))
        self.pos, self.state = end + len(_PARAMETER_CLOSE), "between"
        return True


def tagged_value(raw: str, text: bool) -> object:
    """A tagged call's parameter value (XML, GLM): the text itself for a parameter the schema types as a string
    (`text`), else JSON where it reads as JSON, else the text."""
    if text:
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def open_call(body: str, text_params: dict[str, frozenset[str]]) -> StreamedCall | bool:
    """The streamer for the call that `body` (the text after `<tool_call>`) opens; False while that cannot be
    told yet; True when this call is not one that streams (another language, or arguments that are not an
    object): it is judged whole at its end."""
    text = body.lstrip()
    if not text:
        return False
    if text.startswith(_FUNCTION_OPEN):
        end = text.find(">")
        name = text[len(_FUNCTION_OPEN):end if end >= 0 else len(text)]
        if "\n" in name:
            return True
        if end < 0:
            return False
        name = name.strip()
        return XmlArguments(name, len(body) - len(text) + end + 1, text_params.get(name, frozenset()))
    if _FUNCTION_OPEN.startswith(text):
        return False
    head = _HERMES_HEAD.match(body)
    if head is None:  # not (yet) a Hermes head: wait while it still could be one
        return not _could_open_hermes(text)
    value = body[head.end():].lstrip()
    if not value:
        return False  # the arguments' first character decides
    if value[0] != "{":  # arguments as a string or anything else
        return True
    return HermesArguments(json.loads(head.group(1)), len(body) - len(value))


def _could_open_hermes(text: str) -> bool:
    """Whether `text` (stripped, not empty) could still grow into a Hermes call's head."""
    if text[0] != "{":
        return False
    rest = text[1:].lstrip()
    return '"name"'.startswith(rest) if len(rest) < 6 else rest.startswith('"name"')


def _held_back(tail: str) -> int:
    """How much of a streaming text value's end to hold back: a newline and the start of `</parameter>`."""
    for n in range(min(len(tail), len(_PARAMETER_CLOSE) + 1), 0, -1):
        if ("\n" + _PARAMETER_CLOSE).startswith(tail[-n:]) or _PARAMETER_CLOSE.startswith(tail[-n:]):
            return n
    return 0


def _escaped(text: str) -> str:
    """`text` as the inside of a JSON string (escaping is per character, so pieces join into the whole)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]
