"""ChatTemplate: HF-compatible rendering, and the sandbox holding against hostile templates."""

from __future__ import annotations

import json

import pytest

from freetoken.engine.chat_template import ChatTemplate
from freetoken.errors import ChatTemplateError

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo 🤗"}]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather <now> & later — in °C",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def test_renders_messages_and_generation_prompt() -> None:
    template = ChatTemplate(CHATML)
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhéllo 🤗<|im_end|>\n"
    assert template.render(MESSAGES, add_generation_prompt=False) == expected
    assert template.render(MESSAGES) == expected + "<|im_start|>assistant\n"


def test_trim_blocks_and_lstrip_blocks_are_on() -> None:
    source = "{% for m in messages %}\n    {% if true %}\n[{{ m.role }}]\n    {% endif %}\n{% endfor %}\n"
    assert ChatTemplate(source).render(MESSAGES) == "[system]\n[user]\n"


def test_tools_reach_the_template_through_hf_tojson() -> None:
    source = "{% for t in tools %}{{ t | tojson }}\n{{ t.function.parameters | tojson(indent=2) }}{% endfor %}"
    out = ChatTemplate(source).render(MESSAGES, tools=[WEATHER_TOOL])
    first, rest = out.split("\n", 1)
    assert first == json.dumps(WEATHER_TOOL, ensure_ascii=False)  # no HTML escaping, key order kept
    assert rest == json.dumps(WEATHER_TOOL["function"]["parameters"], ensure_ascii=False, indent=2)


def test_tojson_keyword_arguments() -> None:
    source = "{{ messages[0] | tojson(separators=(',', ':'), sort_keys=true) }}"
    assert ChatTemplate(source).render([{"role": "u", "content": "c"}]) == '{"content":"c","role":"u"}'


def test_tools_default_to_none() -> None:
    assert ChatTemplate("{{ tools is none }}").render(MESSAGES) == "True"


def test_enable_thinking_is_defined_only_when_given() -> None:
    source = "{% if enable_thinking is defined %}{{ enable_thinking }}{% else %}unset{% endif %}"
    template = ChatTemplate(source)
    assert template.render(MESSAGES) == "unset"
    assert template.render(MESSAGES, enable_thinking=False) == "False"
    assert template.render(MESSAGES, enable_thinking=True) == "True"


def test_special_tokens_and_extra_variables() -> None:
    template = ChatTemplate("{{ bos_token }}|{{ eos_token }}|{{ custom }}", bos_token="<s>", eos_token="</s>")
    assert template.render(MESSAGES, custom=42) == "<s>|</s>|42"


def test_strftime_now_and_loopcontrols_and_generation_tag() -> None:
    source = (
        "{{ strftime_now('%Y') | length }}"
        "{% for m in messages %}{% if loop.first %}{% continue %}{% endif %}{{ m.role }}{% break %}{% endfor %}"
        "{% generation %}!{% endgeneration %}"
    )
    assert ChatTemplate(source).render(MESSAGES) == "4user!"


def test_raise_exception_becomes_chat_template_error() -> None:
    template = ChatTemplate("{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}")
    with pytest.raises(ChatTemplateError, match="first must be user"):
        template.render(MESSAGES)


def test_syntax_error_names_the_line() -> None:
    with pytest.raises(ChatTemplateError, match="line 2"):
        ChatTemplate("ok\n{{ messages[0] ) }}\nmore")


@pytest.mark.parametrize("source", ["", "   \n"])
def test_empty_template_is_refused(source: str) -> None:
    with pytest.raises(ChatTemplateError):
        ChatTemplate(source)


def test_render_errors_are_one_line_chat_template_errors() -> None:
    template = ChatTemplate("{{ messages[0]['content'].nonexistent_method() }}")
    with pytest.raises(ChatTemplateError) as err:
        template.render(MESSAGES)
    assert "\n" not in str(err.value)
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ 1 / 0 }}").render(MESSAGES)


ESCAPES = [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__ }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ raise_exception.__globals__ }}",
    "{{ strftime_now.__globals__['__builtins__'] }}",
    "{{ self.__init__ }}",
    "{{ namespace.__init__.__globals__.os }}",
    "{{ '{0.__class__.__mro__}'.format(1) }}",
    "{{ messages.append({'role': 'x'}) }}",
    "{% set d = {} %}{{ d.update({'a': 1}) }}",
    "{{ messages[0].clear() }}",
    "{{ lipsum.__globals__ }}",
    "{{ 'x' * 100000000 }}",
    "{{ [0] * 100000000 }}",
    "{{ 10 ** 100000 }}",
    "{% set ns = namespace(x=3) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
]


@pytest.mark.parametrize("source", ESCAPES)
def test_sandbox_escapes_raise(source: str) -> None:
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ChatTemplateError):
        ChatTemplate(source).render(messages)
    assert messages == [{"role": "user", "content": "hi"}]  # nothing was mutated
