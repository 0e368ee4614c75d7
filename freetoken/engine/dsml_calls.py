"""DeepSeek-V4's DSML tool calls as a constrained language (V3.2's too, whose block is `function_calls`):

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="P" string="true">text</｜DSML｜parameter>
    <｜DSML｜parameter name="Q" string="false">JSON</｜DSML｜parameter>
    </｜DSML｜invoke>
    …more invokes…
    </｜DSML｜tool_calls>

and then the end of the reply (the turn ends after its calls). NAME is an offered tool; P among its schema's
properties, each at most once, the required ones before `</｜DSML｜invoke>`. The model says per parameter whether
its value is a string: the schema decides where it can (`string="true"` for string-typed properties, whose value
is free text or one of a string enum's values; `string="false"` and a JSON value under the schema for the
others; either for untyped ones). The shared tagged-parameter machinery is tag_calls.py's.
"""

from __future__ import annotations

from freetoken.engine.call_languages import (
    DSML_INVOKE,
    DSML_INVOKE_END,
    DSML_OPEN,
    DSML_PARAMETER,
    DSML_PARAMETER_END,
    DSML_V32_OPEN,
    EndsAfterTheCalls,
    glue_space,
)
from freetoken.engine.json_prefix import JsonPrefix
from freetoken.engine.tag_calls import TaggedParameterCalls, XmlValue

_STRING, _JSON = ' string="true">', ' string="false">'


class DsmlCalls(EndsAfterTheCalls, TaggedParameterCalls):
    FREE, INVOKE, BODY, NAME, KIND, VALUE, AFTER, DONE = range(8)

    def __init__(self, opened: str | None = None, tools: tuple[tuple[str, tuple[str, ...]], ...] = (),
                 schemas: tuple[tuple[str, str], ...] = (), function_calls: bool = False) -> None:
        """`function_calls`: V3.2's block name instead of V4's `tool_calls`."""
        self.OPEN = DSML_V32_OPEN if function_calls else DSML_OPEN
        self.close = "</" + self.OPEN[1:]
        self.param_name = ""  # an undeclared parameter's name, while its kind is read
        super().__init__(opened, tools, schemas)

    def copy(self) -> DsmlCalls:
        other = super().copy()
        other.OPEN, other.close, other.param_name = self.OPEN, self.close, self.param_name
        return other

    def _open(self) -> None:
        self.mode, self.pending = self.INVOKE, ""

    def _kinds(self, name: str) -> tuple[str, ...]:
        """How parameter `name`'s value may be written: as a string, as JSON, or either (untyped)."""
        root = self.schemas.get(self.function)
        node = root.properties.get(name) if root is not None else None
        if node is None or node.types is None:
            return (_STRING, _JSON)
        return (_STRING,) if "string" in node.types else (_JSON,)

    def _literals(self) -> list[str]:
        """The texts the current stretch must be one of (`pending` holds what matched of them)."""
        invokes = [f'{DSML_INVOKE}"{name}">' for name in self.params]
        if self.mode == self.INVOKE:
            return invokes
        if self.mode == self.AFTER:
            return [self.close] if self.single else invokes + [self.close]
        if self.mode == self.KIND:
            return [_STRING, _JSON]
        names = self.params.get(self.function) or ()
        close = [DSML_INVOKE_END] if self._may_close() else []
        if not names:  # a tool that declares no parameters: any names
            return [f'{DSML_PARAMETER}"'] + close
        return [f'{DSML_PARAMETER}"{p}"{kind}' for p in names if p not in self.seen for kind in self._kinds(p)] + \
            close

    def _call_char(self, c: str) -> bool:
        if self.mode == self.DONE:
            return glue_space(self, c) is True
        if self.mode == self.VALUE:
            return self._value_char(c, DSML_PARAMETER_END)
        if self.mode == self.NAME:  # an undeclared parameter's name, up to its closing quote
            if c == '"' and self.pending:
                self.mode, self.param_name, self.pending = self.KIND, self.pending, ""
                return True
            self.pending += c
            return c not in '\n"<>'
        if not self.pending and self.mode != self.KIND and (space := glue_space(self, c)) is not None:
            return space
        pending = self._literal(c, self._literals())
        if pending is None:
            return False
        if pending:
            if pending.startswith(DSML_INVOKE):
                self.mode, self.function, self.seen = self.BODY, pending[len(DSML_INVOKE) + 1:-2], frozenset()
            elif pending == DSML_INVOKE_END:
                self.mode = self.AFTER
            elif pending == self.close:
                self.mode = self.DONE
            elif pending == f'{DSML_PARAMETER}"':
                self.mode = self.NAME
            elif self.mode == self.KIND:
                self._start_value(self.param_name, pending == _STRING)
            else:
                name, kind = pending[len(DSML_PARAMETER) + 1:].split('"', 1)
                self._start_value(name, kind == _STRING)
        return True

    def _start_value(self, name: str, string: bool) -> None:
        self.mode, self.tail = self.VALUE, ""
        typed = self._typed_value(name, DSML_PARAMETER_END, pad=False)
        # a string is free text (or one of an enum's values: `typed`); an untyped JSON value is any JSON
        self.value = typed if typed is not None or string else XmlValue(JsonPrefix(), close=DSML_PARAMETER_END,
                                                                           pad=False)
