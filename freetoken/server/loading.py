"""The server answers while its model loads: `/health` reports loading (503, so load balancers wait) and every
other route a 503 in its protocol's shape; once the model is in, requests go to the real app.

`ft serve` binds first and loads second, so `ft ask` and agents see a live server with a reason to wait rather
than a refused connection, and a load that fails is reported on /health before the process exits.
"""

from __future__ import annotations

import json
import time


class LoadingApp:
    """An ASGI app that stands in for the real one until `ready(app)` (or `failed(message)`)."""

    def __init__(self, model: str):
        self.model, self.inner, self.error = model, None, None
        self.started = time.monotonic()
        self.tensors = (0, 0)  # (loaded, total) weight tensors, once loading has counted them

    def progress(self, done: int, total: int) -> None:
        """Called by the loader (from its threads) as tensors land."""
        self.tensors = (done, total)

    def ready(self, app) -> None:
        self.inner = app

    def failed(self, message: str) -> None:
        self.error = message

    async def __call__(self, scope, receive, send) -> None:
        if self.inner is not None:
            await self.inner(scope, receive, send)
            return
        if scope["type"] != "http":  # lifespan and websockets: nothing to do until the app exists
            return
        path = scope["path"]
        if path == "/health":
            status = "error" if self.error else "loading"
            body = {"status": status, "model": self.model, "seconds": round(time.monotonic() - self.started, 1)}
            done, total = self.tensors
            if total:  # the share of weight tensors in place (the last steps after them take a moment more)
                body["progress"] = round(done / total, 3)
                body["tensors"] = {"loaded": done, "total": total}
            if self.error:
                body["message"] = self.error
        else:
            message = f"the model is {'not available: ' + self.error if self.error else 'still loading'}; " \
                      "GET /health says when it is ready"
            body = ({"type": "error", "error": {"type": "overloaded_error", "message": message}}
                    if path.startswith("/v1/messages") else
                    {"error": {"message": message, "type": "server_error", "param": None, "code": "model_loading"}})
        payload = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json"), (b"retry-after", b"5"),
                                (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})
