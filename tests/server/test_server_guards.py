"""The server's guards, on a tiny random MoE model with offloaded experts: the API key, a full queue, binding
beyond loopback, and the stats a dashboard reads."""

from __future__ import annotations

import pytest
import torch

from freetoken.cli import main as ft_main
from freetoken.engine.loader import load_model
from support.checkpoints import PARITY_CASES, write_hf_checkpoint
from support.servers import start_server, start_uvicorn

try:
    import httpx2 as httpx
except ImportError:
    import httpx

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "temperature": 0}
MESSAGE = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_moe")
    write_hf_checkpoint(path=path, **PARITY_CASES["qwen3_moe"])
    return path


@pytest.fixture(scope="module")
def keyed_server(tiny_moe):
    probe = load_model(tiny_moe, progress=False)
    budget = 3 * probe.moe_spec.bytes_per_expert(torch.float32)  # far below the pool: misses every step
    running = start_server(load_model(tiny_moe, progress=False, expert_cache=budget), "tiny", api_key="s3cret")
    yield running
    running.stop()


def test_the_api_key_is_required_except_for_health(keyed_server):
    url = keyed_server.url
    r = httpx.post(f"{url}/v1/chat/completions", json=CHAT)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(f"{url}/v1/messages", json=MESSAGE, headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
    r = httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer s3cret"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    r = httpx.post(f"{url}/v1/messages", json=MESSAGE, headers={"x-api-key": "s3cret"})
    assert r.status_code == 200 and r.json()["content"][0]["type"] == "text"


def test_stats_show_the_offloaded_experts_at_work(keyed_server):
    r = httpx.post(f"{keyed_server.url}/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer s3cret"})
    assert r.status_code == 200
    stats = httpx.get(f"{keyed_server.url}/v1/stats", headers={"x-api-key": "s3cret"}).json()
    experts = stats["engine"]["experts"]
    assert experts["mode"] == "offloaded" and experts["slots"] == 3 and experts["misses"] > 0
    # what the dashboard draws: a grid row per MoE layer (3 experts on the device in all), per-layer hit rates,
    # where memory goes, and the requests answered
    grid = experts["grid"]
    assert len(grid) == len(experts["layer_hit_rate"]) > 0 and sum(row.count("#") for row in grid) == 3
    assert set("".join(grid)) <= set("#+.") and "+" in "".join(grid)  # routed to lately, not on the device
    memory = stats["engine"]["memory"]
    assert memory["experts"] == 3 * experts["slot_bytes"] and memory["weights"] > 0 and memory["kv"] > 0
    activity = stats["activity"]
    done = activity["finished"][-1]
    assert done["generated"] > 0 and done["ttft_s"] > 0 and activity["tokens_generated"] >= done["generated"]
    assert activity["ttft_p50_s"] > 0 and not activity["running"]
    assert any(e["path"] == "/v1/chat/completions" and e["status"] == 200 for e in activity["log"])


def test_a_full_queue_answers_429_in_each_protocol(tiny_moe):
    running = start_server(load_model(tiny_moe, progress=False), "tiny", max_queue=0)
    try:
        r = httpx.post(f"{running.url}/v1/chat/completions", json=CHAT)
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
        r = httpx.post(f"{running.url}/v1/messages", json=MESSAGE)
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
        assert running.engine.counters.rejected == 2
    finally:
        running.stop()


def test_binding_beyond_loopback_needs_a_key(capsys, monkeypatch):
    monkeypatch.delenv("FREETOKEN_API_KEY", raising=False)
    assert ft_main(["serve", "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert "--api-key" in err and len(err.strip().splitlines()) == 1


def test_while_the_model_loads_health_says_so_and_routes_answer_503(tiny_moe):
    from freetoken.server.app import create_app
    from freetoken.server.engine import ServingEngine
    from freetoken.server.loading import LoadingApp

    loading = LoadingApp("tiny")
    url, server, thread = start_uvicorn(loading)
    try:
        r = httpx.get(f"{url}/health")
        assert r.status_code == 503 and r.json()["status"] == "loading" and "progress" not in r.json()
        seen = []
        lm = load_model(tiny_moe, progress=False, on_progress=lambda done, total: (
            loading.progress(done, total), seen.append(httpx.get(f"{url}/health").json())))
        assert [b["tensors"]["loaded"] for b in seen] == list(range(1, len(seen) + 1))
        assert seen[-1]["progress"] == 1.0 and 0 < seen[0]["progress"] < 1
        r = httpx.post(f"{url}/v1/chat/completions", json=CHAT)
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"
        r = httpx.post(f"{url}/v1/messages", json=MESSAGE)
        assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded_error"
        engine = ServingEngine(lm, "tiny")
        loading.ready(create_app(engine))
        assert httpx.get(f"{url}/health").json()["status"] == "ok"
        assert httpx.post(f"{url}/v1/chat/completions", json=CHAT).status_code == 200
        engine.close()
        failed = LoadingApp("other")
        failed.failed("no such file or directory: x.gguf")
        server.should_exit = True
        thread.join(timeout=30)
        url, server, thread = start_uvicorn(failed)
        body = httpx.get(f"{url}/health").json()
        assert body["status"] == "error" and "x.gguf" in body["message"]
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def test_metrics_and_an_oversized_body(keyed_server):
    headers = {"x-api-key": "s3cret"}
    assert httpx.post(f"{keyed_server.url}/v1/chat/completions", json=CHAT, headers=headers).status_code == 200
    text = httpx.get(f"{keyed_server.url}/metrics", headers=headers).text
    samples = dict(line.rsplit(" ", 1) for line in text.strip().splitlines())
    assert float(samples['freetoken_requests_completed{model="tiny"}']) >= 1
    assert float(samples['freetoken_engine_experts_misses{model="tiny"}']) > 0
    big = b"x" * (64 * 2**20 + 1)
    r = httpx.post(f"{keyed_server.url}/v1/messages", content=big, headers=headers)
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"


def test_the_expert_cache_resizes_while_serving(keyed_server, tiny_moe):
    headers = {"x-api-key": "s3cret"}
    url = keyed_server.url
    per_slot = keyed_server.engine.lm.moe_spec.bytes_per_expert(torch.float32)
    before = httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers=headers).json()["choices"][0]
    r = httpx.post(f"{url}/admin/expert-cache", json={"size": f"{6 * per_slot}B"}, headers=headers)
    assert r.status_code == 200 and r.json()["slots"] == 6 and r.json()["bytes"] == 6 * per_slot
    stats = httpx.get(f"{url}/v1/stats", headers=headers).json()["engine"]["experts"]
    assert stats["slots"] == 6
    after = httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers=headers).json()["choices"][0]
    assert after["message"] == before["message"]  # greedy output unchanged by the resize
    assert httpx.post(f"{url}/admin/expert-cache", json={"size": "lots"}, headers=headers).status_code == 400
    assert httpx.post(f"{url}/admin/expert-cache", json={"size": "1GiB"}).status_code == 401  # key needed
    httpx.post(f"{url}/admin/expert-cache", json={"size": f"{3 * per_slot}B"}, headers=headers)
    resident = start_server(load_model(tiny_moe, progress=False), "tiny")
    try:
        r = httpx.post(f"{resident.url}/admin/expert-cache", json={"size": "1MiB"})
        assert r.status_code == 400 and "--expert-cache" in r.json()["error"]["message"]
    finally:
        resident.stop()


def test_the_kv_pool_resizes_while_serving(keyed_server):
    """Shrinking gives back cached prefixes first and keeps what requests hold; the context a request may use
    follows the pool; bad sizes are 400s in the protocol's shape."""
    from freetoken.engine.offload.budget import kv_bytes_per_token

    headers = {"x-api-key": "s3cret"}
    url, engine = keyed_server.url, keyed_server.engine
    per_token = kv_bytes_per_token(engine.lm.args, engine.lm.dtype)
    before = httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers=headers).json()["choices"][0]
    r = httpx.post(f"{url}/admin/kv-cache", json={"size": f"{64 * per_token}B"}, headers=headers)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == 64 and r.json()["context"] == 64
    kv = httpx.get(f"{url}/v1/stats", headers=headers).json()["engine"]["kv"]
    assert kv["pages_total"] * kv["page_size"] == 64
    models = httpx.get(f"{url}/v1/models", headers=headers).json()["data"][0]
    assert "64" in str(models)  # the context a request may hold now
    after = httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers=headers).json()["choices"][0]
    assert after["message"] == before["message"]
    r = httpx.post(f"{url}/admin/kv-cache", json={"size": f"{per_token}B"}, headers=headers)
    assert r.status_code == 400 and "fewer than 16 tokens" in r.json()["error"]["message"]
    assert httpx.post(f"{url}/admin/kv-cache", json={"size": "1GiB"}).status_code == 401
    r = httpx.post(f"{url}/admin/kv-cache", json={"size": f"{4096 * per_token}B"}, headers=headers)
    assert r.status_code == 200 and r.json()["context"] == engine.scheduler.request_limit


def test_ask_reports_loading_progress_and_stops_at_a_failed_load(capsys):
    from freetoken.server.loading import LoadingApp

    loading = LoadingApp("big-model")
    loading.progress(3, 10)
    url, server, thread = start_uvicorn(loading)
    try:
        assert ft_main(["ask", "hi", "--url", url, "--wait", "1"]) == 2  # still loading after a second
        err = capsys.readouterr().err
        assert f"waiting for {url} to load big-model: 30% of the weights" in err and "within 1s" in err
        loading.failed("no such file: big.gguf")
        assert ft_main(["ask", "hi", "--url", url, "--wait", "60"]) == 2  # at once, not after a minute
        assert "could not load its model: no such file: big.gguf" in capsys.readouterr().err
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def test_pinning_a_layer_is_refused_with_the_reason_when_it_cannot_be_done(keyed_server):
    url, headers = keyed_server.url, {"x-api-key": "s3cret"}
    r = httpx.post(f"{url}/admin/expert-pin", json={"layer": 99}, headers=headers)
    assert r.status_code == 400 and "no routed experts" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/admin/expert-pin", json={"layer": 0}, headers=headers)  # 8 experts, 3 slots
    assert r.status_code == 400 and "grow the cache" in r.json()["error"]["message"]
    assert httpx.post(f"{url}/admin/expert-pin", json={"layer": "x"}, headers=headers).status_code == 400
    assert httpx.post(f"{url}/admin/expert-pin", json={"layer": 0}).status_code == 401  # the key is needed
    assert httpx.get(f"{url}/health").json()["status"] == "ok"


def test_admin_routes_refuse_clients_off_loopback_when_the_server_has_no_key(tiny_moe):
    """Without an API key the admin routes answer only on loopback: a client from another address gets a 403 in
    the OpenAI error shape, and the ordinary routes still answer it."""
    import asyncio

    from freetoken.server.app import ServerSettings, create_app
    from freetoken.server.engine import ServingEngine

    engine = ServingEngine(load_model(tiny_moe, progress=False), "tiny")

    async def ask(client: tuple[str, int]) -> tuple[int, dict, int]:
        transport = httpx.ASGITransport(app=create_app(engine, ServerSettings()), client=client)
        async with httpx.AsyncClient(transport=transport, base_url="http://freetoken") as c:
            admin = await c.post("/admin/kv-cache", json={"size": "1GiB"})
            models = await c.get("/v1/models")
            return admin.status_code, admin.json(), models.status_code

    try:
        status, body, models = asyncio.run(ask(("192.0.2.7", 40000)))
        assert status == 403 and "loopback" in body["error"]["message"] and models == 200
        status, _, _ = asyncio.run(ask(("127.0.0.1", 40000)))
        assert status != 403
    finally:
        engine.close()


def test_a_full_kv_pool_answers_503_to_the_newest_request_and_the_server_goes_on(tiny_moe):
    """Two requests that together outgrow a 64-token KV pool: the newest is ended with a 503 in its protocol's
    shape, naming --kv-cache; the other completes, and the next request is answered."""
    import threading

    running = start_server(load_model(tiny_moe, progress=False), "tiny", kv_tokens=64, max_seq_len=64)
    try:
        body = {**CHAT, "max_tokens": 48, "ignore_eos": True}
        results, start = [], threading.Barrier(2)

        def post() -> None:
            start.wait()
            results.append(httpx.post(f"{running.url}/v1/chat/completions", json=body, timeout=60))

        threads = [threading.Thread(target=post) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        codes = sorted(r.status_code for r in results)
        assert codes == [200, 503], [r.text for r in results]
        refused = next(r for r in results if r.status_code == 503).json()["error"]
        assert refused["type"] == "server_error" and "--kv-cache" in refused["message"]
        again = httpx.post(f"{running.url}/v1/chat/completions", json=CHAT, timeout=60)
        assert again.status_code == 200 and again.json()["choices"][0]["message"]["content"] is not None
    finally:
        running.stop()
