"""Tool-call languages for constrained sampling (json_sampler.py): free text in which each call must be a call
of an offered tool, written in the model's own format, its arguments valid under the tool's parameters schema
where the format writes them as JSON (json_schema.py). Nothing outside a call is touched; a forced call
(`tool_choice`) starts inside one (`opened`: what the prompt already wrote of it).

- `HermesCalls` (Hermes/Qwen): `<tool_call>` `{"name": "<tool>", "arguments": {…}}` `</tool_call>`.
- `QwenXmlCalls` (Qwen3-Coder) and `GlmCalls` (GLM-4.5), whose parameters are tagged rather than JSON, live in
  tag_calls.py.
- `MistralCalls`: `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}` calls (older tokenizers) or, per
  marker, `NAME[ARGS]{…}` (newer ones; `NAME[CALL_ID]id[ARGS]{…}` too).
- `Llama3Calls`: a reply that opens with `{` (or `<|python_tag|>`) is one `{"name", "parameters"}` call and then
  the end; any other reply is free text.
- `DeepseekCalls` (DeepSeek V3/R1/V3.1): `<｜tool▁calls▁begin｜>` then `NAME<｜tool▁sep｜>{…}` calls.
- `HarmonyCalls` (gpt-oss): a message header `to=functions.NAME … <|message|>`, then `{…}` and the reply's end.
- `DsmlCalls` (DeepSeek-V4, V3.2), whose parameters are tagged too, lives in dsml_calls.py.
Calls are recognised by their head spelled as the chat templates write it (`{"name": "x", "arguments": `).
"""

from __future__ import annotations

import copy
import json
from abc import ABC, abstractmethod

from freetoken.engine.json_prefix import MAX_WHITESPACE, WHITESPACE, JsonPrefix
from freetoken.engine.json_schema import SchemaPrefix, call_object, compile_schema

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_OPEN, MISTRAL_ARGS, MISTRAL_CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
PYTHON_TAG = "<|python_tag|>"
# the text that opens a call in each constrained format ("": the reply itself opens with the call)
# DeepSeek-V3/R1/V3.1's call markers (fullwidth bars, "▁" U+2581), as its chat template writes them
DEEPSEEK_OPEN, DEEPSEEK_CLOSE = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DEEPSEEK_CALL, DEEPSEEK_CALL_END, DEEPSEEK_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
# DeepSeek-V4's DSML calls (V3.2's open `function_calls` instead of `tool_calls`); the bars are fullwidth as in
# DeepSeek's other special tokens
DSML = "｜DSML｜"
DSML_OPEN, DSML_V32_OPEN = f"<{DSML}tool_calls>", f"<{DSML}function_calls>"
DSML_INVOKE, DSML_INVOKE_END = f"<{DSML}invoke name=", f"</{DSML}invoke>"
DSML_PARAMETER, DSML_PARAMETER_END = f"<{DSML}parameter name=", f"</{DSML}parameter>"
CALL_MARKERS = {"hermes": CALL_OPEN, "qwen-xml": CALL_OPEN, "glm": CALL_OPEN, "mistral-json": MISTRAL_OPEN,
                "mistral-args": MISTRAL_OPEN, "llama3": "", "deepseek": DEEPSEEK_OPEN,
                "deepseek-fenced": DEEPSEEK_OPEN, "harmony": "to=functions.", "dsml": DSML_OPEN,
                "dsml-function-calls": DSML_V32_OPEN}


def opening_of(opener: str, call_format: str) -> str | None:
    """What a forced call's opener (tool_choice.call_opener) wrote inside the call, for the language to start
    from; None when the prompt opened no call."""
    if not opener:
        return None
    marker = CALL_MARKERS[call_format]
    if marker:
        return opener.split(marker, 1)[1] if marker in opener else None
    return opener.rsplit("</think>", 1)[-1].lstrip()  # the opener is the call's start (after a closed reasoning)


def call_head(name: str, key: str = "arguments") -> str:
    """How a JSON call of `name` starts, as the chat templates write it (and `tool_choice` openings too); Llama 3
    names its arguments "parameters"."""
    return f'{{"name": {json.dumps(name)}, "{key}": '


def call_heads(names: tuple[str, ...], schemas: tuple[tuple[str, str], ...], key: str = "arguments") -> dict:
    """head text → the schema of that tool's whole call object (None: any JSON arguments)."""
    compiled = {n: compile_schema(text) for n, text in schemas}
    return {call_head(n, key): call_object(n, compiled[n], key) if n in compiled else None for n in names}


def glue_space(lang, c: str) -> bool | None:
    """Whitespace between a call's parts, bounded like JSON's (MAX_WHITESPACE in a row): True/False for a
    whitespace `c` (within the bound or past it), None for any other character (the run is reset)."""
    if c in WHITESPACE:
        lang.spaces += 1
        return lang.spaces <= MAX_WHITESPACE
    lang.spaces = 0
    return None


class CallObject:
    """One JSON call object of an offered tool, read character by character: its head among `heads` (leading
    whitespace allowed; no heads: any object), then JSON to the object's end, valid under the call's schema."""

    __slots__ = ("heads", "head", "json", "spaces")

    def __init__(self, heads: dict) -> None:
        self.heads, self.head, self.json, self.spaces = heads, "" if heads else None, JsonPrefix(), 0

    def copy(self) -> CallObject:
        other = CallObject.__new__(CallObject)
        other.heads, other.head, other.json, other.spaces = self.heads, self.head, self.json.copy(), self.spaces
        return other

    @property
    def complete(self) -> bool:
        return self.head is None and self.json.complete

    def feed(self, c: str) -> bool:
        if self.head is None:
            return self.json.feed(c)
        if not self.head and (space := glue_space(self, c)) is not None:
            return space
        head = self.head + c
        if not any(h.startswith(head) for h in self.heads):
            return False
        self.head = head
        if head in self.heads:  # a whole head: the rest of the call's object goes on as JSON
            node = self.heads[head]
            self.json = JsonPrefix() if node is None else SchemaPrefix(node)
            self.json.feed(head)
            self.head = None
        return True


class CallsInText(ABC):
    """Free text watched for the call marker `OPEN`; a subclass defines how a call goes on (`_open`,
    `_call_char`) and returns to FREE (mode 0) once the call is closed, counting it (`calls`). Only free text may
    end. `single` (set by the sampler: parallel calls turned off): the reply ends right after its first call."""

    FREE = 0
    OPEN = CALL_OPEN
    spaces = 0  # whitespace in a row between a call's parts (glue_space); set per instance once counted
    single = False
    calls = 0  # calls closed so far (where the language returns to free text after each)

    def feed(self, text: str) -> bool:
        return all(self._char(c) for c in text)

    def _char(self, c: str) -> bool:
        if self.mode != self.FREE:
            return self._call_char(c)
        if self.single and self.calls:  # one call was asked for, and it is written: only the end may follow
            return glue_space(self, c) is True
        self.tail = (self.tail + c)[-len(self.OPEN):]
        if self.tail == self.OPEN:
            self._open()
        return True

    def _start_opened(self, opened: str | None, what: str) -> None:
        """A reply that starts inside a call, after `opened` (what the prompt wrote of it)."""
        if opened is not None:
            self._open()
            if not self.feed(opened) or self.mode == self.FREE:
                raise ValueError(f"a call opening that starts no call of {what}: {opened!r}")

    def _literal(self, c: str, options: list[str]) -> str | None:
        """`pending` + c matched against the literal texts `options`: None where none continues with it; "" while
        a prefix of one (held in `pending`); the literal itself once it is complete (`pending` reset)."""
        pending = self.pending + c
        if not any(o.startswith(pending) for o in options):
            return None
        self.pending = "" if pending in options else pending
        return pending if pending in options else ""

    @abstractmethod
    def _open(self) -> None:
        """Enters a call: `OPEN` was just read."""

    @abstractmethod
    def _call_char(self, c: str) -> bool:
        """Reads one character inside a call; False where no valid call continues with it."""

    def _closed(self) -> None:
        """A call just closed: back to free text (or, with `single`, to the end)."""
        self.mode, self.tail, self.calls = self.FREE, "", self.calls + 1

    @property
    def can_end(self) -> bool:
        return self.mode == self.FREE

    @property
    def must_end(self) -> bool:
        return bool(self.single and self.calls) and self.mode == self.FREE


class HermesCalls(CallsInText):
    """Free text in which each `<tool_call>` … `</tool_call>` holds one call object of one of `names` (any name
    if none given), whitespace around it."""

    FREE, CALL, CLOSE = range(3)

    def __init__(self, opened: str | None = None, names: tuple[str, ...] = (),
                 schemas: tuple[tuple[str, str], ...] = ()) -> None:
        """`opened`: the text after `<tool_call>` the prompt already wrote (a forced call). `schemas`: (name,
        parameters schema as JSON text) of the tools whose arguments must satisfy it (others: any object)."""
        self.heads = call_heads(names, schemas)
        self.mode, self.tail, self.call, self.matched = self.FREE, "", CallObject(self.heads), 0
        self._start_opened(opened, sorted(names))

    def copy(self) -> HermesCalls:
        other = HermesCalls.__new__(HermesCalls)
        other.heads, other.mode, other.tail, other.matched = self.heads, self.mode, self.tail, self.matched
        other.call, other.spaces, other.single, other.calls = self.call.copy(), self.spaces, self.single, self.calls
        return other

    def _open(self) -> None:
        self.mode, self.call = self.CALL, CallObject(self.heads)

    def _call_char(self, c: str) -> bool:
        if self.mode == self.CALL:
            if not self.call.feed(c):
                return False
            if self.call.complete:
                self.mode, self.matched = self.CLOSE, 0
            return True
        if self.matched == 0 and (space := glue_space(self, c)) is not None:
            return space
        if c != CALL_CLOSE[self.matched]:
            return False
        self.matched += 1
        if self.matched == len(CALL_CLOSE):
            self._closed()
        return True


class MistralCalls(CallsInText):
    """Free text in which `[TOOL_CALLS]` opens calls of offered tools: a JSON list of call objects (`args=False`)
    or one `NAME[ARGS]{arguments}` (`args=True`; `NAME[CALL_ID]id[ARGS]{…}` too), each marker its own call."""

    FREE, LIST, CALL, AFTER, NAME, CALL_ID, ARGS = range(7)
    OPEN = MISTRAL_OPEN

    def __init__(self, opened: str | None = None, names: tuple[str, ...] = (),
                 schemas: tuple[tuple[str, str], ...] = (), args: bool = False) -> None:
        self.args, self.names = args, names
        self.heads = call_heads(names, schemas)
        self.schemas = {n: compile_schema(text) for n, text in schemas}
        self.mode, self.tail, self.pending, self.call, self.json = self.FREE, "", "", None, None
        self._start_opened(opened, sorted(names))

    def copy(self) -> MistralCalls:
        other = MistralCalls.__new__(MistralCalls)
        other.args, other.names, other.heads, other.schemas = self.args, self.names, self.heads, self.schemas
        other.mode, other.tail, other.pending = self.mode, self.tail, self.pending
        other.call = None if self.call is None else self.call.copy()
        other.json = None if self.json is None else self.json.copy()
        other.spaces, other.single, other.calls = self.spaces, self.single, self.calls
        return other

    def _open(self) -> None:
        self.mode, self.pending = (self.NAME if self.args else self.LIST), ""

    def _call_char(self, c: str) -> bool:
        mode = self.mode
        if mode in (self.LIST, self.AFTER):
            if (space := glue_space(self, c)) is not None:
                return space
            if mode == self.LIST and c == "[" or mode == self.AFTER and c == "," and not self.single:
                self.mode, self.call = self.CALL, CallObject(self.heads)
                return True
            if mode == self.AFTER and c == "]":
                self._closed()
                return True
            return False
        if mode == self.CALL:
            if not self.call.feed(c):
                return False
            if self.call.complete:
                self.mode = self.AFTER
            return True
        if mode == self.NAME:
            return self._name_char(c)
        if mode == self.CALL_ID:  # an id of letters and digits, then [ARGS]
            self.pending += c
            if self.pending.endswith(MISTRAL_ARGS):
                self.mode, self.pending = self.ARGS, ""
                return True
            cut = self.pending.find("[")
            ident, rest = (self.pending, "") if cut < 0 else (self.pending[:cut], self.pending[cut:])
            return (not ident or ident.isalnum()) and MISTRAL_ARGS.startswith(rest)
        if not self.json.feed(c):  # ARGS: the arguments object
            return False
        if self.json.complete:
            self._closed()
        return True

    def _name_char(self, c: str) -> bool:
        pending = self.pending + c
        options = [n + marker for n in self.names for marker in (MISTRAL_ARGS, MISTRAL_CALL_ID)]
        if self.names and not any(o.startswith(pending) for o in options):
            return False
        self.pending = pending
        for marker, mode in ((MISTRAL_ARGS, self.ARGS), (MISTRAL_CALL_ID, self.CALL_ID)):
            if pending.endswith(marker) and (not self.names or pending in options):
                name = pending[:-len(marker)]
                self.mode, self.pending = mode, ""
                schema = self.schemas.get(name)
                self.json = JsonPrefix() if schema is None else SchemaPrefix(schema)
        return True


class Llama3Calls:
    """A reply that is either free text or, when it opens with `{` (or `<|python_tag|>`), one JSON call
    `{"name": <an offered tool>, "parameters": {…}}` and then the end."""

    START, TAG, CALL, END, FREE = range(5)

    def __init__(self, opened: str | None = None, names: tuple[str, ...] = (),
                 schemas: tuple[tuple[str, str], ...] = ()) -> None:
        self.heads = call_heads(names, schemas, key="parameters")
        self.mode, self.pending, self.call, self.spaces = self.START, "", CallObject(self.heads), 0
        if opened is not None:
            self.mode = self.CALL
            if not self.feed(opened) or self.mode != self.CALL:
                raise ValueError(f"a call opening that starts no call of {sorted(names)}: {opened!r}")

    def copy(self) -> Llama3Calls:
        other = Llama3Calls.__new__(Llama3Calls)
        other.heads, other.mode, other.pending, other.call = self.heads, self.mode, self.pending, self.call.copy()
        other.spaces = self.spaces
        return other

    def feed(self, text: str) -> bool:
        return all(self._char(c) for c in text)

    def _char(self, c: str) -> bool:
        mode = self.mode
        if mode == self.FREE:
            return True
        if mode == self.END:
            return glue_space(self, c) is True
        if mode == self.CALL:
            if not self.call.feed(c):
                return False
            if self.call.complete:
                self.mode = self.END
            return True
        if mode == self.START and (space := glue_space(self, c)) is not None:
            return space
        if mode == self.START and c == "{":
            self.mode = self.CALL
            return self.call.feed(c)
        pending = self.pending + c
        if PYTHON_TAG.startswith(pending):
            self.mode, self.pending = (self.CALL if pending == PYTHON_TAG else self.TAG), pending
            return True
        self.mode = self.FREE  # an answer in words: nothing to constrain
        return True

    @property
    def can_end(self) -> bool:
        return self.mode in (self.START, self.END, self.FREE)

    @property
    def must_end(self) -> bool:
        return self.mode == self.END


class EndsAfterTheCalls:
    """For languages whose calls end the reply: free text may end, and past the calls (DONE) only the end may
    follow."""

    FREE: int
    DONE: int
    mode: int

    @property
    def can_end(self) -> bool:
        return self.mode in (self.FREE, self.DONE)

    @property
    def must_end(self) -> bool:
        return self.mode == self.DONE


class CallsThenTheEnd(EndsAfterTheCalls, CallsInText):
    """A language whose calls (of `names`, arguments under `schemas`) end the reply: DONE, where only the end
    may follow. State: the literal being matched (`pending`) and the current arguments' JSON (`json`)."""

    ARGS: int  # the modes subclasses number: reading arguments, and past the end
    DONE: int

    def __init__(self, opened: str | None = None, names: tuple[str, ...] = (),
                 schemas: tuple[tuple[str, str], ...] = ()) -> None:
        self.names = names
        self.schemas = {n: compile_schema(text) for n, text in schemas}
        self.mode, self.tail, self.pending, self.json = self.FREE, "", "", None
        self._start_opened(opened, sorted(names))

    def copy(self):
        other = copy.copy(self)  # names and compiled schemas are shared, never changed
        other.json = None if self.json is None else self.json.copy()
        return other

    def _after_args_or_args(self, c: str, then: int) -> bool | None:
        """`c` past the end (whitespace only) or inside the current arguments (mode `then` once they close);
        None in any other mode."""
        if self.mode == self.DONE:
            return glue_space(self, c) is True
        if self.mode != self.ARGS:
            return None
        if not self.json.feed(c):
            return False
        if self.json.complete:
            self.mode, self.pending = then, ""
        return True

    def _arguments(self, name: str):
        """The JSON reader of `name`'s arguments: its schema's where it has a usable one."""
        schema = self.schemas.get(name)
        return JsonPrefix() if schema is None else SchemaPrefix(schema)


class DeepseekCalls(CallsThenTheEnd):
    """Free text until `<｜tool▁calls▁begin｜>`, then one or more calls of offered tools, each
    `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{arguments}<｜tool▁call▁end｜>` (V3.1) or, `fenced`,
    `…begin｜>function<｜tool▁sep｜>NAME` + a ```json fence around the arguments (V3, R1), then
    `<｜tool▁calls▁end｜>` and the end of the reply (the template ends the turn there)."""

    FREE, BEGIN, NAME, ARGS, FENCE_END, CALL_END, AFTER, DONE = range(8)
    OPEN = DEEPSEEK_OPEN

    def __init__(self, opened: str | None = None, names: tuple[str, ...] = (),
                 schemas: tuple[tuple[str, str], ...] = (), fenced: bool = False) -> None:
        self.fenced = fenced
        super().__init__(opened, names, schemas)

    def _open(self) -> None:
        self.mode, self.pending = self.BEGIN, ""

    def _literals(self) -> list[str]:
        if self.mode == self.BEGIN:
            return [DEEPSEEK_CALL]
        if self.mode == self.AFTER:
            return [DEEPSEEK_CLOSE] if self.single else [DEEPSEEK_CALL, DEEPSEEK_CLOSE]
        if self.mode == self.NAME:
            head = "function" + DEEPSEEK_SEP if self.fenced else ""
            tail = "\n```json\n" if self.fenced else DEEPSEEK_SEP
            return [head + n + tail for n in self.names]
        if self.mode == self.FENCE_END:
            return ["```"]
        return [DEEPSEEK_CALL_END]

    def _call_char(self, c: str) -> bool:
        if (taken := self._after_args_or_args(c, self.FENCE_END if self.fenced else self.CALL_END)) is not None:
            return taken
        if not self.pending and self.mode != self.NAME and (space := glue_space(self, c)) is not None:
            return space
        pending = self._literal(c, self._literals())
        if pending is None:
            return False
        if pending:
            if self.mode == self.NAME:
                name = pending.removeprefix("function" + DEEPSEEK_SEP) if self.fenced else pending
                name = name.removesuffix("\n```json\n" if self.fenced else DEEPSEEK_SEP)
                self.mode, self.json = self.ARGS, self._arguments(name)
            elif pending == DEEPSEEK_CALL:
                self.mode = self.NAME
            elif pending == "```":
                self.mode = self.CALL_END
            elif pending == DEEPSEEK_CALL_END:
                self.mode = self.AFTER
            else:  # the calls' end
                self.mode = self.DONE
        return True


HARMONY_OPEN, HARMONY_MESSAGE = "to=functions.", "<|message|>"
# how a Harmony call header goes on after the tool's name, up to its body (the recipient in the channel part,
# as gpt-oss writes it, or in the role part before the channel)
HARMONY_HEADER_ENDS = (" <|constrain|>json<|message|>", " json<|message|>", "<|message|>",
                       "<|channel|>commentary <|constrain|>json<|message|>", "<|channel|>commentary json<|message|>")


class HarmonyCalls(CallsThenTheEnd):
    """gpt-oss's Harmony replies: free text (its messages' headers and bodies) until a header names a recipient
    `to=functions.NAME`; NAME must be an offered tool, the header runs on to `<|message|>`, the body is the JSON
    arguments (valid under the tool's schema), and then the reply ends (`<|call|>` is a stop token)."""

    FREE, NAME, ARGS, DONE = range(4)
    OPEN = HARMONY_OPEN

    def _open(self) -> None:
        self.mode, self.pending = self.NAME, ""

    def _call_char(self, c: str) -> bool:
        if (taken := self._after_args_or_args(c, self.DONE)) is not None:
            return taken
        pending = self._literal(c, [n + end for n in self.names for end in HARMONY_HEADER_ENDS])  # name, header
        if pending is None:
            return False
        if pending:
            name = next(n for n in self.names if pending.startswith(n) and pending[len(n):] in HARMONY_HEADER_ENDS)
            self.mode, self.json = self.ARGS, self._arguments(name)
        return True
