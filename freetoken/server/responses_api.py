"""OpenAI Responses API: `POST /v1/responses` (streamed or not) with `previous_response_id`.

Input items (messages, `function_call`, `function_call_output`) become chat-template messages; the reply's
parts become output items (`reasoning`, `message` with `output_text`, `function_call`). Each stored response
keeps the whole conversation up to it (input plus output), so a request naming `previous_response_id` continues
from there; the store is bounded (oldest dropped first) and lives as long as the server.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from freetoken.errors import ChatTemplateError
from freetoken.server.engine import ServingEngine
from freetoken.server.errors import APIError, context_exceeded_openai, stream_error
from freetoken.server.output import OutputParser, Part
from freetoken.server.requests import (
    admit,
    body_doc,
    check_json_prompt,
    check_model,
    check_tool_schemas,
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

STORE_SIZE = 1024  # responses kept for previous_response_id

log = logging.getLogger(__name__)


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    store: bool = True
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    ignore_eos: bool = False  # an extension (as in chat completions): generate max_output_tokens; ft eval uses it


class ResponseStore:
    """response id → the conversation (template messages) through that response; least recently used dropped."""

    def __init__(self, size: int = STORE_SIZE):
        self.size, self._items = size, OrderedDict()

    def get(self, ident: str) -> list[dict]:
        if ident not in self._items:
            raise APIError(404, f"Previous response with id '{ident}' not found.", param="previous_response_id")
        self._items.move_to_end(ident)
        return self._items[ident]

    def put(self, ident: str, conversation: list[dict]) -> None:
        self._items[ident] = conversation
        while len(self._items) > self.size:
            self._items.popitem(last=False)


def router(engine: ServingEngine, model_ids: set[str], store: ResponseStore | None = None) -> APIRouter:
    r = APIRouter()
    store = store or ResponseStore()

    @r.post("/v1/responses", openapi_extra=body_doc(ResponsesRequest, model_ids))
    async def responses(request: Request):
        req = await read_body(request, ResponsesRequest)
        check_model(req.model, model_ids, engine)
        history = list(store.get(req.previous_response_id)) if req.previous_response_id else []
        new = _input_messages(req.input)
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        conversation = [m for m in history if m["role"] != "system"] + new
        tools = _tools(req)
        choice = openai_choice(req.tool_choice, [t["function"]["name"] for t in tools or []], responses=True,
                               parallel=req.parallel_tool_calls)
        effort = (req.reasoning or {}).get("effort")
        thinking = None if effort is None else effort not in ("none", "minimal")
        if req.text is not None and not isinstance(req.text, dict):
            raise APIError(400, "text must be an object", param="text")
        json_object, json_schema = wants_json((req.text or {}).get("format"), "text.format")
        try:
            chat = engine.chat_prompt(system + conversation, tools, enable_thinking=False if json_object else thinking,
                                      choice=choice, reasoning_effort=template_effort(effort))
        except ChatTemplateError as e:
            raise APIError(400, f"the chat template could not render this input: {e}", param="input") from None
        if json_object:
            check_json_prompt(chat, "text.format")
        ids = chat.ids
        admit(engine, ids, context_exceeded_openai)
        params = chat.constrain(sampling_params(max_tokens=req.max_output_tokens, prompt_tokens=len(ids),
                                 context=engine.context_length, temperature=req.temperature, top_p=req.top_p,
                                 top_k=None, min_p=None, seed=None, stop=[], json_object=json_object,
                                 json_schema=json_schema, ignore_eos=req.ignore_eos))
        parser = chat.parser(stream_calls=req.stream)
        reply = _Reply(engine, req, f"resp_{uuid.uuid4().hex}", store if req.store else None, conversation, parser)
        events = engine.stream(ids, params)
        if req.stream:
            return StreamingResponse(reply.stream(events), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        async for ev in while_connected(request, events):
            reply.add(parser.push(ev.text, len(ev.token_ids)), ev)
        reply.add(parser.finish(), None)
        return JSONResponse(reply.finish())

    return r


class _Reply:
    """The output items of one response as they form, and the response object around them."""

    def __init__(self, engine: ServingEngine, req: ResponsesRequest, ident: str, store: ResponseStore | None,
                 conversation: list[dict], parser: OutputParser):
        self.engine, self.req, self.ident, self.store, self.conversation = engine, req, ident, store, conversation
        self.parser = parser  # its reasoning-token count goes into the usage
        self.items: list[dict] = []
        self.last = None
        self.created = int(time.time())

    def add(self, parts: list[Part], ev) -> list[tuple[str, dict]]:
        """Appends the parts to the output items; returns (event type, payload) for a stream."""
        if ev is not None:
            self.last = ev
        events = []
        for p in parts:
            # a call streamed as it forms opens its item at call_start and closes it at its tool_call; a whole
            # call does all three at once
            if p.kind == "call_start":
                events += self._call_opened(p.call.name)
                continue
            if p.kind == "call_delta":
                events += self._call_arguments(p.text)
                continue
            if p.kind == "tool_call":
                if not p.streamed:
                    events += self._call_opened(p.call.name) + self._call_arguments(p.call.arguments_json)
                events += self._call_closed()
                continue
            kind = "reasoning" if p.kind == "reasoning" else "message"
            if not self.items or self.items[-1]["type"] != kind or self.items[-1].get("status") == "completed":
                events += self._close_open()
                item = _new_item(kind)
                self.items.append(item)
                index = len(self.items) - 1
                events.append(("response.output_item.added", {"output_index": index, "item": item}))
                part = item["content"][0] if kind == "message" else None
                if part is not None:
                    events.append(("response.content_part.added", {"output_index": index, "item_id": item["id"],
                                                                   "content_index": 0, "part": {**part}}))
            item, index = self.items[-1], len(self.items) - 1
            if kind == "message":
                item["content"][0]["text"] += p.text
                events.append(("response.output_text.delta", {"output_index": index, "item_id": item["id"],
                                                              "content_index": 0, "delta": p.text}))
            else:
                item["summary"][0]["text"] += p.text
                events.append(("response.reasoning_summary_text.delta", {"output_index": index,
                                                                         "item_id": item["id"], "summary_index": 0,
                                                                         "delta": p.text}))
        return events

    def _call_opened(self, name: str) -> list[tuple[str, dict]]:
        events = self._close_open()  # the message before the call is done
        self.items.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex[:24]}", "call_id": _call_id(),
                           "name": name, "arguments": "", "status": "in_progress"})
        return events + [("response.output_item.added", {"output_index": len(self.items) - 1,
                                                         "item": {**self.items[-1]}})]

    def _call_arguments(self, text: str) -> list[tuple[str, dict]]:
        item = self.items[-1]
        item["arguments"] += text
        return [("response.function_call_arguments.delta", {"output_index": len(self.items) - 1,
                                                            "item_id": item["id"], "delta": text})]

    def _call_closed(self) -> list[tuple[str, dict]]:
        item, index = self.items[-1], len(self.items) - 1
        item["status"] = "completed"
        return [("response.function_call_arguments.done", {"output_index": index, "item_id": item["id"],
                                                           "arguments": item["arguments"]}),
                ("response.output_item.done", {"output_index": index, "item": item})]

    def _close_open(self) -> list[tuple[str, dict]]:
        if not self.items or self.items[-1].get("status") == "completed":
            return []
        item, index = self.items[-1], len(self.items) - 1
        item["status"] = "completed"
        events = []
        if item["type"] == "message":
            part = item["content"][0]
            events += [("response.output_text.done", {"output_index": index, "item_id": item["id"],
                                                      "content_index": 0, "text": part["text"]}),
                       ("response.content_part.done", {"output_index": index, "item_id": item["id"],
                                                       "content_index": 0, "part": part})]
        return events + [("response.output_item.done", {"output_index": index, "item": item})]

    def finish(self) -> dict:
        self._close_open()
        if self.store is not None:
            self.store.put(self.ident, self.conversation + _as_messages(self.items))
        return self.body("completed" if self.last.finish_reason != "length" else "incomplete")

    def body(self, status: str) -> dict:
        last = self.last
        usage = None if last is None else {
            "input_tokens": last.prompt_tokens, "input_tokens_details": {"cached_tokens": last.cached_tokens},
            "output_tokens": last.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": self.parser.reasoning_tokens},
            "total_tokens": last.prompt_tokens + last.completion_tokens}
        req = self.req
        return {"id": self.ident, "object": "response", "created_at": self.created, "status": status,
                "model": self.engine.model_id, "output": self.items, "usage": usage, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "previous_response_id": req.previous_response_id, "instructions": req.instructions,
                "temperature": req.temperature, "top_p": req.top_p, "max_output_tokens": req.max_output_tokens,
                "tools": req.tools or [], "tool_choice": req.tool_choice or "auto",
                "parallel_tool_calls": req.parallel_tool_calls is not False,
                "text": {"format": {"type": "text"}}, "reasoning": req.reasoning, "store": req.store,
                "metadata": req.metadata or {}}

    async def stream(self, events: AsyncIterator) -> AsyncIterator[str]:
        parser = self.parser
        seq = 0

        def event(kind: str, payload: dict) -> str:
            nonlocal seq
            seq += 1
            return sse({"type": kind, "sequence_number": seq - 1, **payload}, kind)

        yield event("response.created", {"response": self.body("in_progress")})
        yield event("response.in_progress", {"response": self.body("in_progress")})
        try:
            async for ev in paced(events):
                if ev is None:
                    yield ": keep-alive\n\n"
                    continue
                for kind, payload in self.add(parser.push(ev.text, len(ev.token_ids)), ev):
                    yield event(kind, payload)
            for kind, payload in self.add(parser.finish(), None) + self._close_open():
                yield event(kind, payload)
        except Exception as e:  # after the status line: the error travels as an event
            err = stream_error(e)
            yield event("error", {"code": err.code, "message": err.message, "param": err.param})
            return
        body = self.finish()
        yield event("response.completed" if body["status"] == "completed" else "response.incomplete",
                    {"response": body})


def _new_item(kind: str) -> dict:
    if kind == "message":
        return {"type": "message", "id": f"msg_{uuid.uuid4().hex[:24]}", "status": "in_progress",
                "role": "assistant", "content": [{"type": "output_text", "text": "", "annotations": []}]}
    return {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex[:24]}", "status": "in_progress",
            "summary": [{"type": "summary_text", "text": ""}]}


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _as_messages(items: list[dict]) -> list[dict]:
    """Output items as the template messages that continue the conversation (reasoning is not replayed)."""
    text = "".join(i["content"][0]["text"] for i in items if i["type"] == "message")
    calls = [{"id": i["call_id"], "type": "function",
              "function": {"name": i["name"], "arguments": _arguments(i["arguments"])}}
             for i in items if i["type"] == "function_call"]
    message = {"role": "assistant", "content": text}
    return [{**message, "tool_calls": calls} if calls else message]


def _arguments(text: str) -> dict | str:
    """A call's arguments for the template; a streamed call the reply's end cut off is replayed as written."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _input_messages(value: str | list[dict]) -> list[dict]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    out: list[dict] = []
    for i, item in enumerate(value):
        kind = item.get("type", "message")
        if kind == "message":
            role = {"developer": "system"}.get(item.get("role"), item.get("role"))
            if role not in ("system", "user", "assistant"):
                raise APIError(400, f"input[{i}].role must be user, assistant, system or developer",
                               param=f"input.{i}.role")
            out.append({"role": role, "content": text_content(item.get("content"), f"input.{i}")})
        elif kind == "function_call":
            try:
                args = json.loads(item.get("arguments") or "{}")
            except json.JSONDecodeError:
                raise APIError(400, f"input[{i}].arguments is not valid JSON", param=f"input.{i}") from None
            call = {"id": item.get("call_id"), "type": "function", "function": {"name": item.get("name"),
                                                                                 "arguments": args}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": output if isinstance(output, str) else json.dumps(output)})
        elif kind == "reasoning":
            continue
        else:
            raise APIError(400, f"input[{i}]: item type {kind!r} is not supported", param=f"input.{i}")
    return out


def _tools(req: ResponsesRequest) -> list[dict] | None:
    if not req.tools:
        return None
    functions = _function_tools(req.tools)
    if not functions:
        return None
    check_tool_schemas(functions, lambda t: t.get("name"), lambda t: t.get("parameters"))
    return [{"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                              "parameters": t.get("parameters") or {"type": "object"}}}
            for t in functions]


def _function_tools(tools: list, where: str = "tools") -> list[dict]:
    """The function tools offered, a `namespace` tool's functions among them (Codex groups its sub-agent tools
    in one; their calls name the function). Hosted tool types (web_search, file_search, …) are left out: this
    server runs none of them, and refusing the request would stop the agent that offered them."""
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "function":
            out.append(tool)
        elif kind == "namespace" and isinstance(tool.get("tools"), list):
            out += _function_tools(tool["tools"], f"{where}.{i}.tools")
        elif not isinstance(kind, str):
            raise APIError(400, f"{where}[{i}]: a tool must be an object with a type", param=f"{where}.{i}")
        else:
            log.info("%s[%d]: %s tools are not run by this server; left out", where, i, kind)
    return out
