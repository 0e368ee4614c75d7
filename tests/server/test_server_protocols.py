"""`ft serve`'s app on a real uvicorn, driven by the official `openai` and `anthropic` SDKs with the embedded
SmolLM2 model: answers, streaming, usage, count_tokens, errors in each protocol's shape, cancellation, concurrency.
"""

from __future__ import annotations

import concurrent.futures
import json
import time

import anthropic
import openai
import pytest

try:  # the HTTP client the SDKs themselves use
    import httpx2 as httpx
except ImportError:
    import httpx

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def oai(smollm2_server):
    return openai.OpenAI(base_url=f"{smollm2_server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def ant(smollm2_server):
    return anthropic.Anthropic(base_url=smollm2_server.url, api_key="unused", max_retries=0)


def test_openai_chat_answers_the_question(oai, smollm2_server):
    reply = oai.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": QUESTION}],
                                        temperature=0, max_tokens=32)
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop" and reply.model == "smollm2"
    assert reply.usage.prompt_tokens > 5 and 0 < reply.usage.completion_tokens <= 32
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    models = oai.models.list().data
    assert [m.id for m in models] == ["smollm2"]
    assert models[0].model_extra["context_length"] == smollm2_server.engine.context_length
    assert models[0].model_extra["max_output_tokens"] == smollm2_server.engine.context_length // 4  # ft launch reads it


def test_openai_stream_has_the_same_text_usage_and_done(oai):
    args = dict(model="alias", messages=[{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": [{"type": "text", "text": QUESTION}]}],
                temperature=0, max_tokens=24)
    whole = oai.chat.completions.create(**args).choices[0].message.content
    chunks = list(oai.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes in (["stop"], ["length"])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


def test_anthropic_messages_answer_and_stream(ant):
    msg = ant.messages.create(model="smollm2", max_tokens=32, extra_body={"temperature": 0},
                              messages=[{"role": "user", "content": QUESTION}])
    assert msg.type == "message" and msg.role == "assistant" and msg.stop_reason == "end_turn"
    usage = msg.usage  # (earlier tests asked the same: part of the prompt may come from the prefix cache)
    assert "Paris" in msg.content[0].text and usage.input_tokens + usage.cache_read_input_tokens > 5
    assert usage.output_tokens > 0
    with ant.messages.stream(model="smollm2", max_tokens=32, extra_body={"temperature": 0},
                             system="You answer questions.",
                             messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION}]}]) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert {"content_block_start", "content_block_delta", "content_block_stop", "message_delta"} <= set(kinds)
    assert "Paris" in final.content[0].text and final.stop_reason == "end_turn"


def test_anthropic_reports_the_stop_sequence_that_ended_the_reply(ant):
    args = dict(model="smollm2", max_tokens=32, extra_body={"temperature": 0}, stop_sequences=["Paris", "Rome"],
                messages=[{"role": "user", "content": QUESTION}])
    msg = ant.messages.create(**args)
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == "Paris"
    assert "Paris" not in msg.content[0].text and msg.content[0].text.strip()
    with ant.messages.stream(**args) as s:
        final = s.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == "Paris"


def test_anthropic_count_tokens_matches_the_prompt_the_reply_reports(ant):
    messages = [{"role": "user", "content": QUESTION}]
    counted = ant.messages.count_tokens(model="smollm2", messages=messages).input_tokens
    usage = ant.messages.create(model="smollm2", max_tokens=1, messages=messages).usage
    assert counted == usage.input_tokens + usage.cache_read_input_tokens > 5  # (computed + from the cache)
    system = "The quick brown fox jumps over the lazy dog. " * 20  # ~200 tokens, against the template's default
    longer = ant.messages.count_tokens(model="smollm2", system=system, messages=messages).input_tokens
    assert longer > counted + 100


def test_a_history_with_tool_calls_and_results_renders_in_both_protocols(oai, ant):
    """Earlier tool turns (OpenAI tool_calls/tool messages, Anthropic tool_use/tool_result blocks) go through the
    chat template; the reply is ordinary text."""
    reply = oai.chat.completions.create(model="smollm2", temperature=0, max_tokens=8, messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 C"}])
    assert reply.choices[0].message.content
    msg = ant.messages.create(model="smollm2", max_tokens=8, messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny, 21 C"}]}])
    assert msg.content[0].type == "text"


@pytest.mark.parametrize("body, status, fragment", [
    (b"{not json", 400, "not valid JSON"),
    (b"\xff\xfe{}", 400, "not valid UTF-8"),
    (b"[1, 2]", 400, "must be a JSON object"),
    (json.dumps({"model": "smollm2"}).encode(), 400, "messages"),
    (json.dumps({"model": "smollm2", "messages": []}).encode(), 400, "messages"),
    (json.dumps({"model": "smollm2", "messages": "hi"}).encode(), 400, "messages"),
    (json.dumps({"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}).encode(), 404, "gpt-9"),
    (json.dumps({"model": "smollm2", "messages": [{"role": "wizard", "content": "hi"}]}).encode(), 400, "role"),
    (json.dumps({"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}).encode(),
     400, "max_tokens"),
    (json.dumps({"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}).encode(),
     400, "temperature"),
    (json.dumps({"model": "smollm2", "messages": [{"role": "user", "content": "hi"}],
                 "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]}).encode(),
     400, "JSON Schema object"),
    (json.dumps({"model": "smollm2", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:,"}}]}]}).encode(), 400, "not supported"),
])
def test_openai_bad_requests_get_openai_errors(smollm2_server, body, status, fragment):
    r = httpx.post(f"{smollm2_server.url}/v1/chat/completions", content=body,
                   headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert fragment in err["message"] and err["type"] and "param" in err and "code" in err


@pytest.mark.parametrize("payload, status, fragment", [
    ({"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]}, 400, "max_tokens"),
    ({"model": "smollm2", "max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]}, 400, "max_tokens"),
    ({"model": "claude-9", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}, 404, "claude-9"),
    ({"model": "smollm2", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]}, 400,
     "not supported"),
    ({"model": "smollm2", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
      "tools": [{"name": "f", "input_schema": {"type": "string"}}]}, 400, "JSON Schema object"),
    ({"model": "smollm2", "max_tokens": 5, "messages": [{"role": "system", "content": "hi"}]}, 400, "role"),
])
def test_anthropic_bad_requests_get_anthropic_errors(smollm2_server, payload, status, fragment):
    r = httpx.post(f"{smollm2_server.url}/v1/messages", json=payload)
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and fragment in body["error"]["message"] and body["error"]["type"]


def test_a_prompt_past_the_context_gets_the_wording_agents_match(oai, ant, smollm2_server):
    huge = "word " * (smollm2_server.engine.context_length + 10)
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": huge}], max_tokens=5)
    assert "maximum context length" in str(e.value) and e.value.code == "context_length_exceeded"
    with pytest.raises(anthropic.BadRequestError) as e:
        ant.messages.create(model="smollm2", max_tokens=5, messages=[{"role": "user", "content": huge}])
    assert "prompt is too long" in str(e.value)
    # an absurd max_tokens is cut to what the context leaves, not refused
    ok = oai.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}],
                                     max_tokens=10**9, temperature=0, stop=["."])
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_unknown_routes_are_404_in_the_protocol_shape(smollm2_server):
    r = httpx.get(f"{smollm2_server.url}/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(f"{smollm2_server.url}/v1/messages")
    assert r.status_code == 405 and r.json()["type"] == "error"


def test_concurrent_streams_all_complete_and_free_their_kv(oai, smollm2_server):
    engine = smollm2_server.engine

    def one(i: int) -> str:
        stream = oai.chat.completions.create(model="smollm2", temperature=0, max_tokens=12, stream=True,
                                             messages=[{"role": "user", "content": f"Count to {i + 3}."}])
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    expected = [one(i) for i in range(4)]  # one at a time
    forwards, tokens = engine.scheduler.forwards, engine.counters.completion_tokens
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, [i % 4 for i in range(16)]))
    assert results == [expected[i % 4] for i in range(16)]
    # continuous batching: far fewer forwards than tokens generated (each forward served several streams)
    assert engine.scheduler.forwards - forwards < (engine.counters.completion_tokens - tokens) / 2
    kv = engine.stats()["engine"]["kv"]
    assert kv["pages_free"] + kv["pages_cached"] == kv["pages_total"]  # every sequence's pages are back
    assert engine.stats()["queued"] == 0 and engine.stats()["running"] == 0


def test_a_client_that_disconnects_mid_stream_is_cancelled(smollm2_server):
    engine = smollm2_server.engine
    before = engine.counters.cancelled
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Write a long story."}],
            "max_tokens": 2000, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{smollm2_server.url}/v1/chat/completions", json=body, timeout=60) as r:
        for n, _ in enumerate(r.iter_lines()):
            if n > 6:
                break  # leave after a few chunks
    deadline = time.monotonic() + 30
    while engine.counters.cancelled == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.counters.cancelled == before + 1
    while engine.stats()["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    kv = engine.stats()["engine"]["kv"]
    assert kv["pages_free"] + kv["pages_cached"] == kv["pages_total"]
    assert httpx.get(f"{smollm2_server.url}/health").json()["status"] == "ok"


@pytest.mark.parametrize("route, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": 2000}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": 2000}),
])
def test_a_client_that_gives_up_on_a_whole_reply_is_cancelled_too(smollm2_server, route, body):
    engine = smollm2_server.engine
    before = engine.counters.cancelled
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{smollm2_server.url}{route}", json={"model": "smollm2", "temperature": 0, **body},
                   timeout=httpx.Timeout(1.5))
    deadline = time.monotonic() + 30
    while (engine.counters.cancelled == before or engine.stats()["running"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.counters.cancelled == before + 1
    kv = engine.stats()["engine"]["kv"]
    assert kv["pages_free"] + kv["pages_cached"] == kv["pages_total"]


def test_stats_report_requests_and_the_engine(smollm2_server):
    stats = httpx.get(f"{smollm2_server.url}/v1/stats").json()
    assert stats["model"] == "smollm2" and stats["requests"]["completed"] > 0
    assert stats["engine"]["experts"]["mode"] == "none" and stats["engine"]["kv"]["page_size"] > 0


def test_responses_continue_from_a_previous_response(oai):
    first = oai.responses.create(model="smollm2", input=QUESTION, temperature=0, max_output_tokens=32)
    assert first.status == "completed" and "Paris" in first.output_text
    assert first.output[0].type == "message" and first.usage.output_tokens > 0
    follow = oai.responses.create(model="smollm2", input="Say it again.", previous_response_id=first.id,
                                  temperature=0, max_output_tokens=16)
    # the history (question and answer) is part of the second prompt
    assert follow.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert follow.previous_response_id == first.id
    with pytest.raises(openai.NotFoundError, match="resp_nothing"):
        oai.responses.create(model="smollm2", input="hi", previous_response_id="resp_nothing")
    unstored = oai.responses.create(model="smollm2", input="hi", max_output_tokens=2, store=False)
    assert unstored.status == "incomplete" and unstored.incomplete_details.reason == "max_output_tokens"
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model="smollm2", input="hi", previous_response_id=unstored.id)


def test_responses_stream_typed_events(oai):
    args = dict(model="smollm2", input=[{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}],
                instructions="Answer briefly.", temperature=0, max_output_tokens=24)
    whole = oai.responses.create(**args).output_text
    events = list(oai.responses.create(**args, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] in ("response.completed",
                                                                                      "response.incomplete")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output_text == whole


def test_legacy_completions(oai):
    done = oai.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=6, temperature=0)
    assert done.choices[0].text and done.usage.completion_tokens <= 6
    streamed = list(oai.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=6,
                                           temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == done.choices[0].text


def test_a_resent_history_is_reused_and_reported_as_cached_in_each_protocol(oai, ant):
    """Agents resend their whole history every turn: the second request with the same long start takes its K/V
    from the first (whole pages of it), and each protocol reports that in its own usage field."""
    system = "You are a careful coding agent working in a large repository. " * 12
    ask = [{"role": "system", "content": system}, {"role": "user", "content": "List the files."}]
    first = oai.chat.completions.create(model="smollm2", messages=ask, max_tokens=4, temperature=0).usage
    again = oai.chat.completions.create(model="smollm2", messages=ask, max_tokens=4, temperature=0).usage
    assert first.prompt_tokens == again.prompt_tokens > 150
    assert again.prompt_tokens_details.cached_tokens >= again.prompt_tokens - 16 > 0  # all but a partial page
    stream = oai.chat.completions.create(model="smollm2", messages=ask, max_tokens=4, temperature=0, stream=True,
                                         stream_options={"include_usage": True})
    usage = [c.usage for c in stream if c.usage][-1]
    assert usage.prompt_tokens_details.cached_tokens == again.prompt_tokens_details.cached_tokens
    r = oai.responses.create(model="smollm2", instructions=system, input="List the files.", max_output_tokens=4)
    r = oai.responses.create(model="smollm2", instructions=system, input="List the files.", max_output_tokens=4)
    assert r.usage.input_tokens_details.cached_tokens > 150
    msgs = [{"role": "user", "content": "List the files."}]
    m = ant.messages.create(model="smollm2", system=system, max_tokens=4, messages=msgs)
    m = ant.messages.create(model="smollm2", system=system, max_tokens=4, messages=msgs)
    assert m.usage.cache_read_input_tokens > 150 and 0 < m.usage.input_tokens <= 16
    with ant.messages.stream(model="smollm2", system=system, max_tokens=4, messages=msgs) as s:
        final = s.get_final_message()
    assert final.usage.cache_read_input_tokens == m.usage.cache_read_input_tokens
    assert final.usage.input_tokens == m.usage.input_tokens


def test_response_format_json_constrains_the_reply_to_a_json_object(oai):
    ask = [{"role": "user", "content": "Give the capital of France as JSON with keys country and capital."}]
    reply = oai.chat.completions.create(model="smollm2", messages=ask, temperature=0, max_tokens=64,
                                        response_format={"type": "json_object"})
    answer = json.loads(reply.choices[0].message.content)
    assert isinstance(answer, dict) and "Paris" in answer.values()
    # a question that does not invite JSON still gets a JSON object, and nothing after it
    free = oai.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Describe a cat."}],
                                       temperature=0, max_tokens=64, response_format={"type": "json_object"})
    assert isinstance(json.loads(free.choices[0].message.content), dict)
    assert free.choices[0].finish_reason == "stop"
    schema = {"type": "json_schema", "json_schema": {"name": "capital", "schema": {"type": "object"}}}
    response = oai.responses.create(model="smollm2", input=ask[0]["content"], temperature=0, max_output_tokens=64,
                                    text={"format": {"type": "json_schema", "name": "capital",
                                                     "schema": {"type": "object"}}})
    assert isinstance(json.loads(response.output_text), dict)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in oai.chat.completions.create(
        model="smollm2", messages=ask, temperature=0, max_tokens=64, response_format=schema, stream=True)
        if chunk.choices)
    assert json.loads(streamed) == answer
    with pytest.raises(openai.BadRequestError) as bad:
        oai.chat.completions.create(model="smollm2", messages=ask, response_format={"type": "yaml"})
    assert bad.value.body["param"] == "response_format"


def test_response_format_json_schema_constrains_the_reply_to_the_schema(oai):
    """The object must satisfy the schema itself (keys, required, types, enums), not just be JSON: the 135M model
    answers with exactly the keys asked for, in both APIs; an unusable schema is a 400 naming the parameter."""
    ask = [{"role": "user", "content": "Give the capital of France as JSON."}]
    schema = {"type": "object", "additionalProperties": False, "required": ["country", "capital", "continent"],
              "properties": {"country": {"type": "string"}, "capital": {"type": "string"},
                             "continent": {"enum": ["Europe", "Asia", "Africa", "America", "Oceania"]},
                             "population_millions": {"type": "integer"}}}
    reply = oai.chat.completions.create(model="smollm2", messages=ask, temperature=0, max_tokens=96,
                                        response_format={"type": "json_schema",
                                                         "json_schema": {"name": "capital", "schema": schema}})
    answer = json.loads(reply.choices[0].message.content)
    assert {"country", "capital", "continent"} <= set(answer) <= set(schema["properties"])
    assert answer["continent"] in schema["properties"]["continent"]["enum"] and answer["capital"] == "Paris"
    assert isinstance(answer.get("population_millions", 0), int)
    response = oai.responses.create(model="smollm2", input=ask[0]["content"], temperature=0, max_output_tokens=96,
                                    text={"format": {"type": "json_schema", "name": "capital", "schema": schema}})
    assert json.loads(response.output_text) == answer
    for bad_schema, why in (({"$ref": "#/$defs/Nope"}, "unusable JSON schema"),
                            ({"type": "array"}, "top level must be an object")):
        with pytest.raises(openai.BadRequestError) as bad:
            oai.chat.completions.create(model="smollm2", messages=ask, response_format={
                "type": "json_schema", "json_schema": {"name": "x", "schema": bad_schema}})
        assert bad.value.body["param"] == "response_format" and why in bad.value.body["message"]


def test_anthropic_system_messages_inside_messages_join_the_system_prompt(ant):
    """Claude Code sends a `role: "system"` message inside `messages` for a model name it does not know: it is
    read as more system prompt (after `system`), so the rendered prompt is the one with that text in `system`."""
    user = {"role": "user", "content": "hi"}
    inside = ant.messages.count_tokens(model="smollm2", system="Be brief.", messages=[
        user, {"role": "system", "content": [{"type": "text", "text": "The user is in Paris."}]}]).input_tokens
    joined = ant.messages.count_tokens(model="smollm2", system="Be brief.\n\nThe user is in Paris.",
                                       messages=[user]).input_tokens
    assert inside == joined
    reply = ant.messages.create(model="smollm2", max_tokens=4, messages=[user, {"role": "system", "content": "x"}])
    assert reply.stop_reason in ("end_turn", "max_tokens")
    with pytest.raises(anthropic.BadRequestError, match="must be 'user', 'assistant' or 'system'"):
        ant.messages.create(model="smollm2", max_tokens=4, messages=[{"role": "tool", "content": "x"}])


def test_responses_namespace_tools_offer_their_functions_and_hosted_tools_are_left_out(oai):
    """Codex offers its sub-agent tools inside one `namespace` tool; a forced call then names one of them. A hosted
    tool type (web_search) is left out rather than refusing the agent's request."""
    close = {"type": "function", "name": "close_agent", "description": "Close an agent.", "strict": False,
             "parameters": {"type": "object", "properties": {"target": {"type": "string"}}, "required": ["target"],
                            "additionalProperties": False}}
    tools = [{"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.", "tools": [close]},
             {"type": "web_search"}]
    response = oai.responses.create(model="smollm2", input="Close agent a1.", tools=tools, tool_choice="required",
                                    temperature=0, max_output_tokens=48)
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and calls[0].name == "close_agent" and set(json.loads(calls[0].arguments)) == {"target"}
    with pytest.raises(openai.BadRequestError, match="a tool must be an object with a type"):
        oai.responses.create(model="smollm2", input="hi", tools=[{"name": "x"}], max_output_tokens=4)


def test_a_seed_past_64_bits_is_answered_and_the_server_lives_on(oai):
    for seed in (2**70, -(2**70)):
        reply = oai.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": QUESTION}],
                                            temperature=0.7, max_tokens=4, seed=seed)
        assert reply.choices[0].finish_reason in ("stop", "length")
    assert "Paris" in oai.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": QUESTION}],
                                                  temperature=0, max_tokens=24).choices[0].message.content


def test_claude_codes_changing_billing_header_does_not_defeat_the_prefix_cache(ant):
    """Claude Code opens `system` with "x-anthropic-billing-header: …; cch=<changes every request>;": dropped, so a
    resent history is still reused from its first token on."""
    rules = "You are a careful coding agent working in a large repository. " * 12
    msgs = [{"role": "user", "content": "List the files."}]
    usages = []
    for nonce in ("fa690", "0aaa9"):
        header = f"x-anthropic-billing-header: cc_version=2.1.332.0b8; cc_entrypoint=sdk-cli; cch={nonce};"
        system = [{"type": "text", "text": header}, {"type": "text", "text": rules}]
        usages.append(ant.messages.create(model="smollm2", system=system, max_tokens=4, messages=msgs).usage)
    assert usages[1].cache_read_input_tokens > 150 and usages[1].input_tokens <= 16
    plain = ant.messages.count_tokens(model="smollm2", system=rules, messages=msgs).input_tokens
    assert usages[1].input_tokens + usages[1].cache_read_input_tokens == plain  # the header is not in the prompt
