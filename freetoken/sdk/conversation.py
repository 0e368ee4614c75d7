"""What local and remote sessions share: the message list, `send` queueing a reply on the engine's worker,
`edit`, and the assistant message a reply leaves in the history."""

from __future__ import annotations

import copy
import json as json_text
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from freetoken.engine.json_schema import compile_schema
from freetoken.errors import FreeTokenError
from freetoken.sdk.reply import Reply, ReplyStats
from freetoken.server.errors import APIError
from freetoken.server.output import Part
from freetoken.server.tool_choice import ToolChoice, openai_choice


@dataclass(frozen=True, slots=True)
class Sampling:
    max_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    json: bool = False  # the reply is one JSON object (constrained sampling)
    schema: str = ""  # ... valid under this JSON schema (compact JSON text), when given
    tool_choice: ToolChoice | None = None  # None: auto


class Conversation(ABC):
    """Subclasses set `engine` (a `Worker`), `_messages` and `tools`, and implement `_produce`."""

    engine: Any
    _messages: list[dict]
    tools: list[dict] | None

    @property
    def messages(self) -> list[dict]:
        """The conversation so far (a copy), as of every operation queued before this call."""
        return self.engine.run(lambda: copy.deepcopy(self._messages))

    def send(self, message: str | Mapping[str, Any], *, max_tokens: int = 512, temperature: float = 0.0,
             top_p: float = 1.0, top_k: int = 0, stop: Sequence[str] = (), seed: int | None = None,
             json: bool | Mapping[str, Any] = False, tool_choice: str | Mapping[str, Any] | None = None,
             parallel_tool_calls: bool = True) -> Reply:
        """Queues `message` (a string is a user message; a dict any OpenAI-style message, a tool result too)
        and returns its reply at once; the reply completes whether or not it is read. `json=True`: the reply's
        text is one JSON object (sampling is constrained to it); a JSON schema (a dict): one valid under it (what
        is enforced: freetoken/engine/json_schema.py; an unreadable schema raises ValueError here).
        `tool_choice` as OpenAI takes it: "auto" (default), "none" (a plain reply; the tools stay in the prompt,
        so the turn reuses the history's K/V),
        "required" (the reply is a call of some tool), or {"type": "function", "function": {"name": ...}} (a call
        of that tool; {"type": "function", "name": ...} too); anything else, or a tool the session lacks, raises
        ValueError here. `parallel_tool_calls=False`: the reply ends after its first call."""
        msg = {"role": "user", "content": message} if isinstance(message, str) else dict(message)
        schema = _schema_text(json) if isinstance(json, Mapping) else ""
        sampling = Sampling(max_tokens, temperature, top_p, top_k, tuple(stop), seed, bool(json), schema,
                            _tool_choice(tool_choice, self.tools, parallel_tool_calls))
        reply = Reply()
        self.engine.submit(lambda: self._run(msg, sampling, reply))
        return reply

    def _run(self, msg: dict, sampling: Sampling, reply: Reply) -> None:
        try:
            stats = self._produce(msg, sampling, reply)
        except BaseException as e:  # noqa: BLE001 - the reader gets it
            reply.close(error=e)
        else:
            reply.close(stats)

    @abstractmethod
    def _produce(self, msg: dict, sampling: Sampling, reply: Reply) -> ReplyStats:
        """On the worker: generates the reply to `msg` into `reply`, updates the history, returns the stats."""

    def edit(self, index: int, message: str | Mapping[str, Any]) -> None:
        """Replaces message `index` (a string keeps the role); the next send recomputes from the first token
        that changed."""
        def change() -> None:
            if not -len(self._messages) <= index < len(self._messages):
                raise FreeTokenError(f"no message {index}; the session has {len(self._messages)}")
            old = self._messages[index]
            self._messages[index] = {**old, "content": message} if isinstance(message, str) else dict(message)

        self.engine.run(change)


def _tool_choice(value: str | Mapping[str, Any] | None, tools: list[dict] | None,
                 parallel: bool = True) -> ToolChoice | None:
    """`send`'s tool_choice, checked against the session's tools now, so a bad one fails at the caller."""
    if value is None and parallel:
        return None
    names = [t["function"]["name"] for t in tools or []]
    responses_shape = isinstance(value, Mapping) and "function" not in value
    try:
        return openai_choice(dict(value) if isinstance(value, Mapping) else value, names, responses=responses_shape,
                             parallel=parallel)
    except APIError as e:
        raise ValueError(e.message) from None


def openai_tool_choice(choice: ToolChoice) -> str | dict:
    """A checked choice as Chat Completions takes it (what a remote session sends)."""
    if choice.mode == "named":
        return {"type": "function", "function": {"name": choice.name}}
    return choice.mode


def _schema_text(schema: Mapping[str, Any]) -> str:
    """A reply schema as compact JSON text, checked now so a bad one fails at the caller's `send`."""
    text = json_text.dumps(dict(schema), separators=(",", ":"), sort_keys=True)
    root = compile_schema(text)
    if root.types is not None and "object" not in root.types:
        raise ValueError("a reply schema's top level must be an object (type: object)")
    return text


def assistant_message(parts: list[Part], arguments_as_json: bool = False) -> dict:
    """The reply as the next turn's history holds it: the answer, and its tool calls (reasoning is dropped, as
    chat templates drop it from earlier turns). Servers take arguments as a JSON string, templates a dict."""
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(p.text for p in parts if p.kind == "text")}
    calls = [p.call for p in parts if p.kind == "tool_call"]
    if calls:
        msg["tool_calls"] = [{"id": f"call_{i}", "type": "function", "function": {
            "name": c.name, "arguments": c.arguments_json if arguments_as_json else c.arguments}}
            for i, c in enumerate(calls)]
    return msg
