"""gpt-oss's Harmony format → answer text, reasoning and tool calls, incrementally (the `OutputParser` contract).

A Harmony reply is a run of messages, each a header and a body:
`<|channel|>analysis<|message|>…reasoning…<|end|><|start|>assistant<|channel|>final<|message|>…answer…`, the
generation ending at `<|return|>` (an answer) or `<|call|>` (a tool call), both stop tokens that never reach the
text. The header names the channel (`analysis` = reasoning, `final` and `commentary` = text for the user) and,
for a tool call, the recipient, in the channel part or the role part: `<|channel|>commentary to=functions.NAME
<|constrain|>json<|message|>{…}` or `<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>`.
The prompt ends with `<|start|>assistant`, so a reply opens with its first header.
"""

from __future__ import annotations

import json
import re

from freetoken.engine.tokenizer import HARMONY_MARKERS
from freetoken.server.output import OutputParser, Part, ToolCall, partial_tag

START, END, CHANNEL, MESSAGE, CONSTRAIN = HARMONY_MARKERS
_RECIPIENT = re.compile(r"\bto=(\S+?)(?=\s|<\||$)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")


class HarmonyParser:
    def __init__(self, *, tools: bool = True, prefix: str = ""):
        """`prefix`: text the prompt wrote on the model's behalf after `<|start|>assistant` (a forced tool call's
        header), read first."""
        self.tools = tools
        self.buffer = ""
        self.state = "header"  # or "body"
        self.header = ""
        self.reasoning_tokens = 0  # generated tokens of analysis-channel bodies (usage reports them)
        self._pending: list[Part] = []
        self._pending = self.push(prefix) if prefix else []

    def push(self, text: str, tokens: int = 0) -> list[Part]:
        """As `OutputParser.push`."""
        if self.state == "body" and self._body_kind() == "reasoning":
            self.reasoning_tokens += tokens
        self.buffer += text
        parts, self._pending = self._pending, []
        while True:
            if self.state == "header":
                at = self.buffer.find(MESSAGE)
                if at < 0:
                    return parts
                self.header += self.buffer[:at]
                self.buffer, self.state = self.buffer[at + len(MESSAGE):], "body"
                continue
            kind = self._body_kind()
            if kind == "call":  # its arguments run to the stop token (<|call|>): read whole in finish()
                return parts
            at = self.buffer.find(END)
            if at < 0:
                keep = partial_tag(self.buffer, [END])  # stream what cannot be the start of <|end|>
                _add(parts, kind, self.buffer[:len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep:]
                return parts
            body, self.buffer = self.buffer[:at], self.buffer[at + len(END):]
            parts.extend(self._finish_body(kind, body))
            self.state, self.header = "header", ""
            self.buffer = self.buffer.removeprefix(START)

    def finish(self) -> list[Part]:
        """The rest at the end of generation (the stop token, `<|call|>` or `<|return|>`, ends the last body)."""
        rest, self.buffer = self.buffer, ""
        if self.state == "header":  # no <|message|>: not a Harmony message; whatever came is text
            text = (self.header + rest).replace(START, "").strip()
            return [Part("text", text)] if text else []
        return self._finish_body(self._body_kind(), rest)

    def _body_kind(self) -> str:
        """What the current message's body is: "reasoning", "text" or "call" (a tool call's arguments)."""
        recipient = _RECIPIENT.search(self.header)
        if recipient and recipient.group(1).startswith("functions."):
            return "call" if self.tools else "text"
        channel = _CHANNEL.search(self.header)
        return "reasoning" if channel and channel.group(1) == "analysis" else "text"

    def _finish_body(self, kind: str, body: str) -> list[Part]:
        if kind != "call":
            return _add([], kind, body)
        name = _RECIPIENT.search(self.header).group(1).removeprefix("functions.")
        try:
            arguments = json.loads(body) if body.strip() else {}
        except json.JSONDecodeError:
            arguments = None
        if not isinstance(arguments, dict):  # not a call the client could run: shown as text
            return _add([], "text", body)
        return [Part("tool_call", call=ToolCall(name, arguments))]


def _add(parts: list[Part], kind: str, text: str) -> list[Part]:
    if text:
        if parts and parts[-1].kind == kind and kind != "tool_call":
            parts[-1].text += text
        else:
            parts.append(Part(kind, text))
    return parts


def reply_parser(*, harmony: bool, in_reasoning: bool = False, tools: bool = True, prefix: str = "",
                 text_params: dict[str, frozenset[str]] | None = None,
                 stream_calls: bool = False) -> OutputParser | HarmonyParser:
    """The parser for a reply rendered by a Harmony template (`harmony`) or by any other. `stream_calls`: Hermes
    and Qwen3-Coder calls also stream while they form (Harmony's calls come whole)."""
    if harmony:
        return HarmonyParser(tools=tools, prefix=prefix)
    return OutputParser(in_reasoning=in_reasoning, tools=tools, prefix=prefix, text_params=text_params,
                        stream_calls=stream_calls)
