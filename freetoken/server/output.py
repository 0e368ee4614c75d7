"""Generated text → answer text, reasoning and tool calls, incrementally, as the tokens stream in.

Models mark reasoning with `<think>…</think>` and tool calls with `<tool_call>…</tool_call>` (Hermes / Qwen: a
JSON object `{"name", "arguments"}`; Qwen3-Coder: `<function=NAME><parameter=P>value</parameter></function>`).
Mistral opens its calls with `[TOOL_CALLS]`: a JSON list of calls (older tokenizers) or `NAME[ARGS]{...}` per call
(newer ones, with `[CALL_ID]id` in between for some); Llama 3.1 may open with `<|python_tag|>`, DeepSeek with
`<｜tool▁calls▁begin｜>` (V3/R1/V3.1) or a DSML block (`<｜DSML｜tool_calls>`: V4; V3.2's `function_calls`); all
are held and judged whole at the end. Llama 3 also answers a call with bare JSON (`{"name", "parameters"}`): with tools
offered, an answer that opens with `{` or `[` is held and judged whole at the end too. `OutputParser.push` takes
each text delta and returns the parts it completes; a tag cut across two deltas is held back until it can be told
apart from text. A tool call is returned whole once its closing tag arrives. With `stream_calls`, a Hermes or a
Qwen3-Coder call is also streamed as it forms (call_streams.py): a `call_start` part once its name is known, then
`call_delta` parts with its arguments' JSON text, then the whole `tool_call` (marked `streamed`, its `text` the
arguments streamed). Agents show a call's input as it is typed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from freetoken.engine.call_languages import (
    DEEPSEEK_CALL,
    DEEPSEEK_CALL_END,
    DEEPSEEK_CLOSE,
    DEEPSEEK_OPEN,
    DEEPSEEK_SEP,
    DSML,
    DSML_INVOKE,
    DSML_INVOKE_END,
    DSML_OPEN,
    DSML_PARAMETER,
    DSML_PARAMETER_END,
    DSML_V32_OPEN,
)
from freetoken.engine.json_schema import compile_schema
from freetoken.server.call_streams import StreamedCall, open_call, tagged_value

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_CALLS, MISTRAL_ARGS, MISTRAL_CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
PYTHON_TAG = "<|python_tag|>"
DEEPSEEK_CALLS, DEEPSEEK_CALLS_END = DEEPSEEK_OPEN, DEEPSEEK_CLOSE
DSML_CALLS = (DSML_OPEN, DSML_V32_OPEN, *(o.replace(DSML, "|DSML|") for o in (DSML_OPEN, DSML_V32_OPEN)))
# everything after these is calls, parsed whole
_HELD_TO_THE_END = (MISTRAL_CALLS, PYTHON_TAG, DEEPSEEK_CALLS, *DSML_CALLS)


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: dict = field(default_factory=dict)

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass(slots=True)
class Part:
    kind: str  # "text", "reasoning" or "tool_call"; while a call streams, "call_start" and "call_delta" first
    text: str = ""
    call: ToolCall | None = None
    streamed: bool = False  # a tool_call whose call_start and call_delta parts came before it


def text_parameters(schemas: tuple[tuple[str, str], ...]) -> dict[str, frozenset[str]]:
    """Per tool (name, parameters schema as JSON), the parameters its schema types as strings: an XML call's
    value for one of them is the text itself, even where it reads as JSON (`"42"`, not 42)."""
    out = {}
    for name, text in schemas:
        properties = compile_schema(text).properties
        out[name] = frozenset(p for p, node in properties.items() if node.types is not None and "string" in node.types)
    return out


class OutputParser:
    def __init__(self, *, in_reasoning: bool = False, tools: bool = True, prefix: str = "",
                 text_params: dict[str, frozenset[str]] | None = None, stream_calls: bool = False):
        """`in_reasoning`: the prompt already opened a reasoning block (templates that end with `<think>`).
        `prefix`: text the prompt wrote on the model's behalf (a forced tool call's opening), read first.
        `text_params`: per tool, the parameters whose XML values stay text (`text_parameters`).
        `stream_calls`: Hermes and Qwen3-Coder calls also come as call_start / call_delta parts while they form
        (for streamed replies; call_streams.py)."""
        self.state = "reasoning" if in_reasoning else "text"
        self.tools, self.text_params, self.stream_calls = tools, text_params or {}, stream_calls
        self._call: StreamedCall | None = None  # the call streaming now
        self._call_whole = False  # the call in the buffer is not one to stream (another format, or not yet)
        self.reasoning_tokens = 0  # generated tokens that went into reasoning (usage reports them)
        self.buffer = ""
        self._after_reasoning = False
        self._answered = False  # answer text has been emitted (so it is not a bare JSON tool call)
        self._pending: list[Part] = []
        self._pending = self.push(prefix) if prefix else []

    def push(self, text: str, tokens: int = 0) -> list[Part]:
        """The parts `text` completes; `tokens`: how many generated tokens it came from (counted into
        `reasoning_tokens` while a reasoning block is open)."""
        if self.state == "reasoning":
            self.reasoning_tokens += tokens
        self.buffer += text
        parts, self._pending = self._pending, []
        while True:
            if self.state in ("json", "calls"):
                return parts  # a bare JSON answer or marked calls: judged whole in finish()
            if self.state == "text" and self.tools and not self._answered:
                head = self.buffer.lstrip()
                if not head:
                    return parts  # only whitespace so far: wait to see how the answer opens
                if head[0] in "{[" and not head.startswith(MISTRAL_CALLS):
                    if MISTRAL_CALLS.startswith(head):
                        return parts  # "[" or "[TOOL_…" so far: a marker or a JSON list, not known yet
                    self.state = "json"
                    return parts
            if self.state == "tool":
                end = self.buffer.find(TOOL_CLOSE)
                if self.stream_calls:
                    body = self.buffer[:end] if end >= 0 else \
                        self.buffer[:len(self.buffer) - partial_tag(self.buffer, [TOOL_CLOSE])]
                    self._stream_call(parts, body)
                if end < 0:
                    return parts
                parts.append(self._tool_part(self.buffer[:end]))
                self.buffer, self.state = self.buffer[end + len(TOOL_CLOSE):], "text"
                continue
            if self._after_reasoning:  # the newlines between a reasoning block and the answer belong to neither
                self.buffer = self.buffer.lstrip("\n")
                self._after_reasoning = not self.buffer
            tags = [THINK_CLOSE] if self.state == "reasoning" else \
                [THINK_OPEN] + ([TOOL_OPEN, *_HELD_TO_THE_END] if self.tools else [])
            found = [(self.buffer.find(t), t) for t in tags if self.buffer.find(t) >= 0]
            if not found:
                keep = partial_tag(self.buffer, tags)
                emit, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                self._emit_text(parts, emit)
                return parts
            at, tag = min(found)
            self._emit_text(parts, self.buffer[:at])
            if tag in _HELD_TO_THE_END:  # keep the marker: the calls after it are split on it
                self.buffer, self.state = self.buffer[at:], "calls"
                continue
            self.buffer = self.buffer[at + len(tag):]
            self.state = {THINK_OPEN: "reasoning", THINK_CLOSE: "text", TOOL_OPEN: "tool"}[tag]
            self._after_reasoning = tag == THINK_CLOSE

    def _emit_text(self, parts: list[Part], text: str) -> None:
        if self.state == "text" and text.strip():
            self._answered = True
        _append(parts, self.state, text)

    def finish(self) -> list[Part]:
        """The rest at the end of generation: an unclosed tool call is parsed if it is complete JSON."""
        rest, self.buffer = self.buffer, ""
        if self._after_reasoning:
            rest = rest.lstrip("\n")
        if self.state in ("json", "calls"):
            calls = parse_bare_calls(rest) if self.state == "json" else parse_marked_calls(rest)
            return [Part("tool_call", call=c) for c in calls] if calls else _append([], "text", rest)
        if self.state == "tool":
            if self._call is not None:
                parts: list[Part] = []
                self._stream_call(parts, rest)
                return [*parts, self._tool_part(rest)]
            call = parse_tool_call(rest, self.text_params)
            return [Part("tool_call", call=call)] if call else _append([], "text", TOOL_OPEN + rest)
        return _append([], self.state, rest)

    def _tool_part(self, body: str) -> Part:
        streaming, self._call, self._call_whole = self._call, None, False
        call = parse_tool_call(body, self.text_params)
        if streaming is not None:  # its start and arguments went out already: it stays a call
            return Part("tool_call", text=streaming.text, streamed=True,
                        call=call if call is not None and call.name == streaming.name else ToolCall(streaming.name))
        return Part("tool_call", call=call) if call else Part("text", TOOL_OPEN + body + TOOL_CLOSE)

    def _stream_call(self, parts: list[Part], body: str) -> None:
        """The start and the new argument text of the call forming in `body` (the text after its tag)."""
        if self._call is None:
            if self._call_whole:
                return
            opened = open_call(body, self.text_params)
            if not isinstance(opened, StreamedCall):
                self._call_whole = opened
                return
            self._call = opened
            parts.append(Part("call_start", call=ToolCall(opened.name)))
        if text := self._call.advance(body):
            parts.append(Part("call_delta", text))


def parse_tool_call(body: str, text_params: dict[str, frozenset[str]] | None = None) -> ToolCall | None:
    """One tool call's body (between the tags) in any supported format, or None if it is not one: a JSON call
object (Hermes/Qwen), Qwen3-Coder XML (`<function=…>`), or GLM-4.5's `NAME` then `<arg_key>`/`<arg_value>`
pairs."""
    body = body.strip()
    if body.startswith("<function="):
        return _parse_xml_call(body, text_params or {})
    if not body.startswith("{"):
        return _parse_glm_call(body, text_params or {})
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    return _call_of(obj)


def parse_bare_calls(text: str) -> list[ToolCall]:
    """A whole answer that is one call object or a list of them (Llama 3, Mistral); [] if it is anything else."""
    try:
        obj = json.loads(text.strip())
    except json.JSONDecodeError:
        return []
    calls = [_call_of(o) for o in (obj if isinstance(obj, list) else [obj])]
    return calls if calls and all(calls) else []


def parse_marked_calls(text: str) -> list[ToolCall]:
    """Calls after Mistral's `[TOOL_CALLS]` (a JSON list, or `NAME[ARGS]{...}` / `NAME[CALL_ID]id[ARGS]{...}` per
    marker), Llama's `<|python_tag|>` (a JSON call) or DeepSeek's `<｜tool▁calls▁begin｜>`; [] unless every part
    is a call."""
    if text.lstrip().startswith(DEEPSEEK_CALLS):
        return parse_deepseek_calls(text)
    if text.lstrip().startswith(DSML_CALLS):
        return parse_dsml_calls(text)
    calls: list[ToolCall] = []
    for chunk in re.split(r"\[TOOL_CALLS\]|<\|python_tag\|>", text):
        chunk = chunk.strip()
        if not chunk:
            continue
        if MISTRAL_ARGS not in chunk:
            found = parse_bare_calls(chunk)
            if not found:
                return []
            calls += found
            continue
        head, args = chunk.split(MISTRAL_ARGS, 1)
        name = head.split(MISTRAL_CALL_ID, 1)[0].strip()
        try:
            value = json.loads(args)
        except json.JSONDecodeError:
            return []
        if not name or not isinstance(value, dict):
            return []
        calls.append(ToolCall(name, value))
    return calls


_DEEPSEEK_CALL = re.compile(re.escape(DEEPSEEK_CALL) + r"(.*?)" + re.escape(DEEPSEEK_CALL_END), re.S)
_FENCED_JSON = re.compile(r"\s*```(?:json)?\s*(.*?)\s*```\s*$", re.S)


def parse_deepseek_calls(text: str) -> list[ToolCall]:
    """DeepSeek's calls: `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{args}<｜tool▁call▁end｜>` (V3.1) or
    `…begin｜>function<｜tool▁sep｜>NAME` then the arguments in a ```json fence (V3, R1), inside
    `<｜tool▁calls▁begin｜>` … `<｜tool▁calls▁end｜>`; [] unless every call parses."""
    body = text.strip().removeprefix(DEEPSEEK_CALLS)
    body, _, after = body.partition(DEEPSEEK_CALLS_END)
    found = _DEEPSEEK_CALL.findall(body)
    if not found or after.strip() or _DEEPSEEK_CALL.sub("", body).strip():
        return []
    calls = []
    for call in found:
        head, sep, args = call.partition(DEEPSEEK_SEP)
        if not sep:
            return []
        name = head.strip()
        if name == "function" and "\n" in args:  # V3: the name on the separator's line, fenced arguments
            name, args = args.split("\n", 1)
            fenced = _FENCED_JSON.match(args)
            args = fenced.group(1) if fenced else args
        try:
            value = json.loads(args)
        except json.JSONDecodeError:
            return []
        if not name.strip() or not isinstance(value, dict):
            return []
        calls.append(ToolCall(name.strip(), value))
    return calls


_DSML_INVOKE = re.compile(re.escape(DSML_INVOKE) + r'"([^"]+)">(.*?)' + re.escape(DSML_INVOKE_END), re.S)
_DSML_PARAMETER = re.compile(re.escape(DSML_PARAMETER) + r'"([^"]+)" string="(true|false)">(.*?)'
                             + re.escape(DSML_PARAMETER_END), re.S)


def parse_dsml_calls(text: str) -> list[ToolCall]:
    """DeepSeek-V4's calls (V3.2's too, in `function_calls`): `<｜DSML｜tool_calls>`, then per call
    `<｜DSML｜invoke name="NAME">` with `<｜DSML｜parameter name="P" string="true|false">value</｜DSML｜parameter>`
    per argument (a string as written, anything else as JSON), `</｜DSML｜invoke>`, and the block's close (the
    reply may end before it). ASCII bars are read as the fullwidth ones. [] unless every call parses."""
    body = text.strip().replace("|DSML|", DSML)
    opener = DSML_OPEN if body.startswith(DSML_OPEN) else DSML_V32_OPEN
    body, _, after = body.removeprefix(opener).partition("</" + opener[1:])
    found = _DSML_INVOKE.findall(body)
    if not found or after.strip() or _DSML_INVOKE.sub("", body).strip():
        return []
    calls = []
    for name, inner in found:
        parameters = _DSML_PARAMETER.findall(inner)
        if _DSML_PARAMETER.sub("", inner).strip() or not name.strip():
            return []
        arguments = {}
        for key, is_string, value in parameters:
            try:
                arguments[key] = value if is_string == "true" else json.loads(value)
            except json.JSONDecodeError:
                return []
        calls.append(ToolCall(name.strip(), arguments))
    return calls


_TOOL_NAME = re.compile(r"[\w.:/-]+")
_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


def _parse_glm_call(body: str, text_params: dict[str, frozenset[str]]) -> ToolCall | None:
    """GLM-4.5: the function name, then `<arg_key>k</arg_key><arg_value>v</arg_value>` pairs. The template
    writes strings as they are and other values as JSON, so values read as JSON unless the tool types them as
    strings (or they are not JSON)."""
    name, _, rest = body.partition("<arg_key>")
    name = name.strip()
    if not _TOOL_NAME.fullmatch(name):
        return None  # not a call: prose, or a malformed JSON one
    rest = "<arg_key>" + rest if rest else ""
    pairs = _GLM_ARG.findall(rest)
    if _GLM_ARG.sub("", rest).strip():
        return None  # something besides argument pairs
    return ToolCall(name, _tagged_arguments(pairs, text_params.get(name, frozenset())))


def _call_of(obj) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return ToolCall(obj["name"], args) if isinstance(args, dict) else None


_XML_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


def _parse_xml_call(body: str, text_params: dict[str, frozenset[str]]) -> ToolCall | None:
    """Values are JSON where they read as JSON (numbers, booleans, lists, objects), else text; parameters the
    tool's schema types as strings are always text."""
    m = _XML_FUNCTION.search(body)
    if not m:
        return None
    function = m.group(1).strip()
    texts = text_params.get(function, frozenset())
    return ToolCall(function, _tagged_arguments(_XML_PARAMETER.findall(m.group(2)), texts))


def _tagged_arguments(pairs: list[tuple[str, str]], texts: frozenset[str]) -> dict:
    """(name, value text) pairs of a tagged call: values are JSON where they read as JSON, else text; `texts`
    (the parameters the schema types as strings) are always text."""
    return {name.strip(): tagged_value(value, name.strip() in texts) for name, value in pairs}


def partial_tag(text: str, tags: list[str]) -> int:
    """Length of the longest suffix of `text` that could be the start of one of `tags`."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


def _append(parts: list[Part], state: str, text: str) -> list[Part]:
    if text:
        parts.append(Part("reasoning" if state == "reasoning" else "text", text))
    return parts
