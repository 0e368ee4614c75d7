"""A real server for tests: uvicorn on an ephemeral loopback port, in a thread of the test process."""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass
class RunningServer:
    url: str
    engine: object
    server: object
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.engine.close()


def start_uvicorn(app) -> tuple[str, object, threading.Thread]:
    from freetoken.server.local import serve_in_thread

    return serve_in_thread(app)


def start_server(lm, model_id: str, **settings) -> RunningServer:
    """`create_app` over a serving engine for `lm`; `settings` are ServerSettings fields plus max_queue,
    max_seq_len, kv_tokens and speculative for the engine."""
    from freetoken.server.app import ServerSettings, create_app
    from freetoken.server.engine import ServingEngine

    engine = ServingEngine(lm, model_id, max_queue=settings.pop("max_queue", 64),
                           max_seq_len=settings.pop("max_seq_len", None), kv_tokens=settings.pop("kv_tokens", None),
                           speculative=settings.pop("speculative", False))
    url, server, thread = start_uvicorn(create_app(engine, ServerSettings(**settings)))
    return RunningServer(url, engine, server, thread)
