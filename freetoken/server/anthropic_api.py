"""Anthropic-compatible routes: `POST /v1/messages` (streamed or not: text, thinking and tool_use blocks) and
`POST /v1/messages/count_tokens`.

Content blocks are converted to the chat template's messages (system text, from `system` and from any
`role: "system"` message, in one system message first): `tool_use` blocks become the assistant's tool calls,
`tool_result` blocks become `tool` messages, `thinking` blocks are dropped from the history (templates drop past
reasoning too). Streaming follows the API's event sequence: message_start, then per block
content_block_start / _delta / _stop, message_delta with the stop reason and usage, message_stop; pings while
the prompt is prefilled.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from freetoken.errors import ChatTemplateError
from freetoken.server.engine import ChatPrompt, ServingEngine
from freetoken.server.errors import APIError, context_exceeded_anthropic, stream_error
from freetoken.server.output import OutputParser
from freetoken.server.requests import (
    admit,
    body_doc,
    check_tool_schemas,
    collect,
    message_schema,
    paced,
    read_body,
    sampling_params,
    sse,
    thinking_effort,
    while_connected,
)
from freetoken.server.tool_choice import anthropic_choice

_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}


_MESSAGE = message_schema(["user", "assistant", "system"], ["text"])


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[dict[str, Any]] = Field(min_length=1, json_schema_extra={"items": _MESSAGE})
    max_tokens: int = Field(ge=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    ignore_eos: bool = False  # an extension (as in chat completions): generate max_tokens; ft eval's fixed lengths


class CountRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[dict[str, Any]] = Field(min_length=1, json_schema_extra={"items": _MESSAGE})
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    thinking: dict[str, Any] | None = None


def router(engine: ServingEngine, model_ids: set[str]) -> APIRouter:
    r = APIRouter()

    def prompt(req: MessagesRequest | CountRequest) -> ChatPrompt:
        if req.model not in model_ids:
            raise APIError(404, f"model: {req.model} (this server serves {engine.model_id})")
        tools = _tools(req)
        choice = anthropic_choice(getattr(req, "tool_choice", None), [t["function"]["name"] for t in tools or []])
        messages = _conversation(req.system, req.messages)
        thinking = None if req.thinking is None else req.thinking.get("type") == "enabled"
        try:
            return engine.chat_prompt(messages, tools, enable_thinking=thinking, choice=choice,
                                      reasoning_effort=thinking_effort(req.thinking))
        except ChatTemplateError as e:
            raise APIError(400, f"the chat template could not render these messages: {e}") from None

    @r.post("/v1/messages/count_tokens", openapi_extra=body_doc(CountRequest, model_ids))
    async def count_tokens(request: Request) -> dict:
        return {"input_tokens": len(prompt(await read_body(request, CountRequest)).ids)}

    @r.post("/v1/messages", openapi_extra=body_doc(MessagesRequest, model_ids))
    async def messages(request: Request):
        req = await read_body(request, MessagesRequest)
        chat = prompt(req)
        ids = chat.ids
        admit(engine, ids, context_exceeded_anthropic)
        params = chat.constrain(sampling_params(
            max_tokens=req.max_tokens, prompt_tokens=len(ids), context=engine.context_length,
            temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=None, seed=None,
            stop=list(req.stop_sequences or []), ignore_eos=req.ignore_eos))
        parser = chat.parser(stream_calls=req.stream)
        ident = f"msg_{uuid.uuid4().hex[:24]}"
        events = engine.stream(ids, params)
        if req.stream:
            return StreamingResponse(_stream(engine, ident, len(ids), events, parser),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return JSONResponse(await _complete(engine, ident, while_connected(request, events), parser))

    return r


def _message(engine: ServingEngine, ident: str, content: list, stop_reason: str | None, input_tokens: int,
             output_tokens: int, cached: int = 0) -> dict:
    return {"id": ident, "type": "message", "role": "assistant", "model": engine.model_id, "content": content,
            "stop_reason": stop_reason, "stop_sequence": None, "usage": _usage(input_tokens, output_tokens, cached)}


def _usage(prompt_tokens: int, output_tokens: int, cached: int) -> dict:
    """Anthropic counts prompt tokens read from the cache apart: input_tokens are the ones computed."""
    return {"input_tokens": prompt_tokens - cached, "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


async def _complete(engine: ServingEngine, ident: str, events: AsyncIterator, parser: OutputParser) -> dict:
    parts, last = await collect(events, parser)
    blocks: list[dict] = []
    for p in parts:  # consecutive parts of one kind merge into one block
        kind = {"text": "text", "reasoning": "thinking", "tool_call": "tool_use"}[p.kind]
        if kind == "tool_use":
            blocks.append({"type": "tool_use", "id": _tool_id(), "name": p.call.name, "input": p.call.arguments})
        elif blocks and blocks[-1]["type"] == kind:
            blocks[-1][kind] += p.text
        else:
            blocks.append({"type": kind, kind: p.text, **({"signature": ""} if kind == "thinking" else {})})
    if not blocks:
        blocks = [{"type": "text", "text": ""}]
    used_tools = any(b["type"] == "tool_use" for b in blocks)
    message = _message(engine, ident, blocks, _stop_reason(last, used_tools), last.prompt_tokens,
                       last.completion_tokens, last.cached_tokens)
    message["stop_sequence"] = last.stop_sequence
    return message


async def _stream(engine: ServingEngine, ident: str, prompt_tokens: int, events: AsyncIterator,
                  parser: OutputParser) -> AsyncIterator[str]:
    yield sse({"type": "message_start", "message": _message(engine, ident, [], None, prompt_tokens, 1)},
              "message_start")
    index, open_kind, used_tools, last = -1, None, False, None

    def start(kind: str, block: dict) -> str:
        nonlocal index, open_kind
        index, open_kind = index + 1, kind
        return sse({"type": "content_block_start", "index": index, "content_block": block}, "content_block_start")

    def stop() -> str:
        nonlocal open_kind
        open_kind = None
        return sse({"type": "content_block_stop", "index": index}, "content_block_stop")

    try:
        async for ev in paced(events):
            if ev is None:
                yield sse({"type": "ping"}, "ping")
                continue
            last = ev
            for p in parser.push(ev.text, len(ev.token_ids)) + (parser.finish() if ev.finish_reason else []):
                if p.kind == "call_delta":  # into the tool_use block its call_start opened
                    yield _delta(index, {"type": "input_json_delta", "partial_json": p.text})
                    continue
                if p.kind == "tool_call" and p.streamed:  # its block is open, its input streamed
                    used_tools = True
                    yield stop()
                    continue
                kind = {"text": "text", "reasoning": "thinking", "tool_call": "tool_use",
                        "call_start": "tool_use"}[p.kind]
                if open_kind is not None and (kind != open_kind or kind == "tool_use"):
                    if open_kind == "thinking":
                        yield _delta(index, {"type": "signature_delta", "signature": ""})
                    yield stop()
                if p.kind == "call_start":
                    yield start(kind, {"type": "tool_use", "id": _tool_id(), "name": p.call.name, "input": {}})
                    continue
                if kind == "tool_use":
                    used_tools = True
                    yield start(kind, {"type": "tool_use", "id": _tool_id(), "name": p.call.name, "input": {}})
                    yield _delta(index, {"type": "input_json_delta", "partial_json": p.call.arguments_json})
                    yield stop()
                    continue
                if open_kind is None:
                    yield start(kind, {"type": "text", "text": ""} if kind == "text" else
                                {"type": "thinking", "thinking": "", "signature": ""})
                yield _delta(index, {"type": "text_delta", "text": p.text} if kind == "text" else
                             {"type": "thinking_delta", "thinking": p.text})
    except Exception as e:  # after the status line: the error travels as the API's error event
        yield sse(stream_error(e).anthropic_body(), "error")
        return
    if open_kind == "thinking":
        yield _delta(index, {"type": "signature_delta", "signature": ""})
    if open_kind is not None:
        yield stop()
    if index < 0:  # an empty reply still has one (empty) text block
        yield start("text", {"type": "text", "text": ""})
        yield stop()
    yield sse({"type": "message_delta", "delta": {"stop_reason": _stop_reason(last, used_tools),
                                                   "stop_sequence": last.stop_sequence},
               # the full usage: message_start went out before the prompt met the prefix cache
               "usage": _usage(last.prompt_tokens, last.completion_tokens, last.cached_tokens)}, "message_delta")
    yield sse({"type": "message_stop"}, "message_stop")


def _stop_reason(last, used_tools: bool) -> str:
    if used_tools:
        return "tool_use"
    return "stop_sequence" if last.stop_sequence else _STOP_REASONS[last.finish_reason]


def _delta(index: int, delta: dict) -> str:
    return sse({"type": "content_block_delta", "index": index, "delta": delta}, "content_block_delta")


def _tool_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def _tools(req: MessagesRequest | CountRequest) -> list[dict] | None:
    if not req.tools:
        return None
    check_tool_schemas(req.tools, lambda t: t.get("name"), lambda t: t.get("input_schema", {}))
    return [{"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                              "parameters": t.get("input_schema", {})}} for t in req.tools]


def _conversation(system: str | list[dict] | None, messages: list[dict]) -> list[dict]:
    """The template's messages: one system message, then the turns. `role: "system"` messages inside `messages`
    (Claude Code sends one for a model name it does not know, the "mid-conversation system" beta) join the system
    prompt in order: chat templates take one system message, first, and many refuse any other."""
    texts = [_system_text(system, "system")] if system else []
    turns = []
    for i, m in enumerate(messages):
        if isinstance(m, dict) and m.get("role") == "system":
            texts.append(_system_text(m.get("content"), f"messages.{i}.content"))
        else:
            turns += _messages(m, i)
    if not turns:
        raise APIError(400, "messages: at least one message with role 'user' or 'assistant' is needed (role "
                            "'system' messages only add to the system prompt)")
    texts = [t for t in texts if t]
    return ([{"role": "system", "content": "\n\n".join(texts)}] if texts else []) + turns


def _system_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}: must be a string or a list of text blocks")
    # Claude Code's first system block, "x-anthropic-billing-header: …; cch=…", changes with every request: kept, it
    # would make the whole prompt after it a prefix-cache miss each turn. It tells a local model nothing.
    return "".join(text for b in content if not (text := _block_text(b, where)).startswith(_BILLING_HEADER))


_BILLING_HEADER = "x-anthropic-billing-header:"


def _block_text(block: Any, where: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
        raise APIError(400, f"{where}: expected text blocks ({{'type': 'text', 'text': ...}})")
    return block["text"]


def _messages(m: dict[str, Any], i: int) -> list[dict]:
    """One Anthropic message as template messages (a user turn of tool results becomes `tool` messages)."""
    role, content, where = m.get("role"), m.get("content"), f"messages.{i}"
    if role not in ("user", "assistant"):
        raise APIError(400, f"{where}.role: must be 'user', 'assistant' or 'system', got {role!r}")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content: must be a string or a list of content blocks")
    text, calls, results = [], [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            text.append(_block_text(block, f"{where}.content.{j}"))
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("name"), str) or not isinstance(block.get("input", {}), dict):
                raise APIError(400, f"{where}.content.{j}: tool_use needs a name and an input object")
            calls.append({"id": block.get("id"), "type": "function",
                          "function": {"name": block["name"], "arguments": block.get("input", {})}})
        elif kind == "tool_result" and role == "user":
            results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                            "content": _result_text(block.get("content"), f"{where}.content.{j}")})
        elif kind in ("image", "document"):
            raise APIError(400, f"{where}.content.{j}: {kind} blocks are not supported by this model (text only)")
        else:
            raise APIError(400, f"{where}.content.{j}: unexpected block type {kind!r} in a {role} message")
    if role == "assistant":
        out = {"role": "assistant", "content": "".join(text)}
        return [{**out, "tool_calls": calls} if calls else out]
    return results + ([{"role": "user", "content": "".join(text)}] if text or not results else [])


def _result_text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        return "".join(_block_text(b, where) for b in content if not (isinstance(b, dict) and b.get("type") == "image"))
    return json.dumps(content)
