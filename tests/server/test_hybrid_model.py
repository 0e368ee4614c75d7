"""The new families behind a real server, driven by the official clients. Models with recurrent state (tiny
Qwen3-Next: Gated DeltaNet layers beside full attention; tiny DeepSeek-V4: compressed attention; offloaded
experts): an agent's growing conversation reuses the snapshot the last turn left (cached tokens reported, the
same answer as a cold server gives), concurrent requests answer as each does alone, streaming works in both
protocols, a forced tool call comes back parsed. A
tiny GLM-4.5 with a template in its call format: a forced call in that format, constrained and parsed; likewise a
tiny gpt-oss with a Harmony template and a tiny DeepSeek-V4 with a DSML one."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
import torch

from freetoken.engine.loader import load_model
from support.checkpoints import VOCAB_SIZE, add_special_tokens, write_hf_checkpoint
from support.servers import start_server

# closed and enumerated, so a random model has few tokens to choose from; it likes whitespace, which the
# constraint bounds (20 in a row between tokens), so the call closes within a few hundred tokens
UNITS = {"type": "function", "function": {"name": "set_units", "description": "Units of the reply",
                                          "parameters": {"type": "object", "required": ["units"],
                                                         "additionalProperties": False,
                                                         "properties": {"units": {"enum": ["metric", "imperial"]}}}}}


@pytest.fixture(scope="module", params=["qwen3_next", "deepseek_v4"])
def hybrid(request, tmp_path_factory):
    """A model whose layers keep per-sequence recurrent state: Qwen3-Next's DeltaNet, DeepSeek-V4's compressed
    attention (its whole attention state)."""
    path = tmp_path_factory.mktemp(request.param)
    write_hf_checkpoint(request.param, path)
    config = json.loads((path / "config.json").read_text())  # room for the described tools (a 256-token model)
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1024}))
    return path


def _serve(path):
    probe = load_model(path, progress=False)
    budget = 6 * probe.moe_spec.bytes_per_expert(torch.float32)  # 6 slots for 24 routed experts
    return start_server(load_model(path, progress=False, expert_cache=budget), "tiny")


def _chat(url: str, messages: list[dict]):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    return client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)


def test_a_follow_up_turn_reuses_the_last_turns_state(hybrid):
    server = _serve(hybrid)
    try:
        history = [{"role": "user", "content": "the quick brown fox"}]
        first = _chat(server.url, history)
        history += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                    {"role": "user", "content": "and then?"}]
        second = _chat(server.url, history)
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert 0 < cached < second.usage.prompt_tokens
        stats = server.engine.stats()["engine"]["kv"]
        assert stats["snapshots"] > 0 and stats["prefix_hit_tokens"] == cached
    finally:
        server.stop()
    cold = _serve(hybrid)
    try:
        assert _chat(cold.url, history).choices[0].message.content == second.choices[0].message.content
    finally:
        cold.stop()


def test_an_edited_last_message_restarts_from_the_boundary_before_it(hybrid):
    """A recurrent model cannot drop tokens from its state, so the server snapshots it at the last message ends
    inside each prompt: a request whose history differs only in its last message (an agent rewriting a tool
    result) recomputes from the end of the message before it, and answers as a cold server does."""
    history = [{"role": "user", "content": "the quick brown fox"}, {"role": "assistant", "content": "jumps over"},
               {"role": "user", "content": "the lazy dog"}]
    edited = [*history[:2], {"role": "user", "content": "a sleepy cat instead"}]
    server = _serve(hybrid)
    try:
        _chat(server.url, history)
        reply = _chat(server.url, edited)
        cached = reply.usage.prompt_tokens_details.cached_tokens
        tok = server.engine.lm.tokenizer
        shared = tok.encode(tok.apply_chat_template(history[:2], add_generation_prompt=False))
        end_of_turn = max(i + 1 for i, t in enumerate(shared) if t in tok.eos_token_ids)
        assert cached == end_of_turn > 0  # the snapshot just past the assistant's message, the last one shared
    finally:
        server.stop()
    cold = _serve(hybrid)
    try:
        assert _chat(cold.url, edited).choices[0].message.content == reply.choices[0].message.content
    finally:
        cold.stop()


def test_concurrent_requests_answer_as_each_does_alone(hybrid):
    """Three clients at once (an agent's turn beside its title request and a subagent): Qwen3-Next's requests
    share forwards, each sequence's recurrent state updated from its own rows (DeepSeek-V4's queue one at a time);
    each answer equals the one the same request gets alone."""
    from concurrent.futures import ThreadPoolExecutor

    conversations = [[{"role": "user", "content": text}] for text in
                     ("the quick brown fox", "write a title for this chat", "a subagent's own task")]
    server = _serve(hybrid)
    try:
        with ThreadPoolExecutor(len(conversations)) as pool:
            together = list(pool.map(lambda m: _chat(server.url, m).choices[0].message.content, conversations))
    finally:
        server.stop()
    alone = _serve(hybrid)
    try:
        assert together == [_chat(alone.url, m).choices[0].message.content for m in conversations]
    finally:
        alone.stop()


def test_streams_and_a_forced_call_through_both_protocols(hybrid):
    server = _serve(hybrid)
    try:
        oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        chunks = list(oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=6, temperature=0, stream=True))
        assert chunks and chunks[-1].choices[0].finish_reason in ("length", "stop")  # (a random model's EOS)
        reply = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Units?"}],
                                            tools=[UNITS], tool_choice="required", temperature=0, max_tokens=300)
        assert reply.choices[0].finish_reason == "tool_calls", reply.choices[0].message
        call = reply.choices[0].message.tool_calls[0]
        assert call.function.name == "set_units"
        assert json.loads(call.function.arguments) in ({"units": "metric"}, {"units": "imperial"})
        claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
        with claude.messages.stream(model="tiny", max_tokens=6, extra_body={"temperature": 0},
                                    messages=[{"role": "user", "content": "hi"}]) as s:
            text = "".join(s.text_stream)
            final = s.get_final_message()
        assert final.stop_reason in ("max_tokens", "end_turn") and final.usage.output_tokens <= 6
        assert text == "".join(b.text for b in final.content if b.type == "text")
    finally:
        server.stop()


# A GLM-4.5-style template (its call syntax: <tool_call>NAME, then <arg_key>/<arg_value> pairs).
GLM_TEMPLATE = (
    "{%- if tools %}<|system|>\nTools:\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "Call one as <tool_call>NAME\n<arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>\n</tool_call>\n{% endif %}"
    "{%- for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


# A DeepSeek-V4-style template (its DSML call blocks; the markers as V4's encoding writes them).
DSML_TEMPLATE = (
    "{%- if tools %}## Tools\nYou can invoke tools by writing a \"<｜DSML｜tool_calls>\" block like the following:\n"
    "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"$TOOL_NAME\">\n<｜DSML｜parameter name=\"$PARAMETER_NAME\" "
    "string=\"true|false\">$PARAMETER_VALUE</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}{% endif %}"
    "{%- for m in messages %}{% if m.role == 'user' %}<｜User｜>{{ m.content }}{% else %}<｜Assistant｜>"
    "{{ m.content }}<｜end▁of▁sentence｜>{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<｜Assistant｜></think>{% endif %}"
)


# A Harmony-style template (gpt-oss): messages as <|start|>role…<|message|>…<|end|>, tools taught in the developer
# message, calls as a commentary message to=functions.NAME.
HARMONY_TEMPLATE = (
    "{%- if tools %}<|start|>developer<|message|># Tools\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "Call one as <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGUMENTS<|call|><|end|>"
    "{% endif %}"
    "{%- for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant{% endif %}"
)


@pytest.mark.parametrize("family, template", [("glm4_moe", GLM_TEMPLATE), ("gpt_oss", HARMONY_TEMPLATE),
                                              ("deepseek_v4", DSML_TEMPLATE)])
def test_a_forced_call_in_the_models_own_format_through_the_server(family, template, tmp_path):
    """GLM-4.5 writes calls in its own tag format, gpt-oss as Harmony messages, DeepSeek-V4 as DSML blocks: a tiny
    model of each family with such a template answers a forced call in it (constrained: an offered name, its
    schema's keys, an enum's value; one call, parallel calls turned off) and the server returns it parsed, in
    both protocols."""
    markers = ["｜DSML｜"] if family == "deepseek_v4" else []  # one token in V4's tokenizer, as there
    write_hf_checkpoint(family, tmp_path, vocab_size=VOCAB_SIZE + len(markers))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1024}))
    tok = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**tok, "chat_template": template}))
    if markers:
        add_special_tokens(tmp_path, markers)
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    server = start_server(load_model(tmp_path, progress=False), "tiny")
    try:
        oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        for choice in ("required", {"type": "function", "function": {"name": "set_units"}}):
            # one call (a random model would happily go on calling where the format allows several: DSML)
            reply = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Units?"}],
                                                tools=[UNITS], tool_choice=choice, temperature=0, max_tokens=300,
                                                parallel_tool_calls=False)
            assert reply.choices[0].finish_reason == "tool_calls", reply.choices[0].message
            assert len(reply.choices[0].message.tool_calls) == 1
            call = reply.choices[0].message.tool_calls[0]
            assert call.function.name == "set_units"
            assert json.loads(call.function.arguments) in ({"units": "metric"}, {"units": "imperial"})
        ant = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
        tool = {"name": "set_units", "description": "Units", "input_schema": UNITS["function"]["parameters"]}
        msg = ant.messages.create(model="tiny", max_tokens=300, tools=[tool],
                                  tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                  messages=[{"role": "user", "content": "Units?"}])
        assert msg.stop_reason == "tool_use"
        assert [b.input for b in msg.content if b.type == "tool_use"][0] in ({"units": "metric"},
                                                                             {"units": "imperial"})
    finally:
        server.stop()
