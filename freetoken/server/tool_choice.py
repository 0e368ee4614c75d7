"""`tool_choice` in each protocol, and how a reply is made to open as a tool call in the model's own format.

`required` (Anthropic: `any`) and a named tool are honoured by writing the opening of a call after the
generation prompt, in the syntax the model's chat template teaches it (Hermes/Qwen `<tool_call>` JSON,
Qwen3-Coder XML, Mistral `[TOOL_CALLS]`, Llama 3 JSON): the model continues from inside the call, and the output
parser is fed the same opening so it reads the whole call. A named choice writes the name too, so only the
arguments are the model's. The rendered prompt before the opening stays what `auto` renders, so a forced turn
reuses the same cached prefix. This steers the reply; the sampler also keeps each call a call of an offered tool
in the model's format, JSON arguments valid under the tool's schema (engine/call_languages.py).

A template that ignores tools (it never mentions them) gets them described in the system message with the
Hermes format, so a model without tool training can still be asked for calls the parser reads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from freetoken.engine.call_languages import DSML_INVOKE, DSML_OPEN, DSML_V32_OPEN, call_head
from freetoken.engine.tokenizer import HARMONY_MARKERS
from freetoken.server.errors import APIError

_, _, CHANNEL, MESSAGE, CONSTRAIN = HARMONY_MARKERS


@dataclass(frozen=True, slots=True)
class ToolChoice:
    mode: str = "auto"  # "auto", "none", "required" or "named"
    name: str | None = None
    parallel: bool = True  # False: at most one call in the reply (OpenAI parallel_tool_calls, Anthropic's
    #                        disable_parallel_tool_use)

    @property
    def forces_call(self) -> bool:
        return self.mode in ("required", "named")


def openai_choice(value: Any, names: list[str], responses: bool = False, parallel: bool | None = True) -> ToolChoice:
    """Chat Completions: "auto" | "none" | "required" | {"type": "function", "function": {"name"}}; the
    Responses API names the function at the top level ({"type": "function", "name"}). `parallel`: the request's
    `parallel_tool_calls` (None: not given, allowed)."""
    if value is None or value in ("auto", "none", "required"):
        return _checked(ToolChoice(value or "auto", parallel=parallel is not False), names)
    if isinstance(value, dict) and value.get("type") == "function":
        inner = value if responses else value.get("function")
        name = inner.get("name") if isinstance(inner, dict) else None
        if isinstance(name, str):
            return _checked(ToolChoice("named", name, parallel=parallel is not False), names)
    shape = '{"type": "function", "name": ...}' if responses else \
        '{"type": "function", "function": {"name": ...}}'
    raise APIError(400, f"tool_choice must be 'auto', 'none', 'required' or {shape}", param="tool_choice")


def anthropic_choice(value: Any, names: list[str]) -> ToolChoice:
    """Messages: {"type": "auto" | "any" | "none"} or {"type": "tool", "name"}, each with an optional
    `disable_parallel_tool_use`."""
    if value is None:
        return ToolChoice()
    kind = value.get("type") if isinstance(value, dict) else None
    parallel = not (kind is not None and value.get("disable_parallel_tool_use") is True)
    if kind in ("auto", "none"):
        return _checked(ToolChoice(kind, parallel=parallel), names)
    if kind == "any":
        return _checked(ToolChoice("required", parallel=parallel), names)
    if kind == "tool" and isinstance(value.get("name"), str):
        return _checked(ToolChoice("named", value["name"], parallel=parallel), names)
    raise APIError(400, "tool_choice must be {'type': 'auto' | 'any' | 'none'} or {'type': 'tool', 'name': ...}",
                   param="tool_choice")


def _checked(choice: ToolChoice, names: list[str]) -> ToolChoice:
    if choice.forces_call and not names:
        raise APIError(400, f"tool_choice {choice.mode!r} needs tools to choose from", param="tool_choice")
    if choice.mode == "named" and choice.name not in names:
        raise APIError(400, f"tool_choice names {choice.name!r}, which is not among the tools "
                            f"({', '.join(names)})", param="tool_choice")
    return choice


def call_syntax(template_source: str) -> str:
    """The tool-call syntax a chat template teaches: "mistral-args", "mistral-json", "qwen-xml", "glm",
    "deepseek" (V3.1's `NAME<｜tool▁sep｜>{…}`), "deepseek-fenced" (V3/R1's `function<｜tool▁sep｜>NAME` and a
    json fence), "dsml" (V4's `<｜DSML｜invoke name="NAME">` with tagged parameters; "dsml-function-calls": V3.2's
    spelling of the block), "harmony" (gpt-oss: `<|channel|>commentary to=functions.NAME`), "hermes", "llama3",
    or "none" (the template never renders tools)."""
    if CHANNEL in template_source and MESSAGE in template_source:
        return "harmony"
    if "DSML" in template_source:  # DeepSeek-V4 (V3.2: `function_calls` blocks)
        return "dsml-function-calls" if "function_calls" in template_source else "dsml"
    if "tool▁calls▁begin" in template_source:
        return "deepseek-fenced" if "```json" in template_source else "deepseek"
    if "<arg_key>" in template_source:
        return "glm"
    if "[TOOL_CALLS]" in template_source:
        return "mistral-args" if "[ARGS]" in template_source else "mistral-json"
    if "<tool_call>" in template_source:
        return "qwen-xml" if "<function=" in template_source else "hermes"
    if "tools" in template_source and ("<|python_tag|>" in template_source or "ipython" in template_source
                                       or '"parameters"' in template_source):
        return "llama3"
    return "hermes" if "tools" in template_source else "none"


def call_opener(choice: ToolChoice, syntax: str, in_reasoning: bool = False) -> str:
    """What to write after the generation prompt so the reply is (the rest of) a tool call; "" for auto/none.
    `in_reasoning`: the prompt left a reasoning block open, which the opener closes first."""
    if not choice.forces_call:
        return ""
    name = choice.name
    if syntax == "mistral-args":
        opener = "[TOOL_CALLS]" + (f"{name}[ARGS]" if name else "")
    elif syntax == "mistral-json":
        opener = "[TOOL_CALLS][" + (call_head(name) if name else "")
    elif syntax == "qwen-xml":
        opener = "<tool_call>\n<function=" + (f"{name}>\n" if name else "")
    elif syntax == "llama3":
        opener = f'{{"name": {json.dumps(name)}, "parameters": ' if name else '{"name": "'
    elif syntax == "glm":
        opener = "<tool_call>" + (f"{name}\n" if name else "")
    elif syntax == "deepseek":
        opener = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>" + (f"{name}<｜tool▁sep｜>" if name else "")
    elif syntax in ("dsml", "dsml-function-calls"):
        block = DSML_OPEN if syntax == "dsml" else DSML_V32_OPEN
        opener = f"{block}\n{DSML_INVOKE}\"" + (f"{name}\">\n" if name else "")
    elif syntax == "harmony":  # the prompt ends with <|start|>assistant: the reply's first header is the call's
        opener = f"{CHANNEL}commentary to=functions." + (f"{name} {CONSTRAIN}json{MESSAGE}" if name else "")
    elif syntax == "deepseek-fenced":
        opener = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>" + \
            (f"{name}\n```json\n" if name else "")
    else:  # hermes, and templates taught the Hermes format by `describe_tools`
        opener = "<tool_call>\n" + (call_head(name) if name else "")
    return ("</think>\n\n" if in_reasoning else "") + opener


def describe_tools(tools: list[dict]) -> str:
    """A system-message section offering `tools` (OpenAI function shape) in the Hermes format."""
    listed = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    return ("You can call these functions. To call one, answer with <tool_call>{\"name\": <function name>, "
            "\"arguments\": <arguments object>}</tool_call>; several calls may follow each other.\n"
            f"<tools>\n{listed}\n</tools>")


def with_tools_described(messages: list[dict], tools: list[dict]) -> list[dict]:
    """`messages` with the tools described in the system message (one is added where there is none)."""
    section = describe_tools(tools)
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0])
        first["content"] = f"{first.get('content') or ''}\n\n{section}".lstrip()
        return [first, *messages[1:]]
    return [{"role": "system", "content": section}, *messages]
