"""OpenAI-compatible routes: `GET /v1/models`, `POST /v1/chat/completions` (streamed or not, tools, reasoning)
and the legacy `POST /v1/completions` (a raw prompt, no chat template).

Requests are converted to the chat template's message format (content parts joined, tool-call arguments parsed
into objects, `developer` as `system`), generated through the serving engine, and the output is split into
content, `reasoning_content` and `tool_calls` by `OutputParser`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from freetoken.errors import ChatTemplateError
from freetoken.server.engine import ServingEngine
from freetoken.server.errors import APIError, context_exceeded_openai, stream_error
from freetoken.server.output import OutputParser
from freetoken.server.requests import (
    admit,
    body_doc,
    check_json_prompt,
    check_model,
    check_tool_schemas,
    collect,
    message_schema,
    paced,
    read_body,
    sampling_params,
    sse,
    template_effort,
    text_content,
    wants_json,
    while_connected,
)
from freetoken.server.tool_choice import openai_choice


class _SamplingRequest(BaseModel):
    """The fields chat and legacy completions share."""

    model_config = ConfigDict(extra="allow")

    model: str
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    ignore_eos: bool = False  # an extension (as vLLM's): generate max_tokens whatever the model says; benchmarks

    def check(self, served: set[str], engine: ServingEngine) -> None:
        check_model(self.model, served, engine)
        if self.n != 1:
            raise APIError(400, "only n=1 is supported", param="n")

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatRequest(_SamplingRequest):
    messages: list[dict[str, Any]] = Field(min_length=1, json_schema_extra={
        "items": message_schema(["system", "developer", "user", "assistant"], ["text"])})
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(_SamplingRequest):
    prompt: str = Field(min_length=1)
    max_tokens: int | None = 16  # the API's own default


def router(engine: ServingEngine, model_ids: set[str]) -> APIRouter:
    r = APIRouter()

    @r.get("/v1/models")
    async def models() -> dict:
        created = int(time.time())
        entry = {"id": engine.model_id, "object": "model", "type": "model", "created": created,
                 "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created)), "owned_by": "freetoken",
                 "display_name": engine.model_id, "context_length": engine.context_length,
                 "max_output_tokens": engine.reply_budget}
        return {"object": "list", "data": [entry], "has_more": False, "first_id": engine.model_id,
                "last_id": engine.model_id}

    @r.post("/v1/chat/completions", openapi_extra=body_doc(ChatRequest, model_ids))
    async def chat_completions(request: Request):
        req = await read_body(request, ChatRequest)
        req.check(model_ids, engine)
        tools = _tools(req)
        choice = openai_choice(req.tool_choice, [t["function"]["name"] for t in tools or []],
                               parallel=req.parallel_tool_calls)
        messages = [_message(m, i) for i, m in enumerate(req.messages)]
        thinking = None if req.reasoning_effort is None else req.reasoning_effort not in ("none", "minimal")
        json_object, json_schema = wants_json(req.response_format, "response_format")
        try:
            chat = engine.chat_prompt(messages, tools, enable_thinking=False if json_object else thinking,
                                      choice=choice, reasoning_effort=template_effort(req.reasoning_effort))
        except ChatTemplateError as e:
            raise APIError(400, f"the chat template could not render these messages: {e}", param="messages") from None
        if json_object:
            check_json_prompt(chat, "response_format")
        admit(engine, chat.ids, context_exceeded_openai)
        params = chat.constrain(sampling_params(max_tokens=req.max_completion_tokens or req.max_tokens,
                                 prompt_tokens=len(chat.ids), context=engine.context_length,
                                 temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                                 seed=req.seed, stop=req.stops(), ignore_eos=req.ignore_eos,
                                 json_object=json_object, json_schema=json_schema))
        parser = chat.parser(stream_calls=req.stream)
        ident = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        events = engine.stream(chat.ids, params)
        if req.stream:
            include_usage = bool((req.stream_options or {}).get("include_usage"))
            return StreamingResponse(_stream(engine, ident, events, parser, include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return JSONResponse(await _complete(engine, ident, while_connected(request, events), parser))

    @r.post("/v1/completions", openapi_extra=body_doc(CompletionRequest, model_ids))
    async def completions(request: Request):
        req = await read_body(request, CompletionRequest)
        req.check(model_ids, engine)
        ids = engine.tokenizer.encode(req.prompt, add_special_tokens=True)
        admit(engine, ids, context_exceeded_openai)
        params = sampling_params(max_tokens=req.max_tokens, prompt_tokens=len(ids), context=engine.context_length,
                                 temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                                 seed=req.seed, stop=req.stops(), ignore_eos=req.ignore_eos)
        ident, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        events = engine.stream(ids, params)

        def body(text: str, finish: str | None, usage: dict | None = None) -> dict:
            choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": finish}
            out = {"id": ident, "object": "text_completion", "created": created, "model": engine.model_id,
                   "choices": [choice] if usage is None or text or finish else []}
            return {**out, "usage": usage} if usage is not None else out

        if not req.stream:
            text, last = await _text_of(while_connected(request, events))
            return JSONResponse(body(text, last.finish_reason, _usage(last)))
        include_usage = bool((req.stream_options or {}).get("include_usage"))

        async def chunks() -> AsyncIterator[str]:
            last = None
            try:
                async for ev in paced(events):
                    if ev is None:
                        yield ": keep-alive\n\n"
                        continue
                    last = ev
                    if ev.text or ev.finish_reason:
                        yield sse(body(ev.text, ev.finish_reason))
            except Exception as e:
                yield sse(stream_error(e).openai_body())
                return
            if include_usage:
                yield sse(body("", None, _usage(last)))
            yield sse("[DONE]")

        return StreamingResponse(chunks(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    return r


async def _text_of(events: AsyncIterator) -> tuple[str, Any]:
    parts, last = [], None
    async for ev in events:
        parts.append(ev.text)
        last = ev
    return "".join(parts), last


async def _complete(engine: ServingEngine, ident: str, events: AsyncIterator, parser: OutputParser) -> dict:
    parts, last = await collect(events, parser)
    text = "".join(p.text for p in parts if p.kind == "text")
    reasoning = "".join(p.text for p in parts if p.kind == "reasoning")
    calls = [p.call for p in parts if p.kind == "tool_call"]
    message: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [{"id": _call_id(), "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments_json}} for c in calls]
    return {"id": ident, "object": "chat.completion", "created": int(time.time()), "model": engine.model_id,
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": "tool_calls" if calls else last.finish_reason}],
            "usage": _usage(last, parser.reasoning_tokens)}


async def _stream(engine: ServingEngine, ident: str, events: AsyncIterator, parser: OutputParser,
                  include_usage: bool) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(delta: dict | None, finish: str | None = None, usage: dict | None = None) -> str:
        body = {"id": ident, "object": "chat.completion.chunk", "created": created, "model": engine.model_id,
                "choices": [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None,
                                                      "finish_reason": finish}]}
        if usage is not None:
            body["usage"] = usage
        return sse(body)

    yield chunk({"role": "assistant", "content": ""})
    calls, last = 0, None
    try:
        async for ev in paced(events):
            if ev is None:
                yield ": keep-alive\n\n"  # an SSE comment: clients ignore it, proxies and timeouts see traffic
                continue
            last = ev
            for p in parser.push(ev.text, len(ev.token_ids)) + (parser.finish() if ev.finish_reason else []):
                if p.kind == "text":
                    yield chunk({"content": p.text})
                elif p.kind == "reasoning":
                    yield chunk({"reasoning_content": p.text})
                elif p.kind == "call_start":  # the call's arguments follow as they form
                    yield chunk({"tool_calls": [{"index": calls, "id": _call_id(), "type": "function",
                                                 "function": {"name": p.call.name, "arguments": ""}}]})
                elif p.kind == "call_delta":
                    yield chunk({"tool_calls": [{"index": calls, "function": {"arguments": p.text}}]})
                else:
                    if not p.streamed:
                        call = {"name": p.call.name, "arguments": p.call.arguments_json}
                        yield chunk({"tool_calls": [{"index": calls, "id": _call_id(), "type": "function",
                                                     "function": call}]})
                    calls += 1
    except Exception as e:  # the status line is long sent: the error goes in the stream, in the API's shape
        yield sse(stream_error(e).openai_body())
        return
    yield chunk({}, "tool_calls" if calls else last.finish_reason)
    if include_usage:
        yield chunk(None, usage=_usage(last, parser.reasoning_tokens))
    yield sse("[DONE]")


def _usage(ev, reasoning_tokens: int = 0) -> dict:
    return {"prompt_tokens": ev.prompt_tokens, "completion_tokens": ev.completion_tokens,
            "total_tokens": ev.prompt_tokens + ev.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": ev.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": reasoning_tokens}}


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _tools(req: ChatRequest) -> list[dict] | None:
    if not req.tools:
        return None
    for i, tool in enumerate(req.tools):
        if tool.get("type", "function") != "function" or not isinstance(tool.get("function"), dict):
            raise APIError(400, f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", param=f"tools.{i}")
    check_tool_schemas(req.tools, lambda t: t["function"].get("name"), lambda t: t["function"].get("parameters"))
    return req.tools


_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def _message(m: dict[str, Any], i: int) -> dict[str, Any]:
    """One OpenAI message in the shape chat templates expect."""
    role = _ROLES.get(m.get("role"))
    if role is None:
        raise APIError(400, f"messages[{i}].role must be one of {', '.join(_ROLES)}, got {m.get('role')!r}",
                       param=f"messages.{i}.role")
    out: dict[str, Any] = {"role": role, "content": text_content(m.get("content"), f"messages.{i}")}
    if role == "assistant" and m.get("tool_calls"):
        out["tool_calls"] = [_tool_call(c, i) for c in m["tool_calls"]]
    if role == "tool":
        out["tool_call_id"] = m.get("tool_call_id")
        if m.get("name"):
            out["name"] = m["name"]
    return out


def _tool_call(call: Any, i: int) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise APIError(400, f"messages[{i}].tool_calls: each needs function.name", param=f"messages.{i}.tool_calls")
    args = fn.get("arguments") or "{}"
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            raise APIError(400, f"messages[{i}].tool_calls: arguments of {fn['name']} are not valid JSON",
                           param=f"messages.{i}.tool_calls") from None
    return {"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}}
