"""Reasoning effort reaches templates that read it (gpt-oss: "Reasoning: low|medium|high" in its system message):
from OpenAI's `reasoning_effort`, the Responses API's `reasoning.effort` and Anthropic's `thinking` budget; unset,
the template keeps its own default."""

from __future__ import annotations

import json

import pytest

from freetoken.engine.loader import load_model
from freetoken.server.engine import ServingEngine
from freetoken.server.requests import template_effort, thinking_effort
from support.checkpoints import write_hf_checkpoint

TEMPLATE = ("<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}<|end|>"
            "{%- for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
            "{%- if add_generation_prompt %}<|start|>assistant{% endif %}")


@pytest.mark.parametrize("value, expected", [(None, None), ("high", "high"), ("minimal", "low"), ("none", "low"),
                                             ("medium", "medium"), ("bogus", None)])
def test_openai_efforts(value, expected):
    assert template_effort(value) == expected


@pytest.mark.parametrize("value, expected", [(None, None), ({"type": "disabled"}, "low"),
                                             ({"type": "enabled", "budget_tokens": 1024}, "low"),
                                             ({"type": "enabled", "budget_tokens": 8000}, "medium"),
                                             ({"type": "enabled", "budget_tokens": 32000}, "high")])
def test_anthropic_thinking_budgets(value, expected):
    assert thinking_effort(value) == expected


def test_the_effort_is_rendered_only_when_given(tmp_path):
    write_hf_checkpoint("llama", tmp_path)
    tok = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**tok, "chat_template": TEMPLATE}))
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    engine = ServingEngine(load_model(tmp_path, progress=False), "tiny")
    try:
        messages = [{"role": "user", "content": "Hi"}]
        assert "Reasoning: high" in engine.chat_prompt(messages, reasoning_effort="high").text
        assert "Reasoning: medium" in engine.chat_prompt(messages).text  # the template's own default
    finally:
        engine.close()
