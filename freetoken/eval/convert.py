"""A turn's request in another protocol (`ft eval --protocol`): replaying, say, the Claude-Code-like trace over
chat completions against a server without /v1/messages.

Through one neutral form: messages of role system/user/assistant/tool with their text, an assistant's calls
(id, name, JSON arguments) and a tool message's call id; plus the tools (name, description, schema) and the
reply's sampling (length, temperature, reasoning effort). Reasoning blocks and protocol-only fields (cache
control, metadata, store) are dropped: the conversation, its tools and its lengths are what a replay compares.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from freetoken.eval.trace import Turn


@dataclass(slots=True)
class Message:
    role: str  # system | user | assistant | tool
    text: str = ""
    calls: list[tuple[str, str, str]] = field(default_factory=list)  # (id, name, arguments as JSON text)
    call_id: str = ""  # a tool message's


def converted(turn: Turn, protocol: str) -> tuple[dict, list]:
    """(request, messages) of `turn` in `protocol`."""
    if protocol == turn.protocol:
        return turn.request, turn.messages
    messages, tools, sampling = _READ[turn.protocol](turn.request, turn.messages)
    return _WRITE[protocol](messages, tools, sampling)


def _text(content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") in
                   ("text", "input_text", "output_text"))


def _read_anthropic(request: dict, messages: list) -> tuple[list[Message], list[dict], dict]:
    out = [Message("system", _text(request["system"]))] if request.get("system") else []
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            out.append(Message(m["role"], content))
            continue
        if m["role"] == "assistant":
            calls = [(b["id"], b["name"], json.dumps(b.get("input", {}))) for b in content if b["type"] == "tool_use"]
            out.append(Message("assistant", _text(content), calls))
            continue
        for block in content:
            if block.get("type") == "tool_result":
                out.append(Message("tool", _text(block.get("content")), call_id=block["tool_use_id"]))
        text = _text(content)
        if text:
            out.append(Message("user", text))
    tools = [{"name": t["name"], "description": t.get("description", ""),
              "schema": t.get("input_schema", {"type": "object"})} for t in request.get("tools") or []]
    effort = "high" if (request.get("thinking") or {}).get("type") == "enabled" else None
    return out, tools, {"max_tokens": request.get("max_tokens"), "temperature": request.get("temperature"),
                        "effort": effort}


def _read_openai(request: dict, messages: list) -> tuple[list[Message], list[dict], dict]:
    out = []
    for m in messages:
        role = "system" if m["role"] == "developer" else m["role"]
        calls = [(c["id"], c["function"]["name"], c["function"].get("arguments") or "{}")
                 for c in m.get("tool_calls") or []]
        out.append(Message(role, _text(m.get("content")), calls, m.get("tool_call_id", "")))
    tools = [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
              "schema": t["function"].get("parameters", {"type": "object"})} for t in request.get("tools") or []]
    return out, tools, {"max_tokens": request.get("max_tokens") or request.get("max_completion_tokens"),
                        "temperature": request.get("temperature"), "effort": request.get("reasoning_effort")}


def _read_responses(request: dict, items: list) -> tuple[list[Message], list[dict], dict]:
    out = [Message("system", request["instructions"])] if request.get("instructions") else []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            out.append(Message(role, _text(item.get("content"))))
        elif kind == "function_call":
            if not out or out[-1].role != "assistant":
                out.append(Message("assistant"))
            out[-1].calls.append((item["call_id"], item["name"], item.get("arguments") or "{}"))
        elif kind == "function_call_output":
            out.append(Message("tool", _text(item.get("output")), call_id=item["call_id"]))
    tools = [{"name": t["name"], "description": t.get("description", ""),
              "schema": t.get("parameters", {"type": "object"})} for t in request.get("tools") or []
             if t.get("type") == "function"]
    return out, tools, {"max_tokens": request.get("max_output_tokens"), "temperature": request.get("temperature"),
                        "effort": (request.get("reasoning") or {}).get("effort")}


def _write_anthropic(messages: list[Message], tools: list[dict], sampling: dict) -> tuple[dict, list]:
    system = "\n\n".join(m.text for m in messages if m.role == "system")
    out: list[dict] = []
    for m in messages:
        if m.role == "system":
            continue
        role = "assistant" if m.role == "assistant" else "user"
        blocks = []
        if m.role == "tool":
            blocks.append({"type": "tool_result", "tool_use_id": m.call_id, "content": m.text})
        elif m.text:
            blocks.append({"type": "text", "text": m.text})
        blocks += [{"type": "tool_use", "id": i, "name": n, "input": json.loads(a or "{}")} for i, n, a in m.calls]
        if out and out[-1]["role"] == role:  # Messages alternates roles: tool results and text share a turn
            out[-1]["content"] += blocks
        else:
            out.append({"role": role, "content": blocks})
    request: dict[str, Any] = {"max_tokens": sampling["max_tokens"] or 4096}
    if system:
        request["system"] = system
    if tools:
        request["tools"] = [{"name": t["name"], "description": t["description"], "input_schema": t["schema"]}
                            for t in tools]
    if sampling["temperature"] is not None:
        request["temperature"] = min(1.0, sampling["temperature"])
    return request, out


def _write_openai(messages: list[Message], tools: list[dict], sampling: dict) -> tuple[dict, list]:
    out = []
    for m in messages:
        if m.role == "tool":
            out.append({"role": "tool", "tool_call_id": m.call_id, "content": m.text})
        elif m.role == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": m.text or None}
            if m.calls:
                msg["tool_calls"] = [{"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                                     for i, n, a in m.calls]
            out.append(msg)
        else:
            out.append({"role": m.role, "content": m.text})
    request: dict[str, Any] = {"max_tokens": sampling["max_tokens"] or 4096}
    if tools:
        request["tools"] = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                              "parameters": t["schema"]}} for t in tools]
    if sampling["temperature"] is not None:
        request["temperature"] = sampling["temperature"]
    if sampling["effort"]:
        request["reasoning_effort"] = sampling["effort"]
    return request, out


def _write_responses(messages: list[Message], tools: list[dict], sampling: dict) -> tuple[dict, list]:
    items: list[dict] = []
    system = [m.text for m in messages if m.role == "system"]
    for m in messages:
        if m.role == "tool":
            items.append({"type": "function_call_output", "call_id": m.call_id, "output": m.text})
        elif m.role in ("user", "assistant"):
            if m.text:
                kind = "output_text" if m.role == "assistant" else "input_text"
                items.append({"type": "message", "role": m.role, "content": [{"type": kind, "text": m.text}]})
            items += [{"type": "function_call", "call_id": i, "name": n, "arguments": a} for i, n, a in m.calls]
    request: dict[str, Any] = {"max_output_tokens": sampling["max_tokens"] or 4096, "store": False}
    if system:
        request["instructions"] = "\n\n".join(system)
    if tools:
        request["tools"] = [{"type": "function", "name": t["name"], "description": t["description"],
                             "parameters": t["schema"]} for t in tools]
    if sampling["temperature"] is not None:
        request["temperature"] = sampling["temperature"]
    if sampling["effort"]:
        request["reasoning"] = {"effort": sampling["effort"]}
    return request, items


_READ = {"anthropic": _read_anthropic, "openai": _read_openai, "responses": _read_responses}
_WRITE = {"anthropic": _write_anthropic, "openai": _write_openai, "responses": _write_responses}
