"""The Session SDK on the embedded SmolLM2: answers, history reuse, and that fork, rollback and edit continue
exactly as a fresh run of the same history would (greedy, token for token) while sharing K/V pages."""

from __future__ import annotations

import asyncio
import json

import pytest

import freetoken
from freetoken.engine.generator import Generator
from freetoken.engine.json_prefix import JsonPrefix
from freetoken.engine.sampling import SamplingParams
from support.servers import start_server

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def engine(smollm2_gguf):
    engine = freetoken.Engine.load(str(smollm2_gguf), device="cpu")
    yield engine
    engine.close()


def fresh_ids(engine, messages: list[dict], max_tokens: int) -> list[int]:
    """What a fresh generator makes of this history (no reuse of anything)."""
    tok = engine.lm.tokenizer
    prompt = tok.encode(tok.apply_chat_template(messages))
    return Generator(engine.lm).generate_ids(prompt, SamplingParams(temperature=0, max_tokens=max_tokens))


def test_a_session_answers_and_reuses_its_history_on_the_next_turn(engine):
    session = engine.session(system="You are a helpful assistant.")
    first = session.send(QUESTION, max_tokens=24)
    assert "Paris" in first.text
    assert first.stats.cached_tokens == 0 and first.stats.prompt_tokens > 10 and first.stats.completion_tokens > 0
    assert first.stats.finish_reason == "stop" and first.stats.ttft_s > 0
    second = session.send("And of Italy?", max_tokens=24)
    assert "Rome" in second.text
    # the whole first turn (system, question, answer) came from the cache, up to where the template re-renders
    assert second.stats.cached_tokens >= first.stats.prompt_tokens
    assert [m["role"] for m in session.messages] == ["system", "user", "assistant", "user", "assistant"]
    session.close()


def test_a_new_session_starts_on_another_sessions_pages_of_the_same_start(engine):
    """A subagent with the same system prompt as its parent reuses the parent's K/V from the first send."""
    system = "You are a coding agent with many tools. " * 25
    parent = engine.session(system=system)
    parent.send(QUESTION, max_tokens=8).wait()
    child = engine.session(system=system)
    reply = child.send("Summarise the repository.", max_tokens=8)
    assert reply.stats.cached_tokens > 200 and reply.token_ids == fresh_ids(engine, child.messages[:-1], 8)
    parent.close()
    child.close()
    engine.prefix.clear()
    assert engine.cache.allocator.num_free == engine.cache.allocator.num_pages


def test_a_fork_shares_the_history_and_continues_like_a_fresh_run(engine):
    session = engine.session(system="You are a helpful assistant. " * 30)  # a few hundred tokens of history
    session.send(QUESTION, max_tokens=16).wait()
    allocator = engine.cache.allocator
    free = allocator.num_free
    branch = session.fork()
    assert allocator.num_free == free  # O(1): no page allocated until a branch generates
    a = branch.send("Name one famous museum there.", max_tokens=12)
    b = session.send("What language is spoken there?", max_tokens=12)
    for reply, sess in ((a, branch), (b, session)):
        history = sess.messages[:-1]  # everything before this reply
        assert reply.token_ids == fresh_ids(engine, history, 12)
        assert reply.stats.cached_tokens > 200
    assert branch.messages[:3] == session.messages[:3] and branch.messages[3] != session.messages[3]
    branch.close()
    session.close()
    engine.prefix.clear()  # (the engine-wide prefix index keeps whole pages for later sessions)
    assert allocator.num_free == allocator.num_pages  # every page back once the last owner is gone


def test_rollback_and_edit_give_what_a_fresh_run_of_that_history_gives(engine):
    session = engine.session(system="Answer in one short sentence.")
    session.send(QUESTION, max_tokens=12).wait()
    session.checkpoint("asked")
    session.send("Tell me a joke.", max_tokens=12).wait()
    session.rollback("asked")
    assert len(session.messages) == 3
    after = session.send("What about Spain?", max_tokens=12)
    assert after.token_ids == fresh_ids(engine, session.messages[:-1], 12)
    assert after.stats.cached_tokens > 0  # the checkpoint's K/V, not recomputed
    before = after.stats.cached_tokens
    session.edit(1, "What is the capital of Germany?")  # the first question: everything after it recomputes
    edited = session.send("Thanks.", max_tokens=12)
    assert edited.token_ids == fresh_ids(engine, session.messages[:-1], 12)
    assert 0 < edited.stats.cached_tokens < before  # reused the system prompt only
    with pytest.raises(freetoken.sdk.local.FreeTokenError, match="no checkpoint"):
        session.rollback("never")
    session.close()


def test_replies_stream_to_sync_and_async_readers(engine):
    session = engine.session()
    deltas = list(session.send(QUESTION, max_tokens=16))
    assert len(deltas) > 1 and "Paris" in "".join(deltas)

    async def ask() -> tuple[list[str], str]:
        streamed = [d async for d in session.send("And of Italy?", max_tokens=16)]
        whole = await session.send("And of Spain?", max_tokens=16)
        return streamed, whole.text

    streamed, whole = asyncio.run(ask())
    assert "Rome" in "".join(streamed) and "Madrid" in whole
    session.close()


CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": CITY}},
         {"type": "function", "function": {"name": "get_time", "description": "Local time of a city",
                                           "parameters": CITY}}]


def _forced_calls(session) -> None:
    """A named choice gets a call of that tool, "required" a call of one of them (JSON arguments under the
    schema), "none" a plain answer; the call and its result go on in the history."""
    named = session.send("Weather in Paris?", tool_choice={"type": "function", "function": {"name": "get_time"}},
                         max_tokens=64)
    assert [c.name for c in named.tool_calls] == ["get_time"] and named.stats.finish_reason == "tool_calls"
    assert set(named.tool_calls[0].arguments) == {"city"} and isinstance(named.tool_calls[0].arguments["city"], str)
    assert session.messages[-1]["tool_calls"][0]["function"]["name"] == "get_time"
    answer = session.send({"role": "tool", "content": '{"time": "14:05"}'}, tool_choice="none", max_tokens=24)
    assert answer.tool_calls == [] and answer.text.strip() and answer.stats.finish_reason in ("stop", "length")
    required = session.send("And the weather in Rome?", tool_choice="required", max_tokens=64)
    assert len(required.tool_calls) >= 1 and required.tool_calls[0].name in ("get_weather", "get_time")
    assert set(required.tool_calls[0].arguments) == {"city"}
    session.send({"role": "tool", "content": '{"weather": "sun"}'}, tool_choice="none", max_tokens=8)
    one = session.send("Weather in Oslo and in Bergen?", tool_choice="required", parallel_tool_calls=False,
                       max_tokens=64)
    assert len(one.tool_calls) == 1 and one.text.strip() == "" and one.stats.finish_reason == "tool_calls"


def test_a_session_forces_tool_calls_with_tool_choice(engine):
    session = engine.session(system="You are a travel assistant.", tools=TOOLS)
    _forced_calls(session)
    session.close()


@pytest.mark.parametrize("choice, problem", [
    ({"type": "function", "function": {"name": "book_flight"}}, "not among the tools"),
    ("sometimes", "tool_choice must be"),
    ({"type": "function", "name": "get_time", "extra": 1}, None),  # the Responses shape is taken too
])
def test_a_bad_tool_choice_fails_at_send(engine, choice, problem):
    session = engine.session(tools=TOOLS)
    if problem is None:
        assert session.send("Time in Oslo?", tool_choice=choice, max_tokens=48).tool_calls[0].name == "get_time"
    else:
        with pytest.raises(ValueError, match=problem):
            session.send("Time in Oslo?", tool_choice=choice)
    with pytest.raises(ValueError, match="needs tools"):
        engine.session().send("Time in Oslo?", tool_choice="required")
    session.close()


def test_connect_gives_the_same_sessions_against_a_server(smollm2_gguf):
    from freetoken.engine.loader import load_model

    running = start_server(load_model(smollm2_gguf, progress=False), "smollm2")
    try:
        remote = freetoken.connect(running.url)
        assert remote.model == "smollm2"
        session = remote.session(system="You are a helpful assistant. " * 20)
        first = session.send(QUESTION, max_tokens=24)
        assert "Paris" in first.text and first.stats.completion_tokens > 0
        branch = session.fork()
        second = session.send("And of Italy?", max_tokens=24)
        assert "Rome" in second.text and second.stats.cached_tokens > 100  # the server's prefix cache
        assert len(branch.messages) == 3 and len(session.messages) == 5
        session.checkpoint("two")
        session.edit(1, "What is the capital of Spain?")
        assert session.messages[1]["content"] == "What is the capital of Spain?"
        session.rollback("two")
        assert session.messages[1]["content"] == QUESTION
        shaped = session.send("Now give the capital of France as JSON with keys country and capital.", json=True,
                              max_tokens=64)
        assert isinstance(json.loads(shaped.text), dict)
        schemed = session.send("Now give the capital of France as JSON.", json=CAPITAL_SCHEMA, max_tokens=64)
        assert set(json.loads(schemed.text)) == {"country", "capital"}  # through response_format json_schema
        _forced_calls(remote.session(system="You are a travel assistant.", tools=TOOLS))  # as the server takes it
        remote.close()
    finally:
        running.stop()
    with pytest.raises(freetoken.sdk.remote.FreeTokenError, match="no server answered"):
        freetoken.connect(running.url)


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a GPU")
def test_on_cuda_sessions_fork_and_reuse_through_graphs(tmp_path):
    """On CUDA every send decodes through CUDA graphs over the engine's up-front pool; forks and the reuse of the
    history must give what a fresh run gives. (A tiny random model: the device machine has no SmolLM2.)"""
    import torch

    from freetoken.engine.loader import load_model
    from support.checkpoints import PARITY_CASES, write_hf_checkpoint

    write_hf_checkpoint(path=tmp_path, **PARITY_CASES["llama"])
    engine = freetoken.Engine(load_model(tmp_path, device="cuda", dtype=torch.float32, progress=False))
    assert engine.generator.use_graphs
    session = engine.session(system="You are a tiny test model. " * 4)
    session.send("first question", max_tokens=8).wait()
    branch = session.fork()
    for s, text in ((session, "second question"), (branch, "another one")):
        reply = s.send(text, max_tokens=8)
        assert reply.token_ids == fresh_ids(engine, s.messages[:-1], 8) and reply.stats.cached_tokens > 20
    session.close()
    branch.close()
    engine.prefix.clear()
    assert engine.cache.allocator.num_free == engine.cache.allocator.num_pages
    engine.close()


CAPITAL_SCHEMA = {"type": "object", "properties": {"country": {"type": "string"}, "capital": {"type": "string"}},
                  "required": ["country", "capital"], "additionalProperties": False}


def test_a_json_schema_reply_is_valid_under_it_and_a_bad_schema_fails_at_send(engine):
    session = engine.session()
    reply = session.send("Give the capital of France as JSON.", json=CAPITAL_SCHEMA, max_tokens=64)
    answer = json.loads(reply.text)
    assert set(answer) == {"country", "capital"} and all(isinstance(v, str) for v in answer.values())
    with pytest.raises(ValueError, match="points at nothing"):
        session.send("hi", json={"$ref": "#/$defs/Missing"})
    with pytest.raises(ValueError, match="top level must be an object"):
        session.send("hi", json={"type": "array"})
    session.close()


def test_json_replies_are_one_json_object(engine):
    session = engine.session()
    reply = session.send("Give the capital of France as JSON with keys country and capital.", json=True,
                         max_tokens=64)
    assert json.loads(reply.text) == {"country": "FRANCE", "capital": "Paris"}  # greedy, so the same every time
    assert reply.stats.finish_reason == "stop"
    free = session.send("Describe a cat.", json=True, max_tokens=64)  # asked for nothing JSON-like: still JSON
    if free.stats.finish_reason == "stop":
        assert isinstance(json.loads(free.text), dict)
    else:  # the budget ran out first: what there is, is the start of one object
        assert free.stats.finish_reason == "length" and JsonPrefix().feed(free.text)
    session.close()
