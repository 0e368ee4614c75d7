"""Tool-call languages whose parameters are tagged text rather than JSON (see call_languages.py for the JSON
ones and the shared machinery):

- `QwenXmlCalls` (Qwen3-Coder): `<tool_call>` `<function=NAME>` `<parameter=P>value</parameter>`… `</function>`
  `</tool_call>`;
- `GlmCalls` (GLM-4.5): `<tool_call>NAME` then `<arg_key>P</arg_key><arg_value>value</arg_value>`… `</tool_call>`.

In both, P is among the tool's schema properties where it declares any, each once, the required ones before the
close; values are typed by the schema where they are no strings (`XmlValue`: JSON then, or a string enum's
values), free text otherwise.
"""

from __future__ import annotations

import json

from freetoken.engine.call_languages import CALL_CLOSE, CallsInText, glue_space
from freetoken.engine.json_prefix import WHITESPACE
from freetoken.engine.json_schema import Node, SchemaPrefix, compile_schema

PARAMETER_CLOSE = "</parameter>"


class XmlValue:
    """A Qwen3-Coder parameter value as its schema types it, then `</parameter>`: a JSON value where the type is
    no string (numbers, booleans, null, objects, arrays: the parser reads the text as JSON), one of a string
    enum's values as plain text. Whitespace may surround it. Other values (strings, untyped) are free text."""

    __slots__ = ("json", "choices", "text", "closing", "spaces", "close", "pad")

    def __init__(self, json_value: SchemaPrefix | None, choices: tuple[str, ...] = (),
                 close: str = PARAMETER_CLOSE, pad: bool = True) -> None:
        """`pad`: whitespace may surround a choice (Qwen3-Coder writes values on their own lines; GLM does not,
        and its parser keeps string values as written)."""
        self.json, self.choices, self.text, self.spaces, self.close = json_value, choices, "", 0, close
        self.pad = pad
        self.closing: str | None = None  # what of `</parameter>` was read, once the value is whole

    @classmethod
    def of(cls, node: Node | None, close: str = PARAMETER_CLOSE, pad: bool = True) -> XmlValue | None:
        """The constrained value for a parameter's schema node (ended by `close`), or None where its value is
        free text."""
        if node is None or node.types is None:
            return None
        if node.enum is not None:
            values = [json.loads(e) for e in node.enum]
            if all(isinstance(v, str) for v in values):
                return cls(None, tuple(sorted(values)), close, pad)
        return None if "string" in node.types else cls(SchemaPrefix(node, object_root=False), close=close, pad=pad)

    def copy(self) -> XmlValue:
        other = XmlValue(self.json.copy() if self.json is not None else None, self.choices, self.close, self.pad)
        other.text, other.closing, other.spaces = self.text, self.closing, self.spaces
        return other

    @property
    def whole(self) -> bool:
        if self.json is None:
            return self.text in self.choices
        ended = self.json.copy()  # a number is whole once something else follows it
        return ended.feed(" ") and ended.complete

    def feed(self, c: str) -> bool:
        """One character; True when the value stays valid. `closed` tells when `</parameter>` is complete."""
        if self.closing is None and c == "<" and self.whole:
            self.closing = ""
        if self.closing is not None:
            if not self.closing and (space := glue_space(self, c)) is not None:
                return space and (self.pad or self.json is not None)
            self.closing += c
            return self.close.startswith(self.closing)
        if self.json is None:
            text = self.text + c
            if any(v.startswith(text) for v in self.choices):
                self.text = text
                return True
            return c in WHITESPACE and self.pad and (not self.text or self.whole) and glue_space(self, c) and \
                self._lead_or_trail()
        return self.json.feed(c)

    def _lead_or_trail(self) -> bool:
        if self.text:  # whitespace after a whole choice: only the close may follow
            self.closing = ""
        return True

    @property
    def closed(self) -> bool:
        return self.closing == self.close


class TaggedParameterCalls(CallsInText):
    """What the two tagged formats share: the offered tools' parameter names and compiled schemas, the call
    being read (its function, the parameters seen, the typed value under way) and when the call may close."""

    def __init__(self, opened: str | None, tools: tuple[tuple[str, tuple[str, ...]], ...],
                 schemas: tuple[tuple[str, str], ...]) -> None:
        """`tools`: (name, parameter names) pairs; no parameter names: any. `schemas`: (name, parameters schema
        as JSON) of the tools whose values are typed. `opened`: the reply starts inside a call, after this text
        the prompt wrote."""
        self.params = {name: params for name, params in tools}
        self.schemas = {name: compile_schema(text) for name, text in schemas if name in self.params}
        self.mode, self.tail, self.pending, self.function = self.FREE, "", "", ""
        self.seen: frozenset[str] = frozenset()
        self.value: XmlValue | None = None
        self._start_opened(opened, sorted(self.params))

    def copy(self):
        other = type(self).__new__(type(self))
        other.params, other.schemas, other.mode, other.tail = self.params, self.schemas, self.mode, self.tail
        other.pending, other.function, other.seen, other.spaces = self.pending, self.function, self.seen, self.spaces
        other.value = self.value.copy() if self.value is not None else None
        other.single, other.calls = self.single, self.calls
        return other

    def _may_close(self) -> bool:
        """Every required parameter of the call's tool (among those it names) has been written."""
        root = self.schemas.get(self.function)
        names = self.params.get(self.function) or ()
        return root is None or root.required & set(names) <= self.seen

    def _value_char(self, c: str, close: str) -> bool:
        """One character of a parameter's value: the typed value (`value`), or free text, up to `close`; then
        back to the call's body."""
        if self.value is not None:
            if not self.value.feed(c):
                return False
            if self.value.closed:
                self.mode, self.pending, self.value = self.BODY, "", None
            return True
        self.tail = (self.tail + c)[-len(close):]
        if self.tail == close:
            self.mode, self.pending = self.BODY, ""
        return True

    def _typed_value(self, name: str, close: str, pad: bool) -> XmlValue | None:
        """Marks `name` written; the constrained value its schema asks for (None: free text)."""
        root = self.schemas.get(self.function)
        self.seen = self.seen | {name}
        return XmlValue.of(root.properties.get(name) if root is not None else None, close=close, pad=pad)


class QwenXmlCalls(TaggedParameterCalls):
    """Free text in which each `<tool_call>` … `</tool_call>` holds one XML call of an offered tool: its
    parameters among the schema's properties (each at most once, the required ones before `</function>`), values
    typed as the schema says where the format writes them as JSON (`XmlValue`)."""

    FREE, FUNCTION, BODY, NAME, VALUE, CLOSE = range(6)

    def __init__(self, opened: str | None = None, tools: tuple[tuple[str, tuple[str, ...]], ...] = (),
                 schemas: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(opened, tools, schemas)

    def _open(self) -> None:
        self.mode, self.pending = self.FUNCTION, ""

    def _options(self) -> list[str]:
        """The literal texts the current stretch must be one of (`pending` holds what matched so far)."""
        if self.mode == self.FUNCTION:
            return [f"<function={name}>" for name in self.params]
        if self.mode == self.BODY:
            names = self.params.get(self.function) or ()
            if not names:
                return ["<parameter=", "</function>"]
            close = ["</function>"] if self._may_close() else []
            return [f"<parameter={p}>" for p in names if p not in self.seen] + close
        return [CALL_CLOSE]

    def _start_value(self, name: str) -> None:
        self.mode, self.tail = self.VALUE, ""
        self.value = self._typed_value(name, PARAMETER_CLOSE, pad=True)

    def _call_char(self, c: str) -> bool:
        if self.mode == self.VALUE:
            return self._value_char(c, PARAMETER_CLOSE)
        if self.mode == self.NAME:  # a tool that declares no parameters: any name up to '>', not empty
            if c == ">" and self.pending:
                self.mode, self.tail, self.pending = self.VALUE, "", ""
                return True
            self.pending += c
            return c not in "\n>"
        if not self.pending and (space := glue_space(self, c)) is not None:
            return space
        pending = self._literal(c, self._options())
        if pending is None:
            return False
        if pending:
            if self.mode == self.FUNCTION:
                self.mode, self.function, self.seen = self.BODY, pending[len("<function="):-1], frozenset()
            elif pending == "</function>":
                self.mode = self.CLOSE
            elif pending == CALL_CLOSE:
                self._closed()
            elif pending == "<parameter=":
                self.mode = self.NAME
            else:
                self._start_value(pending[len("<parameter="):-1])
        return True


ARG_KEY, ARG_KEY_END, ARG_VALUE, ARG_VALUE_END = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"


class GlmCalls(TaggedParameterCalls):
    """Free text in which each `<tool_call>` … `</tool_call>` holds one GLM-4.5 call: an offered tool's name,
    then `<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>` pairs (keys among the schema's properties, each
    once, the required ones before the close; values typed like Qwen3-Coder's, see `XmlValue`)."""

    FREE, NAME, BODY, KEY, GAP, VALUE = range(6)

    def __init__(self, opened: str | None = None, tools: tuple[tuple[str, tuple[str, ...]], ...] = (),
                 schemas: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(opened, tools, schemas)

    def _open(self) -> None:
        self.mode, self.pending = self.NAME, ""

    def _literals(self) -> list[str]:
        """The texts the current stretch must be one of (`pending` holds what matched of them)."""
        if self.mode == self.GAP:
            return [ARG_VALUE]
        if self.mode == self.KEY:  # after <arg_key>: an unseen property (any key for tools without them)
            names = self.params.get(self.function) or ()
            return [p + ARG_KEY_END for p in names if p not in self.seen]
        names = self.params.get(self.function) or ()
        more = [ARG_KEY] if not names or any(p not in self.seen for p in names) else []
        return more + ([CALL_CLOSE] if self._may_close() else [])

    def _call_char(self, c: str) -> bool:
        if self.mode == self.NAME:
            return self._name_char(c)
        if self.mode == self.VALUE:
            return self._value_char(c, ARG_VALUE_END)
        if self.mode == self.KEY and not self.params.get(self.function):  # any key text up to </arg_key>
            self.pending += c
            if self.pending.endswith(ARG_KEY_END):
                self._key_done(self.pending[:-len(ARG_KEY_END)])
                return bool(self.seen)
            return "<" not in self.pending or ARG_KEY_END.startswith(self.pending[self.pending.index("<"):])
        if not self.pending and self.mode != self.KEY and (space := glue_space(self, c)) is not None:
            return space
        pending = self._literal(c, self._literals())
        if pending is None:
            return False
        if pending:
            if pending == CALL_CLOSE:
                self._closed()
            elif pending == ARG_KEY:
                self.mode = self.KEY
            elif pending == ARG_VALUE:
                self.mode, self.tail = self.VALUE, ""
            else:
                self._key_done(pending[:-len(ARG_KEY_END)])
        return True

    def _name_char(self, c: str) -> bool:
        names = list(self.params)
        if (self.pending in names or not names and self.pending) and (c in WHITESPACE or c == "<"):  # body next
            self.function, self.seen, self.mode, self.pending = self.pending, frozenset(), self.BODY, ""
            return self._call_char(c)
        pending = self.pending + c
        if names and not any(n.startswith(pending) for n in names):
            return False
        self.pending = pending
        return True

    def _key_done(self, key: str) -> None:
        self.mode, self.pending = self.GAP, ""
        self.value = self._typed_value(key, ARG_VALUE_END, pad=False)

