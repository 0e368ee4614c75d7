"""`freetoken.connect(url)`: the Session API against a running `ft serve` (or any OpenAI-compatible server).

The conversation lives on the client: each `send` posts the whole history to `/v1/chat/completions` (streamed),
and the server's prefix cache recomputes only what changed since the last request, so `fork`, `checkpoint`,
`rollback` and `edit` are operations on the client's message lists and stay cheap on the server too. Replies
are the same `Reply` objects as in-process; `stats.cached_tokens` is what the server reports as reused.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

from freetoken.errors import FreeTokenError
from freetoken.sdk.conversation import Conversation, Sampling, assistant_message, openai_tool_choice
from freetoken.sdk.local import Worker
from freetoken.sdk.reply import Reply, ReplyStats
from freetoken.server.output import Part, ToolCall


def connect(url: str = "http://127.0.0.1:1919", *, api_key: str | None = None, model: str | None = None,
            timeout: float = 3600) -> RemoteEngine:
    """A handle on the server at `url`; `model` defaults to the first the server lists."""
    return RemoteEngine(url, api_key=api_key, model=model, timeout=timeout)


class RemoteEngine(Worker):
    def __init__(self, url: str, *, api_key: str | None, model: str | None, timeout: float):
        import openai

        self.client = openai.OpenAI(base_url=f"{url.rstrip('/')}/v1", api_key=api_key or "unused", timeout=timeout,
                                    max_retries=0)
        try:
            self.model = model or self.client.models.list().data[0].id
        except openai.APIConnectionError:
            raise FreeTokenError(f"no server answered at {url}; start one with `ft serve`") from None
        super().__init__("ft-remote")

    def session(self, system: str | None = None, tools: Sequence[Mapping[str, Any]] | None = None,
                messages: Sequence[Mapping[str, Any]] = ()) -> RemoteSession:
        history = ([{"role": "system", "content": system}] if system else []) + [dict(m) for m in messages]
        return RemoteSession(self, history, list(tools) if tools else None)


def _response_format(sampling: Sampling) -> dict:
    if not sampling.schema:
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {"name": "reply", "schema": json.loads(sampling.schema)}}


class RemoteSession(Conversation):
    def __init__(self, engine: RemoteEngine, messages: list[dict], tools: list[dict] | None):
        self.engine, self._messages, self.tools = engine, messages, tools
        self._checkpoints: dict[str, list[dict]] = {}

    def _produce(self, msg: dict, sampling: Sampling, reply: Reply) -> ReplyStats:
        body = {"max_tokens": sampling.max_tokens, "temperature": sampling.temperature, "top_p": sampling.top_p,
                "stop": list(sampling.stop) or None, "seed": sampling.seed,
                **({"response_format": _response_format(sampling)} if sampling.json else {}),
                **({"extra_body": {"top_k": sampling.top_k}} if sampling.top_k else {}),
                **({"tool_choice": openai_tool_choice(sampling.tool_choice)} if sampling.tool_choice else {}),
                **({"parallel_tool_calls": False} if sampling.tool_choice and not sampling.tool_choice.parallel
                   else {})}
        messages = self._messages + [msg]
        started, first, parts, usage, finish = time.perf_counter(), None, [], None, None
        calls: dict[int, list] = {}  # index → [name, arguments so far]: a call's arguments may come in pieces
        stream = self.engine.client.chat.completions.create(
            model=self.engine.model, messages=messages, tools=self.tools or None, stream=True,
            stream_options={"include_usage": True}, **body)

        def put(found: list[Part]) -> None:
            nonlocal first
            for part in found:
                first = first or time.perf_counter()
                parts.append(part)
                reply.put(part)

        for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                finish = choice.finish_reason or finish
                delta = choice.delta
                found = [Part("reasoning", r) for r in [getattr(delta, "reasoning_content", None)] if r]
                found += [Part("text", delta.content)] if delta.content else []
                for c in delta.tool_calls or []:
                    if c.index not in calls:  # a new call: the ones before it are complete
                        found += _complete_calls(calls)
                        calls[c.index] = [c.function.name, ""]
                    calls[c.index][1] += c.function.arguments or ""
                    first = first or time.perf_counter()
                put(found)
        put(_complete_calls(calls))
        self._messages = messages + [assistant_message(parts, arguments_as_json=True)]
        done = time.perf_counter()
        tokens = usage.completion_tokens if usage else 0
        cached = (usage.prompt_tokens_details.cached_tokens or 0) if usage and usage.prompt_tokens_details else 0
        return ReplyStats(usage.prompt_tokens if usage else 0, cached, tokens,
                          first - started if first else None,
                          (tokens - 1) / (done - first) if first and tokens > 1 and done > first else None, finish)

    def fork(self) -> RemoteSession:
        return self.engine.run(lambda: RemoteSession(self.engine, copy.deepcopy(self._messages), self.tools))

    def checkpoint(self, name: str) -> None:
        self.engine.run(lambda: self._checkpoints.__setitem__(name, copy.deepcopy(self._messages)))

    def rollback(self, name: str) -> None:
        def restore() -> None:
            if name not in self._checkpoints:
                raise FreeTokenError(f"no checkpoint {name!r}; this session has {sorted(self._checkpoints)}")
            self._messages = copy.deepcopy(self._checkpoints[name])

        self.engine.run(restore)

    def close(self) -> None:
        self.engine.run(lambda: self._checkpoints.clear())


def _complete_calls(calls: dict[int, list]) -> list[Part]:
    """The calls gathered so far as parts, emptying `calls`: their arguments parsed (a call the reply's end cut
    off keeps its text in the part, with no arguments)."""
    parts = []
    for name, arguments in calls.values():
        try:
            parsed = json.loads(arguments or "{}")
        except json.JSONDecodeError:
            parsed = {}
        parts.append(Part("tool_call", text=arguments, call=ToolCall(name, parsed if isinstance(parsed, dict) else {})))
    calls.clear()
    return parts
