"""`ft top` against real servers on loopback (Pilot): live numbers while a request runs, the resize keys changing
the server's expert cache, and a server that goes away and comes back."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import urllib.request

import pytest
from tui.conftest import offloaded

from freetoken.tui.app import TopApp
from freetoken.tui.panels import ExpertPanel, LogPanel, SessionsPanel, ThroughputPanel, TrafficPanel, VramPanel
from freetoken.tui.source import HttpStats
from support.servers import start_server

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _chat(url: str, max_tokens: int) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}
    req = urllib.request.Request(f"{url}/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=300).read()


def _stats(url: str) -> dict:
    return json.load(urllib.request.urlopen(f"{url}/v1/stats", timeout=10))


async def _until(pilot, condition, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the dashboard never showed it"
        await pilot.pause(0.1)


@pytest.fixture(scope="module")
def live_server(tiny_moe):
    running = start_server(offloaded(tiny_moe), "tiny")
    yield running
    running.stop()


def test_panels_show_live_numbers_that_move_while_a_request_runs(live_server):
    async def scenario():
        app = TopApp(HttpStats(live_server.url), interval=0.2)
        async with app.run_test(size=(110, 32)) as pilot:
            await _until(pilot, lambda: app.connected)
            before = app.stats["activity"]["tokens_generated"]
            worker = threading.Thread(target=_chat, args=(live_server.url, 160))
            worker.start()
            await _until(pilot, lambda: (app.rates.now("decode") or 0) > 0)
            throughput = app.query_one(ThroughputPanel).text.plain
            assert "decode" in throughput and " 0.0 tok/s" not in throughput.splitlines()[0]
            await asyncio.to_thread(worker.join)
            await _until(pilot, lambda: app.stats["activity"]["tokens_generated"] >= before + 160)
            traffic = app.query_one(TrafficPanel).text.plain
            assert "misses" in traffic and "copied" in traffic
            grid = app.query_one(ExpertPanel).text.plain
            assert "L0" in grid and "■" in grid  # experts on the device, per layer
            assert "weights" in app.query_one(VramPanel).text.plain
            await _until(pilot, lambda: "POST /v1/chat/completions 200" in app.query_one(LogPanel).text.plain)
            # the finished request's pages are cached: the prefix tree shows them (prompt and reply, whole pages)
            await _until(pilot, lambda: "cached prefixes" in app.query_one(SessionsPanel).text.plain)

    asyncio.run(scenario())


def test_the_resize_keys_change_the_servers_expert_cache(live_server):
    async def scenario():
        app = TopApp(HttpStats(live_server.url), interval=0.2)
        async with app.run_test(size=(100, 30)) as pilot:
            await _until(pilot, lambda: app.connected)
            slots = _stats(live_server.url)["engine"]["experts"]["slots"]
            step = max(1, _stats(live_server.url)["engine"]["experts"]["total_experts"] // 16)
            await pilot.press("plus")
            await _until(pilot, lambda: _stats(live_server.url)["engine"]["experts"]["slots"] == slots + step)
            await _until(pilot, lambda: "expert cache now" in app.query_one(LogPanel).text.plain)
            await pilot.press("minus")
            await _until(pilot, lambda: _stats(live_server.url)["engine"]["experts"]["slots"] == slots)

    asyncio.run(scenario())


def _serve_on(app, port: int):
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.05)
    return server, thread


def test_a_server_that_goes_away_is_reported_and_picked_up_again(tiny_moe):
    from freetoken.server.app import create_app
    from freetoken.server.engine import ServingEngine

    engine = ServingEngine(offloaded(tiny_moe), "tiny")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server, thread = _serve_on(create_app(engine), port)

    async def scenario():
        nonlocal server, thread
        app = TopApp(HttpStats(f"http://127.0.0.1:{port}", timeout=1.0), interval=0.2)
        async with app.run_test(size=(100, 30)) as pilot:
            await _until(pilot, lambda: app.connected)
            server.should_exit = True
            await asyncio.to_thread(thread.join, 30)
            await _until(pilot, lambda: app.connected is False)
            assert "disconnected" in app.query_one("#status").render().plain
            assert "disconnected" in app.query_one(LogPanel).text.plain
            server, thread = await asyncio.to_thread(_serve_on, create_app(engine), port)  # a restart
            await _until(pilot, lambda: app.connected)
            assert "reconnected" in app.query_one(LogPanel).text.plain

    try:
        asyncio.run(scenario())
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        engine.close()


def test_the_pin_key_keeps_a_layers_experts_on_the_device(tiny_moe):
    running = start_server(offloaded(tiny_moe, slots=12), "tiny")  # room for one whole layer of 8

    def experts() -> dict:
        return _stats(running.url)["engine"]["experts"]

    async def scenario():
        app = TopApp(HttpStats(running.url), interval=0.2)
        async with app.run_test(size=(100, 30)) as pilot:
            await _until(pilot, lambda: app.connected)
            layer = experts()["grid_layers"][1]
            await pilot.press("j", "x")  # the second MoE layer
            await _until(pilot, lambda: experts()["pinned_layers"] == [layer])
            await asyncio.to_thread(_chat, running.url, 24)  # traffic through the other layers evicts, not these
            row = experts()["grid"][1]
            assert row == "#" * len(row)
            await _until(pilot, lambda: "*" in app.query_one(ExpertPanel).text.plain)
            await pilot.press("x")
            await _until(pilot, lambda: experts()["pinned_layers"] == [])

    try:
        asyncio.run(scenario())
    finally:
        running.stop()
