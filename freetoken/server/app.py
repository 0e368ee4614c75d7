"""The HTTP app: `create_app(engine, settings)` mounts the OpenAI and Anthropic routes, health and stats, the API
key check, and the error handlers that answer every failure in the caller's protocol (Anthropic's shape under
/v1/messages, OpenAI's elsewhere), so bad input never becomes a 500 and never takes the server down.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import time
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from freetoken.engine.batching import KVCacheFull
from freetoken.errors import FreeTokenError
from freetoken.server import anthropic_api, openai_api, responses_api
from freetoken.server.engine import ContextLengthExceeded, Saturated, ServingEngine
from freetoken.server.errors import APIError, context_exceeded_anthropic, context_exceeded_openai
from freetoken.server.requests import MAX_BODY_BYTES, ClientDisconnected, body_doc, read_body
from freetoken.units import parse_bytes

log = logging.getLogger(__name__)
OPEN_PATHS = frozenset({"/health"})  # answered without the API key (load balancers, `ft ask` waiting)


@dataclass(slots=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 1919
    api_key: str | None = None
    model_aliases: frozenset[str] = field(default_factory=frozenset)  # other names requests may use
    record_dir: str | None = None  # write every answered API request there as a trace (ft serve --record)


def create_app(engine: ServingEngine, settings: ServerSettings | None = None) -> FastAPI:
    settings = settings or ServerSettings()
    app = FastAPI(title="freetoken", version="0.1", docs_url=None, redoc_url=None)
    model_ids = {engine.model_id, *settings.model_aliases}
    app.include_router(openai_api.router(engine, model_ids))
    app.include_router(anthropic_api.router(engine, model_ids))
    app.include_router(responses_api.router(engine, model_ids))

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": engine.model_id}

    @app.get("/v1/stats")
    async def stats() -> dict:
        return engine.stats()

    @app.post("/admin/expert-cache", openapi_extra=body_doc(ResizeRequest))
    async def expert_cache(request: Request) -> dict:
        """Resizes the device expert cache while serving (between two batch steps; no weights reloaded)."""
        nbytes = parse_bytes((await read_body(request, ResizeRequest)).size)  # a bad size: FreeTokenError → 400
        return await asyncio.wrap_future(engine.control(lambda: engine.resize_expert_cache(nbytes)))

    @app.post("/admin/expert-pin", openapi_extra=body_doc(PinRequest))
    async def expert_pin(request: Request) -> dict:
        """Keeps one MoE layer's experts on the device (copied in now, never evicted), or releases them."""
        body = await read_body(request, PinRequest)
        return await asyncio.wrap_future(engine.control(lambda: engine.pin_layer(body.layer, body.pinned)))

    @app.post("/admin/kv-cache", openapi_extra=body_doc(ResizeRequest))
    async def kv_cache(request: Request) -> dict:
        """Resizes the KV pool while serving (between two batch steps; running requests keep their tokens)."""
        nbytes = parse_bytes((await read_body(request, ResizeRequest)).size)
        return await asyncio.wrap_future(engine.control(lambda: engine.resize_kv_cache(nbytes)))

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(prometheus_text(engine.stats()), media_type="text/plain; version=0.0.4")

    if settings.record_dir:
        from freetoken.server.record import RecordMiddleware, TraceRecorder

        app.add_middleware(RecordMiddleware, recorder=TraceRecorder(settings.record_dir, engine.model_id))
    app.add_middleware(_Gate, api_key=settings.api_key)
    app.add_middleware(_RequestLog, activity=engine.activity)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return _error(request, e)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        message = f"no route {request.method} {request.url.path}" if e.status_code in (404, 405) else str(e.detail)
        return _error(request, APIError(e.status_code, message))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        return _error(request, APIError(400, f"invalid request: {e.errors()[0]['msg']}"))

    @app.exception_handler(ContextLengthExceeded)
    async def too_long(request: Request, e: ContextLengthExceeded):
        exceeded = context_exceeded_anthropic if _anthropic(request) else context_exceeded_openai
        return _error(request, exceeded(e.prompt_tokens, e.limit))

    @app.exception_handler(Saturated)
    @app.exception_handler(KVCacheFull)
    async def saturated(request: Request, e: Saturated | KVCacheFull):
        return _error(request, APIError(503, str(e)))

    @app.exception_handler(ClientDisconnected)
    async def gone(request: Request, e: ClientDisconnected):  # nobody reads this; no traceback in the log
        return JSONResponse({"error": {"message": "client disconnected", "type": "cancelled"}}, status_code=499)

    @app.exception_handler(FreeTokenError)
    async def engine_error(request: Request, e: FreeTokenError):
        return _error(request, APIError(400, str(e)))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception):
        log.exception("unexpected error in %s %s", request.method, request.url.path)
        return _error(request, APIError(500, f"internal error: {type(e).__name__}: {e}"))

    return app


class PinRequest(BaseModel):
    layer: int
    pinned: bool = True


class ResizeRequest(BaseModel):
    size: str  # bytes with a unit, as --expert-cache takes them: "8GiB", "512MiB", "0"


class _RequestLog:
    """One log line per API request when its answer has been sent (streams included): method, path with its query,
    status, seconds. Polled routes (/health, /v1/stats, /metrics) stay out of the log."""

    QUIET = frozenset({"/health", "/v1/stats", "/metrics"})

    def __init__(self, app, activity):
        self.app, self.activity = app, activity

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in self.QUIET:
            await self.app(scope, receive, send)
            return
        started, status = time.perf_counter(), [0]

        async def logged_send(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                query = scope.get("query_string", b"").decode("latin-1")
                path, seconds = scope["path"] + (f"?{query}" if query else ""), time.perf_counter() - started
                log.info("%s %s %d in %.2f s", scope["method"], path, status[0], seconds)
                self.activity.answered(scope["method"], path, status[0], seconds)

        await self.app(scope, receive, logged_send)


class _Gate:
    """Checks the API key and the declared body size before a request reaches a route. Plain ASGI, not
    `BaseHTTPMiddleware`: that wrapper hides a client's disconnect from the routes, which poll for it."""

    def __init__(self, app, api_key: str | None):
        self.app, self.api_key = app, api_key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            request = Request(scope)
            error = None
            size = request.headers.get("content-length", "0")
            if self.api_key and request.url.path not in OPEN_PATHS and not _authorized(request, self.api_key):
                error = APIError(401, "invalid or missing API key: send it as `Authorization: Bearer KEY` or "
                                      "`x-api-key: KEY`")
            elif request.url.path.startswith("/admin") and not self.api_key and not _from_loopback(request):
                error = APIError(403, "admin routes answer only on loopback unless the server has an API key")
            elif size.isdigit() and int(size) > MAX_BODY_BYTES:
                error = APIError(413, f"the request body has {int(size)} bytes; this server takes at most "
                                      f"{MAX_BODY_BYTES}")
            if error is not None:
                await _error(request, error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _from_loopback(request: Request) -> bool:
    try:
        return request.client is not None and ipaddress.ip_address(request.client.host).is_loopback
    except ValueError:
        return False


def _anthropic(request: Request) -> bool:
    return request.url.path.startswith("/v1/messages")


def _error(request: Request, e: APIError) -> JSONResponse:
    body = e.anthropic_body() if _anthropic(request) else e.openai_body()
    return JSONResponse(body, status_code=e.status)


def _authorized(request: Request, key: str) -> bool:
    given = request.headers.get("x-api-key") or request.headers.get("authorization", "").removeprefix("Bearer ")
    return hmac.compare_digest(given.strip().encode(), key.encode())


def prometheus_text(stats: dict, prefix: str = "freetoken") -> str:
    """Every number in the stats JSON as a Prometheus sample named by its path (`freetoken_requests_completed`);
    the labels say which model."""
    lines = []

    def walk(value, name: str) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(inner, f"{name}_{key}")
        elif isinstance(value, bool):
            lines.append(f"{name} {int(value)}")
        elif isinstance(value, int | float):
            lines.append(f"{name} {value}")

    walk({k: v for k, v in stats.items() if k != "model"}, prefix)
    model = str(stats.get("model", "")).replace('"', "'")
    return "".join(f'{n}{{model="{model}"}} {v}\n' for n, v in (line.rsplit(" ", 1) for line in lines))
