"""Through a real server: a template that opens a reasoning block puts the reply in each protocol's reasoning field
(OpenAI `reasoning_content`, Anthropic `thinking` blocks, Responses `reasoning` items), streamed and not, and
turning thinking off in each protocol's own way (`reasoning_effort: none`, `thinking: disabled`, `reasoning.effort:
none`) reaches the template, which then closes the block empty so the reply is the answer."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from freetoken.engine.loader import load_model
from support.checkpoints import write_hf_checkpoint
from support.servers import start_server

# Qwen3's behaviour: the assistant turn opens <think> unless enable_thinking is false, then it holds an empty block
TEMPLATE = ("{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{%- if add_generation_prompt %}<|im_start|>assistant\n"
            "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
            "{%- else %}<think>\n{% endif %}{% endif %}")
ASK = [{"role": "user", "content": "Why is the sky blue?"}]


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory):
    path = tmp_path_factory.mktemp("thinking")
    write_hf_checkpoint("llama", path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    (path / "chat_template.jinja").unlink(missing_ok=True)
    running = start_server(load_model(path, progress=False), "tiny")
    yield running
    running.stop()


def test_openai_chat_puts_the_reasoning_in_reasoning_content(thinking_server):
    oai = openai.OpenAI(base_url=f"{thinking_server.url}/v1", api_key="unused", max_retries=0)
    ask = {"model": "tiny", "messages": ASK, "max_tokens": 12, "extra_body": {"temperature": 0}}
    whole = oai.chat.completions.create(**ask)
    reply = whole.choices[0].message
    assert reply.reasoning_content and not reply.content  # the random model never closes the block
    assert whole.usage.completion_tokens_details.reasoning_tokens == whole.usage.completion_tokens
    streamed = [c.choices[0].delta for c in oai.chat.completions.create(**ask, stream=True) if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in streamed) == reply.reasoning_content
    assert not "".join(d.content or "" for d in streamed)
    off_reply = oai.chat.completions.create(**ask, reasoning_effort="none")
    off = off_reply.choices[0].message
    assert off.content and not getattr(off, "reasoning_content", None)
    assert off_reply.usage.completion_tokens_details.reasoning_tokens == 0


def test_anthropic_messages_put_the_reasoning_in_thinking_blocks(thinking_server):
    ant = anthropic.Anthropic(base_url=thinking_server.url, api_key="unused", max_retries=0)
    # greedy, as the other protocols' cases: sampled, the random model's reply with thinking off was now and then
    # an end of turn at once (an empty text block; CI, 2026-12-05)
    ask = {"model": "tiny", "messages": ASK, "max_tokens": 12, "extra_body": {"temperature": 0}}
    reply = ant.messages.create(**ask)
    assert [b.type for b in reply.content] == ["thinking"] and reply.content[0].thinking
    with ant.messages.stream(**ask) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e.delta.thinking for e in events if e.type == "content_block_delta" and e.delta.type == "thinking_delta"]
    assert deltas and [b.type for b in final.content] == ["thinking"] and final.content[0].thinking == "".join(deltas)
    off = ant.messages.create(**ask, thinking={"type": "disabled"})
    assert [b.type for b in off.content] == ["text"] and off.content[0].text


def test_responses_put_the_reasoning_in_a_reasoning_item(thinking_server):
    oai = openai.OpenAI(base_url=f"{thinking_server.url}/v1", api_key="unused", max_retries=0)
    ask = {"model": "tiny", "input": "Why is the sky blue?", "max_output_tokens": 12, "temperature": 0}
    reply = oai.responses.create(**ask)
    assert [o.type for o in reply.output] == ["reasoning"] and reply.output[0].summary[0].text
    assert reply.usage.output_tokens_details.reasoning_tokens == reply.usage.output_tokens
    events = list(oai.responses.create(**ask, stream=True))
    deltas = [e.delta for e in events if e.type == "response.reasoning_summary_text.delta"]
    assert "".join(deltas) == reply.output[0].summary[0].text
    assert events[-1].response.usage.output_tokens_details.reasoning_tokens == reply.usage.output_tokens
    off = oai.responses.create(**ask, reasoning={"effort": "none"})
    assert [o.type for o in off.output] == ["message"] and off.output_text
