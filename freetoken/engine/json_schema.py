"""JSON-schema-constrained prefixes: `SchemaPrefix` is `JsonPrefix` that also refuses the first character no
value valid under a schema could continue with (`response_format: json_schema`).

What is enforced: `type` (one or a list), `properties` with `required` and `additionalProperties` (false: only the
listed keys; a schema: the other keys' values), `items`, scalar `enum` / `const`, integers without fraction or
exponent, local `$ref`s (`#`, `#/$defs/…`, `#/definitions/…`, recursive ones too). Anything else (`anyOf`, `pattern`,
`minLength`, numeric bounds, …) leaves that part of the value free JSON: the constraint never refuses a valid
value, it only narrows what it understands. Keys are read in their raw JSON spelling (a key written with escapes
for plain characters is refused where the schema lists keys). Pure Python, no torch.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from freetoken.engine.json_prefix import (
    AFTER_MEMBER,
    DIGITS,
    FIRST_KEY,
    KEY,
    LITERAL,
    NUMBER,
    STRING,
    JsonPrefix,
)

_TYPE_OF_START = {"{": "object", "[": "array", '"': "string", "t": "boolean", "f": "boolean", "n": "null"}
_SCALARS = (str, int, float, bool, type(None))


class SchemaError(ValueError):
    """A schema this module cannot read (not an object, a `$ref` it cannot resolve)."""


class Node:
    """One schema, compiled: None fields are unconstrained. Mutable only while compiling (recursive refs)."""

    __slots__ = ("types", "properties", "required", "extra", "closed", "items", "enum")

    def __init__(self) -> None:
        self.types: frozenset[str] | None = None
        self.properties: dict[str, Node] = {}
        self.required: frozenset[str] = frozenset()
        self.extra: Node | None = None  # schema of keys not in `properties` (None: any value)
        self.closed = False  # additionalProperties: false
        self.items: Node | None = None
        self.enum: frozenset[str] | None = None  # allowed values as compact JSON texts

    def allows(self, kind: str) -> bool:
        return self.types is None or kind in self.types or (kind == "integer" and "number" in self.types)

    def keys_left(self, seen: set[str]) -> list[str]:
        return [k for k in self.properties if k not in seen]


ANY = Node()


@functools.lru_cache(maxsize=64)
def compile_schema(text: str) -> Node:
    """The compiled form of a schema given as JSON text (cached: one compile per distinct schema)."""
    schema = json.loads(text)
    if not isinstance(schema, dict):
        raise SchemaError("a JSON schema must be an object")
    return _Compiler(schema).node(schema)


class _Compiler:
    def __init__(self, root: dict) -> None:
        self.root, self.refs = root, {}

    def node(self, schema: Any) -> Node:
        if schema is True or not isinstance(schema, dict):
            return ANY
        if "$ref" in schema:
            return self._ref(schema["$ref"])
        node = Node()
        kinds = schema.get("type")
        if isinstance(kinds, str):
            kinds = [kinds]
        if isinstance(kinds, list) and all(isinstance(k, str) for k in kinds):
            node.types = frozenset("number" if k == "number" else k for k in kinds)
        values = [schema["const"]] if "const" in schema else schema.get("enum")
        if isinstance(values, list) and values and all(isinstance(v, _SCALARS) for v in values):
            node.enum = frozenset(_compact(v) for v in values)
            enum_types = {_kind(v) for v in values}
            node.types = frozenset(enum_types if node.types is None else node.types & (enum_types | {"number"}))
        props = schema.get("properties")
        if isinstance(props, dict):
            node.properties = {k: self.node(v) for k, v in props.items()}
        required = schema.get("required")
        if isinstance(required, list):
            node.required = frozenset(r for r in required if isinstance(r, str))
        extra = schema.get("additionalProperties", True)
        if extra is False:
            node.closed = True
            node.required = node.required & set(node.properties)  # unsatisfiable otherwise: keep it reachable
        elif isinstance(extra, dict):
            node.extra = self.node(extra)
        if "items" in schema:
            node.items = self.node(schema["items"])
        if any(k in schema for k in ("anyOf", "oneOf", "allOf", "not", "if")):
            node.types, node.enum = None, None  # combinators: this value stays free (never refuse a valid one)
            node.properties, node.required, node.closed, node.items = {}, frozenset(), False, None
        return node

    def _ref(self, ref: Any) -> Node:
        if ref in self.refs:
            return self.refs[ref]
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise SchemaError(f"only local $refs (#/...) are supported, got {ref!r}")
        target: Any = self.root
        for part in ref[2:].split("/") if ref != "#" else ():
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                raise SchemaError(f"$ref {ref!r} points at nothing in the schema")
            target = target[part]
        shell = self.refs[ref] = Node()  # a recursive ref meets this node while its target compiles
        compiled = self.node(target)
        for slot in Node.__slots__:
            setattr(shell, slot, getattr(compiled, slot))
        return shell


def call_object(name: str, arguments: Node, key: str = "arguments") -> Node:
    """The schema of a JSON call object: {"name": `name`, `key`: <valid under `arguments`>}, nothing else."""
    name_node, node = Node(), Node()
    name_node.types, name_node.enum = frozenset({"string"}), frozenset({_compact(name)})
    node.types, node.closed = frozenset({"object"}), True
    node.properties = {"name": name_node, key: arguments}
    node.required = frozenset(node.properties)
    return node


def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, str):
        return "string"
    return "integer" if isinstance(value, int) else "number"


class SchemaPrefix(JsonPrefix):
    """A JSON object prefix that is also a prefix of a value valid under `root`. Beside `JsonPrefix`'s stack it
    keeps, per open container, its schema and (objects) the keys seen, the key being read and the schema of the
    value after it; `scalar` is the text of the string/number/literal being read when an enum or the integer
    type constrains it."""

    __slots__ = ("frames", "expect", "scalar", "scalar_node")

    def __init__(self, root: Node, object_root: bool = True) -> None:
        super().__init__(object_root)
        self.frames: list[list] = []  # per open container: [node, seen keys (set), key text or None]
        self.expect = root  # the schema of the next value to start
        self.scalar: str | None = None
        self.scalar_node: Node | None = None

    def copy(self) -> SchemaPrefix:
        other = SchemaPrefix.__new__(SchemaPrefix)
        other.stack, other.state, other.key = list(self.stack), self.state, self.key
        other.escape, other.unicode, other.number, other.literal = self.escape, self.unicode, self.number, self.literal
        other.object_root, other.spaces = self.object_root, self.spaces
        other.frames = [[node, set(seen), key] for node, seen, key in self.frames]
        other.expect, other.scalar, other.scalar_node = self.expect, self.scalar, self.scalar_node
        return other

    def _char(self, c: str) -> bool:
        state = self.state
        if state == STRING and self.key:
            return self._key_char(c)
        if state in (STRING, NUMBER, LITERAL) and self.scalar is not None:
            return self._scalar_char(c)
        if self.stack and self.stack[-1] == "{":
            node, seen, _ = self.frames[-1]
            if c == "}" and state in (FIRST_KEY, AFTER_MEMBER) and not node.required <= seen:
                return False  # a required key is still missing
            if c == "," and state == AFTER_MEMBER and node.closed and not node.keys_left(seen):
                return False  # no key is left to come
            if c == '"' and state in (FIRST_KEY, KEY):
                if node.closed and not node.keys_left(seen):
                    return False
                self.frames[-1][2] = ""  # a key starts
        return super()._char(c)

    def _key_char(self, c: str) -> bool:
        frame = self.frames[-1]
        node, seen, text = frame
        if not super()._char(c):
            return False
        if self.key:  # still inside the key
            frame[2] = text = text + c
            if node.closed and not any(_raw(k).startswith(text) for k in node.keys_left(seen)):
                return False
            return True
        try:  # the key closed
            key = json.loads('"' + text + '"')
        except ValueError:
            return False
        if key in seen or (node.closed and key not in node.properties):
            return False
        seen.add(key)
        frame[2] = None
        self.expect = node.properties.get(key) or node.extra or ANY
        return True

    def _scalar_char(self, c: str) -> bool:
        node = self.scalar_node
        inside = self.state != NUMBER or c in DIGITS or c in "+-.eE"
        if not super()._char(c):
            return False
        if self.state in (STRING, NUMBER, LITERAL) and inside:
            self.scalar += c
            return self._scalar_ok(node, done=False)
        # the scalar ended (a closing quote or literal's last letter belongs to it; a number's end does not)
        text = self.scalar + (c if inside else "")
        self.scalar = None
        return self._scalar_ok(node, done=True, text=text)

    def _scalar_ok(self, node: Node, done: bool, text: str | None = None) -> bool:
        text = self.scalar if text is None else text
        if node.types is not None and "number" not in node.types and "integer" in node.types and \
                text[:1] in "-" + DIGITS and any(ch in text for ch in ".eE"):
            return False
        if node.enum is not None:
            return text in node.enum if done else any(e.startswith(text) for e in node.enum)
        return True

    def _value_start(self, c: str) -> bool:
        node = self.expect
        kind = "integer" if c == "-" or c in DIGITS else _TYPE_OF_START.get(c)
        if kind is None or not node.allows(kind):
            return False
        if not super()._value_start(c):
            return False
        if c in "{[":
            self.frames.append([node, set(), None])
            self.expect = (node.items or ANY) if c == "[" else ANY
            return True
        if node.enum is not None or (kind == "integer" and node.types is not None and "number" not in node.types):
            self.scalar, self.scalar_node = c, node  # (every scalar's first character leaves it open)
            return self._scalar_ok(node, done=False)
        return True

    def _close(self, bracket: str) -> bool:
        if not super()._close(bracket):
            return False
        self.frames.pop()
        if self.frames and self.stack[-1] == "[":
            self.expect = self.frames[-1][0].items or ANY
        return True

    def _value_done(self) -> None:
        super()._value_done()
        if self.frames and self.stack and self.stack[-1] == "[":
            self.expect = self.frames[-1][0].items or ANY


def _raw(key: str) -> str:
    """A key as the model writes it between the quotes (JSON's own escapes, no ASCII escaping)."""
    return json.dumps(key, ensure_ascii=False)[1:-1]
