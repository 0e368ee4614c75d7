"""The requests four real coding agents sent (../shared/agent-requests: Claude Code, Codex, OpenCode, OpenClaw),
replayed byte for byte against a real server with the embedded SmolLM2: each must get a well-formed streamed
answer in its protocol. The odd parts ride along: `role: "system"` inside Anthropic `messages`, `?beta=true`,
Codex's `namespace` tools, tool-call ids rewritten by the client, `developer` messages.

Only the output budget is cut (a 135M model's 32k-token reply would take minutes). A body whose prompt is longer
than SmolLM2's 8k-token context must be refused with the protocol's own `context_length_exceeded` error; it is
then replayed with every long string cut short (the same structure, a prompt that fits) and must be answered.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx2 as httpx
import pytest

from support.servers import start_server

REQUESTS = Path(__file__).resolve().parents[3] / "shared" / "agent-requests"
POSTS = sorted(p for p in REQUESTS.glob("*/*-POST-*.json") if not p.name.endswith(".meta.json"))
PROBES = sorted(REQUESTS.glob("*/*-HEAD-*.meta.json"))
OUTPUT_BUDGET = 4
pytestmark = pytest.mark.skipif(not POSTS, reason="../shared/agent-requests is not beside this checkout")


@pytest.fixture(scope="module")
def server(smollm2_gguf):
    from freetoken.engine.loader import load_model

    names = {json.loads(p.read_text()).get("model") for p in POSTS} - {None}
    running = start_server(load_model(smollm2_gguf, progress=False), "smollm2", model_aliases=frozenset(names))
    yield running
    running.stop()


def _meta(body: Path) -> dict:
    return json.loads(body.with_name(body.name.removesuffix(".json") + ".meta.json").read_text())


def _budgeted(body: dict) -> dict:
    out = dict(body)
    for key in ("max_tokens", "max_completion_tokens"):
        if key in out:
            out[key] = OUTPUT_BUDGET
    if "input" in out:  # Responses
        out["max_output_tokens"] = OUTPUT_BUDGET
    elif "max_tokens" not in out and "max_completion_tokens" not in out:
        out["max_tokens"] = OUTPUT_BUDGET
    return out


def _shrunk(value, limit: int = 48):
    """The same structure with every string past `limit` characters cut to it (keys, short values and tool-call
    arguments, which are JSON text, kept)."""
    if isinstance(value, str):
        return value[:limit]
    if isinstance(value, list):
        return [_shrunk(v, limit) for v in value]
    if isinstance(value, dict):
        return {k: v if k == "arguments" else _shrunk(v, limit) for k, v in value.items()}
    return value


def _events(response: httpx.Response) -> list[tuple[str | None, str]]:
    """(event name or None, data) of each server-sent event."""
    events, name, data = [], None, []
    for line in response.iter_lines():
        if not line:
            if data:
                events.append((name, "\n".join(data)))
            name, data = None, []
        elif line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())
    if data:
        events.append((name, "\n".join(data)))
    return events


def _check_stream(path: str, events: list[tuple[str | None, str]]) -> None:
    assert events, "an empty stream"
    if path.startswith("/v1/messages"):
        names = [n for n, _ in events if n != "ping"]
        assert names[0] == "message_start" and names[-1] == "message_stop" and "message_delta" in names, names
        for name, data in events:
            assert json.loads(data)["type"] == name
        delta = next(json.loads(d) for n, d in events if n == "message_delta")
        assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens", "tool_use", "stop_sequence")
    elif path.startswith("/v1/chat/completions"):
        assert events[-1][1] == "[DONE]"
        chunks = [json.loads(d) for _, d in events[:-1]]
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert any(ch.get("finish_reason") for c in chunks for ch in c["choices"])
    else:
        kinds = [json.loads(d)["type"] for _, d in events]
        assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete"), kinds


def _context_error(path: str, status: int, body: dict) -> bool:
    if status != 400:
        return False
    if path.startswith("/v1/messages"):
        return body["type"] == "error" and "prompt is too long" in body["error"]["message"]
    return body["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize("body_file", POSTS, ids=lambda p: p.name.removesuffix(".json"))
def test_every_captured_agent_request_gets_a_well_formed_streamed_answer(server, body_file):
    meta = _meta(body_file)
    headers = {k: v for k, v in meta["headers"].items()
               if k.lower() not in ("host", "content-length", "connection", "accept-encoding")}
    body = _budgeted(json.loads(body_file.read_text()))
    with httpx.Client(base_url=server.url, timeout=600) as client:
        for attempt in (body, _shrunk(body)):
            with client.stream(meta["method"], meta["path"], headers=headers, content=json.dumps(attempt)) as r:
                if r.status_code == 200:
                    assert r.headers["content-type"].startswith("text/event-stream")
                    _check_stream(meta["path"], _events(r))
                    return
                r.read()
                assert attempt is body and _context_error(meta["path"], r.status_code, r.json()), \
                    (r.status_code, r.text[:500])
    raise AssertionError("unreachable")


@pytest.mark.parametrize("probe", PROBES, ids=lambda p: p.name.removesuffix(".meta.json"))
def test_connectivity_probes_are_answered(server, probe):
    meta = json.loads(probe.read_text())
    response = httpx.request(meta["method"], server.url + meta["path"], timeout=30)
    assert response.status_code < 500
    assert httpx.get(server.url + "/health", timeout=30).json()["status"] == "ok"
