"""`ft serve --record DIR`: real requests through the real SDKs become a trace (sessions found from the messages,
edits as keep/append, reply lengths from the usage) that `ft eval` replays against the same server."""

from __future__ import annotations

import os
import stat
import subprocess

import pytest

from freetoken.eval.trace import read_trace
from support.agent_model import write_agent_model
from support.launching import FT
from support.servers import start_server


@pytest.fixture(scope="module")
def recording(tmp_path_factory, smollm2_gguf):
    from freetoken.engine.loader import load_model

    folder = tmp_path_factory.mktemp("record")
    model = write_agent_model(folder / "agent-model.gguf", smollm2_gguf)
    server = start_server(load_model(model, progress=False), "agent-model", record_dir=str(folder / "traces"))
    yield server, folder / "traces"
    server.stop()


def test_requests_become_a_trace_that_replays(recording, tmp_path):
    import anthropic
    import openai

    server, folder = recording
    chat = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x")
    system = {"role": "system", "content": "You are terse."}
    first = [system, {"role": "user", "content": "Say hello."}]
    r1 = chat.chat.completions.create(model="agent-model", messages=first, max_tokens=5)
    second = first + [{"role": "assistant", "content": r1.choices[0].message.content},
                      {"role": "user", "content": "Again, please."}]
    stream = chat.chat.completions.create(model="agent-model", messages=second, max_tokens=7, stream=True,
                                          stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    r2_tokens = [c.usage.completion_tokens for c in stream if c.usage][0]
    edited = second[:3] + [{"role": "user", "content": "Something else."}]  # the last message rewritten
    r3 = chat.chat.completions.create(model="agent-model", messages=edited, max_tokens=4)
    with pytest.raises(openai.BadRequestError):  # a refused request is not recorded
        chat.chat.completions.create(model="agent-model", messages=first, max_tokens=0)
    claude = anthropic.Anthropic(base_url=server.url, api_key="x")
    with claude.messages.stream(model="agent-model", max_tokens=6, system="Be brief.",
                                messages=[{"role": "user", "content": "Hi"}]) as s:
        r4 = s.get_final_message()
    r5 = chat.responses.create(model="agent-model", input="One word?", max_output_tokens=3)

    (path,) = folder.glob("trace-*.jsonl")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600  # it holds the prompts
    trace = read_trace(path)
    t1, t2, t3, t4, t5 = trace.turns
    assert [t.protocol for t in trace.turns] == ["openai", "openai", "openai", "anthropic", "responses"]
    assert t1.messages == first and t2.messages == second and t3.messages == edited
    assert (t2.parent, t2.session) == (t1.id, t1.session)  # the next turn of the conversation
    assert t3.session == t1.session and t3.parent in (t1.id, t2.id)  # its edit
    assert len({t1.session, t4.session, t5.session}) == 3  # unrelated conversations are sessions of their own
    assert [t.output_tokens for t in trace.turns] == [r1.usage.completion_tokens, r2_tokens,
                                                      r3.usage.completion_tokens, r4.usage.output_tokens,
                                                      r5.usage.output_tokens]
    assert t1.request == {"max_tokens": 5} and "stream" not in t2.request and t2.think_s >= 0
    assert t4.request["system"] == "Be brief."
    assert t5.messages == [{"type": "message", "role": "user", "content": "One word?"}]

    out = tmp_path / "replay"
    proc = subprocess.run([FT, "eval", "--trace", str(path), "--endpoint", server.url, "--out", str(out), "-q",
                           "--reference-runs", "1"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    import json

    result = json.loads((out / "result.json").read_text())
    assert [t["output_tokens"] for t in result["turns"]] == [t.output_tokens for t in trace.turns]
    assert result["turns"][1]["cached_tokens"] > 0  # the replayed follow-up reuses the replayed first turn
