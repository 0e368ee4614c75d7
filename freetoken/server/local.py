"""An app served on an ephemeral loopback port from a thread of this process: for benchmarks and tests that talk
to a real uvicorn without a second process."""

from __future__ import annotations

import socket
import threading
import time


def serve_in_thread(app, timeout_s: float = 30) -> tuple[str, object, threading.Thread]:
    """Serves the ASGI `app` on 127.0.0.1 at a free port; returns (base url, uvicorn server, its thread). Stop it
    with `server.should_exit = True` and join the thread."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the in-process server did not start")
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}", server, thread
