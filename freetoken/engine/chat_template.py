"""Chat templates: Jinja source from a model's files, rendered in a sandbox.

Owns compiling and rendering the Jinja chat templates that ship in `tokenizer_config.json`,
`chat_template.jinja` or a GGUF's `tokenizer.chat_template`, with the globals and filters HF templates rely
on (`raise_exception`, `strftime_now`, HF's `tojson`, the `{% generation %}` tag, `loopcontrols`).

Invariants:
- Template source is untrusted: it is compiled only in an `ImmutableSandboxedEnvironment`, and any access the
  sandbox refuses (dunder attributes, unsafe or mutating methods) raises at once instead of rendering as an
  empty string. `*` and `**` are capped so one expression cannot exhaust memory; `range` is capped by the
  sandbox. CPU time is not bounded here: nested loops or `~` doubling in a loop can still run long.
- A template is compiled once, in `ChatTemplate.__init__`; `render` never recompiles.
- Every failure, at compile or render time, surfaces as a one-line `ChatTemplateError`; no Jinja or Python
  exception escapes `render`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from freetoken.errors import ChatTemplateError

# Rendered prompts are at most a few MB, and no template needs integers of more than a few thousand bits;
# anything larger from one `*` or `**` is an attack or a bug, and would stall the engine thread.
_MAX_REPEAT_ITEMS = 1 << 22
_MAX_INT_BITS = 1 << 16


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: HF marks assistant spans with it for training masks.

    Rendering only needs the body, so the tag is a transparent block here.
    """

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, but refusals raise instead of yielding a silent Undefined."""

    intercepted_binops = frozenset({"*", "**"})

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            _check_product(left, right)
            return left * right
        _check_power(left, right)
        return left**right


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_product(left: Any, right: Any) -> None:
    for seq, count in ((left, right), (right, left)):
        if isinstance(seq, (str, list, tuple)) and _is_int(count) and len(seq) * count > _MAX_REPEAT_ITEMS:
            raise SecurityError(f"repeating a {type(seq).__name__} {count} times is too large")
    if _is_int(left) and _is_int(right) and left.bit_length() + right.bit_length() > _MAX_INT_BITS:
        raise SecurityError("integer product is too large")


def _check_power(base: Any, exponent: Any) -> None:
    if _is_int(base) and _is_int(exponent) and abs(base) > 1 and base.bit_length() * exponent > _MAX_INT_BITS:
        raise SecurityError("integer power is too large")


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template raised an error: {_one_line(message)}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: Sequence[str] | None = None,
    sort_keys: bool = False,
) -> str:
    # HF's tojson, not Jinja's: no HTML escaping and insertion order kept, so tool schemas render verbatim.
    seps = tuple(separators) if separators is not None else None
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=seps, sort_keys=sort_keys)


def _environment() -> _StrictSandbox:
    env = _StrictSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationTag],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


class ChatTemplate:
    """One compiled chat template; `render` turns a conversation into the prompt text."""

    __slots__ = ("source", "bos_token", "eos_token", "_template")

    def __init__(self, source: str, *, bos_token: str | None = None, eos_token: str | None = None) -> None:
        if not isinstance(source, str) or not source.strip():
            raise ChatTemplateError("chat template is empty: pass a Jinja template string, or use --raw")
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(
                f"chat template syntax error at line {exc.lineno}: {_one_line(exc.message or '')}"
            ) from None
        except Exception as exc:  # a hostile template can make the compiler fail in other ways
            raise ChatTemplateError(f"chat template failed to compile: {_one_line(exc)}") from None

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = None,
        **extra: Any,
    ) -> str:
        """The prompt for `messages`. `enable_thinking` reaches the template only when set, so templates
        that test `enable_thinking is defined` keep their own default."""
        variables: dict[str, Any] = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            **extra,
            "messages": messages,
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
        }
        if enable_thinking is not None:
            variables["enable_thinking"] = enable_thinking
        try:
            return self._template.render(**variables)
        except ChatTemplateError:
            raise
        except SecurityError as exc:
            raise ChatTemplateError(f"chat template tried to escape its sandbox: {_one_line(exc)}") from None
        except jinja2.TemplateError as exc:
            lineno = getattr(exc, "lineno", None)
            where = f" at line {lineno}" if lineno else ""
            raise ChatTemplateError(f"chat template failed to render{where}: {_one_line(exc)}") from None
        except Exception as exc:  # untrusted code: whatever it raises is the template's fault
            raise ChatTemplateError(f"chat template failed to render: {type(exc).__name__}: {_one_line(exc)}") from None

    def __repr__(self) -> str:
        return f"ChatTemplate({len(self.source)} chars)"
