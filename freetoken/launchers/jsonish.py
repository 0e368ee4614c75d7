"""Edits JSON, JSONC and JSON5 config files in place: sets a value at a key path and leaves every other byte alone.

An agent's config file is its user's: comments, key order, quoting, blank lines and keys we do not know must all
survive a launch. So the text is parsed into spans, not just values, and a change splices only the span it replaces
(a member's value), or inserts one member into its object, indented like its siblings. A file in strict JSON stays
strict: keys are double-quoted, and a trailing comma is written only where the file already uses them.

Dialects: "json" (RFC 8259), "jsonc" (JSON with // and /* */ comments and trailing commas: OpenCode), "json5"
(also unquoted keys, single quotes, hex, leading/trailing dots, +, Infinity/NaN: OpenClaw).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

from freetoken.errors import FreeTokenError

DIALECTS = ("json", "jsonc", "json5")
_IDENTIFIER = re.compile(r"[A-Za-z_$][A-Za-z0-9_$]*")
_JSON_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_JSON5_NUMBER = re.compile(r"[+-]?(?:Infinity|NaN|0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)")
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_JSON5_ESCAPES = {**_ESCAPES, "'": "'", "v": "\v", "0": "\0"}


class ConfigSyntaxError(FreeTokenError):
    """A config file is not valid in its dialect; the message names the line and column."""


@dataclass(slots=True)
class Node:
    """A parsed value and where its text is: `text[start:end]`. Objects also list their members."""

    start: int
    end: int
    value: object
    members: list[Member] | None = None  # objects only, in file order

    def member(self, key: str) -> Member | None:
        """The member named `key` (the last one, as JavaScript reads duplicates)."""
        return next((m for m in reversed(self.members or []) if m.key == key), None)


@dataclass(slots=True)
class Member:
    key: str
    key_start: int
    value: Node
    comma_end: int | None = None  # just past the comma that follows the value, if one does
    quoted: bool = True  # the key was written in quotes


def parse(text: str, dialect: str) -> Node:
    """The document's root node; `ConfigSyntaxError` when the text is not valid `dialect`."""
    if dialect not in DIALECTS:
        raise ValueError(f"unknown dialect {dialect!r}")
    return _Parser(text, dialect).document()


def loads(text: str, dialect: str) -> object:
    return parse(text, dialect).value


def set_value(text: str, path: tuple[str, ...], value: object, dialect: str) -> str:
    """`text` with `value` at `path` (objects created along the way); the text itself when it already holds an
    equal value there. The top level must be an object (an empty text starts one)."""
    if not text.strip():
        return json.dumps(_nested(path, value), indent=2, ensure_ascii=False) + "\n"
    node = parse(text, dialect)
    if node.members is None:
        raise ConfigSyntaxError("the top level is not an object")
    for depth, key in enumerate(path):
        rest = path[depth + 1:]
        member = node.member(key)
        if member is None:
            return _insert_member(text, node, key, _nested(rest, value), dialect)
        if not rest:
            if _same(member.value.value, value):
                return text
            return _splice(text, member.value, value, _line_indent(text, member.key_start), text)
        if member.value.members is None:  # a scalar or a list where an object must go: replaced by one
            return _splice(text, member.value, _nested(rest, value), _line_indent(text, member.key_start), text)
        node = member.value
    raise ValueError("an empty path")


def get_value(text: str, path: tuple[str, ...], dialect: str, default: object = None) -> object:
    value = loads(text, dialect) if text.strip() else {}
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return default
        value = value[key]
    return value


def _nested(path: tuple[str, ...], value: object) -> object:
    for key in reversed(path):
        value = {key: value}
    return value


def _same(a: object, b: object) -> bool:
    """Equal as JSON (True is not 1 here)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def _newline(text: str) -> str:
    return "\r\n" if "\r\n" in text else "\n"


def _indent_step(text: str) -> str:
    """The file's own indentation unit: the least leading whitespace of an indented line, else two spaces."""
    widths = [m.group(1) for m in re.finditer(r"^([ \t]+)\S", text, re.M)]
    return min(widths, key=len) if widths else "  "


def _line_indent(text: str, pos: int) -> str:
    start = text.rfind("\n", 0, pos) + 1
    return re.match(r"[ \t]*", text[start:]).group()


def _render(value: object, indent: str, text: str) -> str:
    """`value` as JSON laid out in the file's style, continuation lines indented under `indent`."""
    step = _indent_step(text)
    rendered = json.dumps(value, indent="\t" if step.startswith("\t") else len(step), ensure_ascii=False)
    return rendered.replace("\n", _newline(text) + indent)


def _splice(text: str, node: Node, value: object, indent: str, style: str) -> str:
    rendered = _render(value, indent, style)
    if isinstance(value, str) and text[node.start] == "'":  # a JSON5 single-quoted string stays single-quoted
        rendered = "'" + rendered[1:-1].replace('\\"', '"').replace("'", "\\'") + "'"
    return text[:node.start] + rendered + text[node.end:]


def _key_text(key: str, obj: Node, dialect: str) -> str:
    """Double-quoted, unless a JSON5 object already writes its keys bare and this one can be."""
    bare = dialect == "json5" and obj.members and not any(m.quoted for m in obj.members)
    return key if bare and _IDENTIFIER.fullmatch(key) else json.dumps(key, ensure_ascii=False)


def _insert_member(text: str, obj: Node, key: str, value: object, dialect: str) -> str:
    nl, key_text = _newline(text), _key_text(key, obj, dialect)
    base = _line_indent(text, obj.start)
    if not obj.members:
        inner = text[obj.start + 1:obj.end - 1]
        indent = base + _indent_step(text)
        member = f"{key_text}: {_render(value, indent, text)}"
        if not inner.strip():
            return text[:obj.start] + "{" + nl + indent + member + nl + base + "}" + text[obj.end:]
        return text[:obj.start + 1] + nl + indent + member + text[obj.start + 1:]  # keeps comments inside
    first, last = obj.members[0], obj.members[-1]
    if "\n" not in text[obj.start:first.key_start]:  # a one-line object: `{"a": 1}` → `{"a": 1, "k": v}`
        at = last.comma_end or last.value.end
        member = f"{key_text}: {json.dumps(value, ensure_ascii=False)}"
        return text[:at] + (" " if last.comma_end else ", ") + member + ("," if last.comma_end else "") + text[at:]
    indent = _line_indent(text, first.key_start)
    member = f"{key_text}: {_render(value, indent, text)}" + ("," if last.comma_end else "")
    at = _end_of_line_comment(text, last.comma_end or last.value.end)
    text = text[:at] + nl + indent + member + text[at:]
    if last.comma_end is None:  # the old last member needs its comma now (before any comment after it)
        text = text[:last.value.end] + "," + text[last.value.end:]
    return text


def _end_of_line_comment(text: str, pos: int) -> int:
    """Past a comment that follows `pos` on the same line, so a new member goes below it, not before it."""
    m = re.match(r"[ \t]*(//[^\r\n]*|/\*(?:(?!\*/)[^\r\n])*\*/[ \t]*)?", text[pos:])
    return pos + (m.end() if m and m.group(1) else 0)


class _Parser:
    def __init__(self, text: str, dialect: str) -> None:
        self.text, self.dialect, self.pos = text, dialect, 0

    def document(self) -> Node:
        self.skip()
        node = self.value()
        self.skip()
        if self.pos != len(self.text):
            self.fail("unexpected text after the top-level value")
        return node

    def fail(self, message: str):
        line = self.text.count("\n", 0, self.pos) + 1
        column = self.pos - self.text.rfind("\n", 0, self.pos)
        raise ConfigSyntaxError(f"line {line}, column {column}: {message}")

    def skip(self) -> None:
        """Whitespace, and comments where the dialect has them."""
        text = self.text
        while self.pos < len(text):
            c = text[self.pos]
            if c in " \t\r\n\ufeff" or (self.dialect == "json5" and c in "\v\f\u00a0\u2028\u2029"):
                self.pos += 1
            elif text.startswith("//", self.pos) and self.dialect != "json":
                end = text.find("\n", self.pos)
                self.pos = len(text) if end < 0 else end
            elif text.startswith("/*", self.pos) and self.dialect != "json":
                end = text.find("*/", self.pos + 2)
                if end < 0:
                    self.fail("unterminated /* comment")
                self.pos = end + 2
            else:
                return

    def value(self) -> Node:
        if self.pos >= len(self.text):
            self.fail("unexpected end of text")
        c, start = self.text[self.pos], self.pos
        if c == "{":
            return self.object()
        if c == "[":
            return self.array()
        if c == '"' or (c == "'" and self.dialect == "json5"):
            return self._string_node()
        for word, value in (("true", True), ("false", False), ("null", None)):
            if self.text.startswith(word, self.pos):
                self.pos += len(word)
                return Node(start, self.pos, value)
        return self.number()

    def _string_node(self) -> Node:
        start = self.pos
        value = self.string()
        return Node(start, self.pos, value)

    def object(self) -> Node:
        start, members, result = self.pos, [], {}
        self.pos += 1
        self.skip()
        while not self.text.startswith("}", self.pos):
            key_start = self.pos
            quoted = self.pos < len(self.text) and self.text[self.pos] in "\"'"
            key = self.key()
            self.skip()
            if not self.text.startswith(":", self.pos):
                self.fail(f"expected ':' after the key {key!r}")
            self.pos += 1
            self.skip()
            member = Member(key, key_start, self.value(), quoted=quoted)
            members.append(member)
            result[key] = member.value.value
            self.skip()
            if self.text.startswith(",", self.pos):
                self.pos += 1
                member.comma_end = self.pos
                self.skip()
                if self.text.startswith("}", self.pos) and self.dialect == "json":
                    self.pos = member.comma_end - 1
                    self.fail("a trailing comma (not allowed in JSON)")
            elif not self.text.startswith("}", self.pos):
                self.fail("expected ',' or '}'")
        self.pos += 1
        return Node(start, self.pos, result, members)

    def key(self) -> str:
        if self.pos < len(self.text) and self.text[self.pos] in "\"'":
            if self.text[self.pos] == "'" and self.dialect != "json5":
                self.fail("single-quoted strings are JSON5, not " + self.dialect.upper())
            return self.string()
        m = _IDENTIFIER.match(self.text, self.pos)
        if not m or self.dialect != "json5":
            self.fail("expected a double-quoted key")
        self.pos = m.end()
        return m.group()

    def array(self) -> Node:
        start, items = self.pos, []
        self.pos += 1
        self.skip()
        while not self.text.startswith("]", self.pos):
            items.append(self.value().value)
            self.skip()
            if self.text.startswith(",", self.pos):
                comma = self.pos
                self.pos += 1
                self.skip()
                if self.text.startswith("]", self.pos) and self.dialect == "json":
                    self.pos = comma
                    self.fail("a trailing comma (not allowed in JSON)")
            elif not self.text.startswith("]", self.pos):
                self.fail("expected ',' or ']'")
        self.pos += 1
        return Node(start, self.pos, items)

    def string(self) -> str:
        text, quote = self.text, self.text[self.pos]
        escapes = _JSON5_ESCAPES if self.dialect == "json5" else _ESCAPES
        out, self.pos = [], self.pos + 1
        while True:
            if self.pos >= len(text):
                self.fail("unterminated string")
            c = text[self.pos]
            if c == quote:
                self.pos += 1
                return "".join(out)
            if c == "\\":
                self.pos += 1
                e = text[self.pos:self.pos + 1]
                if e in escapes:
                    out.append(escapes[e])
                    self.pos += 1
                elif e == "u":
                    out.append(self.unicode_escape())
                elif e == "x" and self.dialect == "json5":
                    out.append(chr(self.hex_digits(self.pos + 1, 2)))
                    self.pos += 3
                elif e in ("\n", "\r") and self.dialect == "json5":  # a line continuation
                    self.pos += 2 if text.startswith("\r\n", self.pos) else 1
                else:
                    self.fail(f"invalid escape \\{e}")
            elif c in "\n\r" or (c < " " and self.dialect != "json5"):
                self.fail("a raw control character in a string")
            else:
                out.append(c)
                self.pos += 1

    def hex_digits(self, at: int, n: int) -> int:
        digits = self.text[at:at + n]
        if len(digits) != n or not all(d in "0123456789abcdefABCDEF" for d in digits):
            self.fail("invalid hex escape")
        return int(digits, 16)

    def unicode_escape(self) -> str:
        code = self.hex_digits(self.pos + 1, 4)
        self.pos += 5
        if 0xD800 <= code < 0xDC00 and self.text.startswith("\\u", self.pos):  # a surrogate pair
            low = self.hex_digits(self.pos + 2, 4)
            if 0xDC00 <= low < 0xE000:
                self.pos += 6
                return chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00))
        return chr(code)

    def number(self) -> Node:
        start = self.pos
        m = (_JSON5_NUMBER if self.dialect == "json5" else _JSON_NUMBER).match(self.text, self.pos)
        if not m:
            self.fail("expected a value")
        self.pos = m.end()
        word = m.group().lstrip("+")
        sign = -1 if word.startswith("-") else 1
        body = word.lstrip("-")
        if body == "Infinity":
            value: object = sign * math.inf
        elif body == "NaN":
            value = math.nan
        elif body[:2] in ("0x", "0X"):
            value = sign * int(body, 16)
        elif any(c in body for c in ".eE"):
            value = float(word)
        else:
            value = int(word)
        return Node(start, self.pos, value)
