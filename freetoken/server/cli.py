"""`ft serve`: load a model and serve the OpenAI and Anthropic APIs; `ft ask`: one question to a running server.

    ft serve [--model M] [--host H] [--port P] [--expert-cache SIZE] [--kv-cache SIZE] [--max-batch N] [--api-key K]
             [--dashboard] [--record DIR] [--no-prefix-cache]
    ft ask [--url URL] [--wait S] PROMPT
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from freetoken.errors import FreeTokenError
from freetoken.loopback import is_loopback
from freetoken.units import parse_bytes

log = logging.getLogger("freetoken.server")
_DEFAULT_URL = "http://127.0.0.1:1919"


def serve(argv: list[str]) -> int:
    from freetoken.engine.commands import _model_args, _speculative_arg

    p = argparse.ArgumentParser(prog="ft serve", description="Serve a model over the OpenAI and Anthropic APIs.")
    _model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, loopback only)")
    p.add_argument("--port", type=int, default=1919, help="port (default 1919)")
    p.add_argument("--kv-cache", default=None, metavar="SIZE",
                   help="KV cache budget shared by all requests (e.g. 2GiB); one request may hold at most that")
    p.add_argument("--max-batch", type=int, default=16,
                   help="requests generated together in each forward (continuous batching; default 16)")
    p.add_argument("--api-key", default=os.environ.get("FREETOKEN_API_KEY"),
                   help="require this key (Authorization: Bearer or x-api-key); needed to bind beyond loopback "
                        "(default: $FREETOKEN_API_KEY)")
    p.add_argument("--served-name", action="append", default=[], metavar="NAME",
                   help="another model name requests may use (repeatable)")
    p.add_argument("--dashboard", action="store_true", help="show the live dashboard (`ft top`) in this terminal")
    p.add_argument("--record", metavar="DIR", default=None,
                   help="write every API request to DIR as an agent trace for `ft eval --trace` (opt-in: the files "
                        "hold the prompts)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="recompute every prompt whole (no reuse across requests; for measuring what reuse saves)")
    _speculative_arg(p)
    a = p.parse_args(argv)
    if not is_loopback(a.host) and not a.api_key:
        raise FreeTokenError(f"binding {a.host} exposes the server beyond this machine; give --api-key KEY "
                             "(or bind 127.0.0.1)")
    if a.record:
        _check_record_dir(Path(a.record))
    import uvicorn

    from freetoken.server.gc_pauses import thaw
    from freetoken.server.loading import LoadingApp

    model_id = _model_id(a.model)
    loading = LoadingApp(model_id)
    server = uvicorn.Server(uvicorn.Config(loading, host=a.host, port=a.port, log_level="warning", lifespan="off",
                                           timeout_keep_alive=75))
    state: dict = {}
    threading.Thread(target=_load_then_serve, args=(a, model_id, loading, server, state), daemon=True).start()
    try:
        if a.dashboard:
            _run_with_dashboard(server, f"http://{a.host}:{a.port}", a.api_key)
        else:
            server.run()
    except SystemExit:  # uvicorn exits when it cannot bind; say so in one line below
        pass
    except KeyboardInterrupt:  # uvicorn shut down cleanly on Ctrl-C, then re-raised it
        pass
    finally:
        if "engine" in state:
            state["engine"].close()
        if state.get("frozen"):
            thaw()  # collectable again at exit (extension modules report frozen objects as leaks)
    if "error" in state:
        raise FreeTokenError(state["error"])
    if not server.started:
        raise FreeTokenError(f"could not listen on {a.host}:{a.port} (in use by another server?); pick another "
                             "--port")
    return 0


def _run_with_dashboard(server, url: str, api_key: str | None) -> None:
    """uvicorn in a thread, the dashboard in this terminal; quitting the dashboard stops the server. Log lines
    would tear the screen: they are held while it shows, then printed."""
    from logging.handlers import MemoryHandler

    from freetoken.tui.app import TopApp
    from freetoken.tui.source import HttpStats

    root = logging.getLogger()
    shown, held = root.handlers[:], MemoryHandler(capacity=10_000, flushLevel=logging.CRITICAL + 1)
    root.handlers = [held]
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        TopApp(HttpStats(url, api_key)).run()
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        root.handlers = shown
        for record in held.buffer:
            root.handle(record)


def _load_then_serve(a: argparse.Namespace, model_id: str, loading, server, state: dict) -> None:
    """Loads the model while uvicorn already answers (/health: loading), then hands requests to the real app and
    logs the address: the line scripts wait for. A failed load stops the server with its message."""
    from freetoken.engine.commands import _load
    from freetoken.server.app import ServerSettings, create_app
    from freetoken.server.engine import ServingEngine
    from freetoken.server.gc_pauses import freeze_loaded

    try:
        lm = _load(a, on_progress=loading.progress)
        kv_tokens = None
        if a.kv_cache:
            from freetoken.engine.offload.budget import kv_bytes_per_token

            kv_tokens = parse_bytes(a.kv_cache) // kv_bytes_per_token(lm.args, lm.dtype)
            if kv_tokens < 16:
                raise FreeTokenError(f"--kv-cache {a.kv_cache} holds only {kv_tokens} tokens of this model; "
                                     "give more")
        engine = state["engine"] = ServingEngine(lm, model_id, max_seq_len=kv_tokens, kv_tokens=kv_tokens,
                                                 max_batch=a.max_batch, prefix_cache=not a.no_prefix_cache,
                                                 speculative=a.speculative)
        settings = ServerSettings(a.host, a.port, a.api_key, frozenset(a.served_name), record_dir=a.record)
        app = create_app(engine, settings)
        freeze_loaded()  # what loading left behind stays: later full collections need not scan it
        state["frozen"] = True
        loading.ready(app)
    except Exception as e:  # noqa: BLE001 - every failure ends the server with one line
        message = str(e) if isinstance(e, FreeTokenError) else f"{type(e).__name__}: {e}"
        if not isinstance(e, FreeTokenError):
            log.exception("loading the model failed")
        loading.failed(message)
        state["error"] = message
        server.should_exit = True
        return
    while not server.started and not server.should_exit:
        time.sleep(0.05)
    log.info("serving %s on http://%s:%d (context %d tokens per request)", model_id, a.host, a.port,
             engine.context_length)


def ask(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="ft ask", description="Ask a running `ft serve` one question; prints the "
                                "answer. Waits for the server to come up (it may still be loading its model).")
    p.add_argument("prompt")
    p.add_argument("--url", default=_DEFAULT_URL, help=f"the server (default {_DEFAULT_URL})")
    p.add_argument("--wait", type=float, default=600, help="seconds to wait for the server (default 600)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--api-key", default=os.environ.get("FREETOKEN_API_KEY"))
    a = p.parse_args(argv)
    url = a.url.rstrip("/")
    model = wait_healthy(url, a.wait)
    body = {"model": model, "messages": [{"role": "user", "content": a.prompt}], "max_tokens": a.max_tokens,
            "temperature": 0}
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {a.api_key}"} if a.api_key else {})}
    req = urllib.request.Request(f"{url}/v1/chat/completions", json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(req, timeout=3600) as r:
            reply = json.load(r)
    except urllib.error.HTTPError as e:
        raise FreeTokenError(f"the server answered {e.code}: {e.read().decode(errors='replace')}") from None
    print(reply["choices"][0]["message"]["content"])
    return 0


def wait_healthy(url: str, seconds: float, exited=None) -> str:
    """The served model's name once /health says ok; says on stderr how loading goes, stops at a failed load.
    `exited`: a check that the server's process is gone (one this caller started), raised at once, not waited out."""
    deadline, said, said_at = time.monotonic() + seconds, None, 0.0
    while True:
        if exited is not None:
            exited()
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                return json.load(r)["model"]
        except urllib.error.HTTPError as e:  # 503 while the model loads, or after its load failed
            try:
                body = json.loads(e.read())
            except (json.JSONDecodeError, ValueError):
                body = {}
            if body.get("status") == "error":
                raise FreeTokenError(f"the server at {url} could not load its model: {body.get('message')}") \
                    from None
            share = body.get("progress")
            line = f"waiting for {url} to load {body.get('model', 'its model')}" + \
                (f": {share:.0%} of the weights" if isinstance(share, (int, float)) else "")
            if line != said and time.monotonic() - said_at >= 5:  # a line every few seconds at most
                print(line, file=sys.stderr, flush=True)
                said, said_at = line, time.monotonic()
        except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError, KeyError):
            pass
        if time.monotonic() > deadline:
            raise FreeTokenError(f"no server answered at {url} within {seconds:.0f}s; start one with "
                                 "`ft serve`") from None
        time.sleep(0.5)


def _check_record_dir(path: Path) -> None:
    """--record's folder exists (made here, private) and takes files; before the model loads, not after."""
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        probe = path / f".ft-write-check-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise FreeTokenError(f"--record {path}: cannot write there ({e.strerror}); give a folder you can write to")\
            from None


def _model_id(model: str | None) -> str:
    """The name clients use: the default model's, a repo id as given, or a local path's file/directory name."""
    if model is None:
        from freetoken.engine.sources import DEFAULT_MODEL_FILE

        return DEFAULT_MODEL_FILE.removesuffix(".gguf")
    path = Path(model)
    return path.name.removesuffix(".gguf") if path.exists() else model


def main(verb: str, argv: list[str]) -> int:
    return {"serve": serve, "ask": ask}[verb](argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
