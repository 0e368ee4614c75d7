"""What every protocol's handler shares: reading the JSON body, turning its sampling fields into `SamplingParams`,
checking tool schemas, and pacing a stream of generation events with keep-alives.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from freetoken.engine.generator import GenerationEvent
from freetoken.engine.json_schema import SchemaError, compile_schema
from freetoken.engine.sampling import SamplingParams
from freetoken.server.engine import ContextLengthExceeded, Saturated, ServingEngine
from freetoken.server.errors import APIError

Model = TypeVar("Model", bound=BaseModel)
DEFAULT_MAX_TOKENS = 4096  # when the request names none: a reply, not the rest of the context
MAX_BODY_BYTES = 64 * 2**20  # far past any context this engine holds
KEEPALIVE_S = 10.0  # seconds without an event before the stream sends a keep-alive (long prefills)


async def read_body(request: Request, model: type[Model]) -> Model:
    """The request's JSON validated against `model`; a 400 naming the first problem otherwise."""
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:  # a chunked body carries no length header for the middleware to check
        raise APIError(413, f"the request body has {len(raw)} bytes; this server takes at most {MAX_BODY_BYTES}")
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise APIError(400, f"the request body is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})") \
            from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "body"
        raise APIError(400, f"{where}: {err['msg']}", param=where) from None


def body_doc(model: type[BaseModel], served: set[str] | None = None) -> dict:
    """OpenAPI for a route that reads its JSON body itself (to answer bad bodies in its protocol's shape): the
    schema clients, docs and the fuzz tests see, with the model names this server answers to."""
    schema = model.model_json_schema()
    if served is not None:
        schema["properties"]["model"]["enum"] = sorted(served)
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def text_content(content: Any, where: str) -> str:
    """An OpenAI message's content (a string, or a list of text parts) as one string; other parts (images, audio,
    files) get a 400 naming them. `where` is the field's dotted path, e.g. `messages.3`."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content must be a string or a list of content parts", param=f"{where}.content")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("text", "input_text", "output_text"):
            raise APIError(400, f"{where}: {kind} content is not supported by this model (text only)",
                           param=f"{where}.content")
        texts.append(str(part.get("text", "")))
    return "".join(texts)


def message_schema(roles: list[str], part_types: list[str]) -> dict:
    """JSON Schema of one chat message: a role and text content (a string or a list of parts)."""
    part = {"type": "object", "required": ["type", "text"],
            "properties": {"type": {"enum": part_types}, "text": {"type": "string"}}}
    content = {"anyOf": [{"type": "string"}, {"type": "array", "items": part}]}
    return {"type": "object", "required": ["role", "content"],
            "properties": {"role": {"enum": roles}, "content": content}}


def admit(engine: ServingEngine, prompt_ids: list[int], exceeded: Callable[[int, int], APIError]) -> None:
    """Checks the prompt fits the context and the queue has room; `exceeded` words the context error."""
    try:
        engine.check_fits(prompt_ids)
        engine.check_admission()
    except ContextLengthExceeded as e:
        raise exceeded(e.prompt_tokens, e.limit) from None
    except Saturated as e:
        raise APIError(429, str(e)) from None


def check_model(model: str, served: set[str], engine: ServingEngine) -> None:
    """OpenAI's 404 for a model this server does not serve."""
    if model not in served:
        raise APIError(404, f"The model `{model}` does not exist; this server serves `{engine.model_id}`",
                       param="model", code="model_not_found")


def wants_json(response_format: Any, param: str) -> tuple[bool, str]:
    """Whether an OpenAI `response_format` (chat) or `text.format` (Responses) asks for a JSON object, and the
    schema it must satisfy (compact JSON text, "" for none): `text` or absent → no; `json_object` → any object;
    `json_schema` → an object valid under its schema (chat: `json_schema.schema`; Responses: `schema`; what the
    constraint enforces: freetoken/engine/json_schema.py); anything else, or an unreadable schema → 400."""
    if response_format is None:
        return False, ""
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind not in ("text", "json_object", "json_schema"):
        raise APIError(400, f"{param} must be an object with type text, json_object or json_schema", param=param)
    if kind != "json_schema":
        return kind != "text", ""
    holder = response_format.get("json_schema", response_format)
    schema = holder.get("schema") if isinstance(holder, dict) else None
    if schema is None:
        return True, ""  # a name without a schema: any object
    try:
        text = json.dumps(schema, separators=(",", ":"), sort_keys=True)
        root = compile_schema(text)
    except (TypeError, SchemaError) as e:
        raise APIError(400, f"{param}: unusable JSON schema: {e}", param=param) from None
    if root.types is not None and "object" not in root.types:
        raise APIError(400, f"{param}: the schema's top level must be an object (type: object)", param=param)
    return True, text


def check_json_prompt(chat: Any, param: str) -> None:
    """A JSON reply cannot start inside a reasoning block the template opened whatever was asked."""
    if chat.in_reasoning:
        raise APIError(400, "this model's chat template opens a reasoning block the reply must close first, so it "
                            f"cannot be constrained to a JSON object; drop {param}", param=param)


def sampling_params(*, max_tokens: int | None, prompt_tokens: int, context: int, temperature: float | None,
                    top_p: float | None, top_k: int | None, min_p: float | None, seed: int | None,
                    stop: list[str], default_temperature: float = 1.0, ignore_eos: bool = False,
                    json_object: bool = False, json_schema: str = "") -> SamplingParams:
    """A reply may use what the prompt leaves of the context; a larger `max_tokens` is cut to that."""
    if max_tokens is not None and max_tokens < 1:
        raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    room = context - prompt_tokens
    wanted = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    try:
        return SamplingParams(max_tokens=max(1, min(wanted, room)),
                              temperature=default_temperature if temperature is None else temperature,
                              top_p=1.0 if top_p is None else top_p, top_k=top_k or 0, min_p=min_p or 0.0,
                              seed=seed, stop=tuple(stop), ignore_eos=ignore_eos, json_object=json_object,
                              json_schema=json_schema)
    except ValueError as e:
        raise APIError(400, str(e)) from None


def check_tool_schemas(tools: list[dict], name_of: Callable[[dict], Any], schema_of: Callable[[dict], Any],
                       param: str = "tools") -> None:
    for i, tool in enumerate(tools):
        name = name_of(tool)
        if not isinstance(name, str) or not name:
            raise APIError(400, f"{param}[{i}] has no name", param=f"{param}.{i}")
        schema = schema_of(tool)
        if schema is not None and (not isinstance(schema, dict) or schema.get("type", "object") != "object"):
            raise APIError(400, f"{param}[{i}] ({name}): the parameters schema must be a JSON Schema object "
                                "(type: object)", param=f"{param}.{i}")


async def paced(events: AsyncIterator[GenerationEvent], keepalive_s: float = KEEPALIVE_S
                ) -> AsyncIterator[GenerationEvent | None]:
    """The events, with None whenever `keepalive_s` passes without one (the caller sends a keep-alive). The
    pending read is never cancelled: cancelling it would cancel the generation."""
    pending = asyncio.ensure_future(anext(events))
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=keepalive_s)
            if not done:
                yield None
                continue
            try:
                ev = pending.result()
            except StopAsyncIteration:
                return
            yield ev
            pending = asyncio.ensure_future(anext(events))
    finally:  # the client left (or the stream ended): a pending read is cancelled, which cancels the generation
        if not pending.done():
            pending.cancel()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await pending
        await events.aclose()


class ClientDisconnected(Exception):
    """The client of a non-streamed reply went away; its generation was cancelled."""


async def while_connected(request: Request, events: AsyncIterator[GenerationEvent],
                          poll_s: float = 0.5) -> AsyncIterator[GenerationEvent]:
    """The events of a reply sent whole at the end, checking every `poll_s` of silence whether the client is
    still there; if not, the generation is cancelled (its KV freed) and ClientDisconnected raised."""
    checked = time.monotonic()
    async for ev in paced(events, keepalive_s=poll_s):
        if ev is not None:
            yield ev
        if time.monotonic() - checked >= poll_s:  # tokens may keep coming: check on a clock, not on silence
            checked = time.monotonic()
            if await request.is_disconnected():
                raise ClientDisconnected()


async def collect(events: AsyncIterator[GenerationEvent], parser) -> tuple[list, GenerationEvent]:
    """A whole reply: every part the parser makes of it, and its last event (finish reason, token counts)."""
    parts, last = [], None
    async for ev in events:
        parts += parser.push(ev.text, len(ev.token_ids))
        last = ev
    return parts + parser.finish(), last


def sse(data: Any, event: str | None = None) -> str:
    body = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return (f"event: {event}\n" if event else "") + f"data: {body}\n\n"


# What the protocols' reasoning settings mean for templates that take an effort (gpt-oss: "Reasoning: low" in
# its system message); "none" and "minimal" are as low as such a model goes.
_EFFORTS = {"none": "low", "minimal": "low", "low": "low", "medium": "medium", "high": "high", "xhigh": "high"}


def template_effort(effort: str | None) -> str | None:
    """An OpenAI reasoning effort as a template's `reasoning_effort`, None (the template's default) if unset or
    unknown."""
    return _EFFORTS.get(effort) if isinstance(effort, str) else None


def thinking_effort(thinking: dict | None) -> str | None:
    """Anthropic's `thinking` as a template's `reasoning_effort`: disabled → low; enabled by its token budget."""
    if not isinstance(thinking, dict):
        return None
    if thinking.get("type") != "enabled":
        return "low"
    budget = thinking.get("budget_tokens")
    if not isinstance(budget, int):
        return None
    return "low" if budget < 4096 else "medium" if budget < 16384 else "high"

