"""The bundled traces, generated: five agent-session shapes with their token lengths as parameters.

    claude-code  /v1/messages: a ~22k-token system prompt and tool schemas, 16 tool_use/tool_result turns, a
                 subagent (Task) branch of its own, and a context edit that clears old tool results
    opencode     /v1/chat/completions: ~13k tokens of system prompt and tools, 14 tool-call turns, and the side
                 request that titles the session, sent beside the first turn
    codex        /v1/responses: instructions, function tools and input items, 12 shell/apply_patch turns, and a
                 rewind (the user backs up three turns and asks again)
    openclaw     /v1/chat/completions: a long assistant session on a ≈24k-token floor (persona, workspace files,
                 memory, skills, 20 tools), 13 turns, mostly text replies with a memory lookup every third
    reasoning    /v1/chat/completions: one hard question with a long reasoning reply

The lengths reproduce the shape of real sessions; the text is seeded filler (eval/text.py), never copied. Every
`*_tokens` parameter is multiplied by `scale` (CI replays each shape at a small scale); counts stay as given.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from freetoken.errors import FreeTokenError
from freetoken.eval.text import IDENTIFIERS, TextGen
from freetoken.eval.trace import Trace, Turn

DEFAULTS: dict[str, dict[str, float]] = {
    "claude-code": {"system_tokens": 9000, "tool_tokens": 13000, "tools": 18, "turns": 16, "context_tokens": 1500,
                    "user_tokens": 120, "result_tokens": 1200, "output_tokens": 150, "final_output_tokens": 500,
                    "subagent_at": 6, "subagent_turns": 5, "subagent_system_tokens": 3000, "edit_at": 12,
                    "think_s": 1.0},
    "opencode": {"system_tokens": 7000, "tool_tokens": 6000, "tools": 11, "turns": 14, "user_tokens": 100,
                 "result_tokens": 1000, "output_tokens": 150, "final_output_tokens": 400, "think_s": 1.0},
    "codex": {"system_tokens": 5500, "tool_tokens": 3500, "tools": 7, "turns": 12, "context_tokens": 900,
              "user_tokens": 100, "result_tokens": 900, "output_tokens": 200, "final_output_tokens": 400,
              "rewind_at": 9, "rewind_to": 6, "think_s": 1.0},
    "openclaw": {"system_tokens": 17000, "tool_tokens": 7000, "tools": 20, "turns": 13, "user_tokens": 60,
                 "result_tokens": 700, "output_tokens": 280, "final_output_tokens": 280, "tool_every": 3,
                 "think_s": 8.0},
    "reasoning": {"system_tokens": 60, "user_tokens": 250, "output_tokens": 2048},
}
DESCRIPTIONS = {
    "claude-code": "Claude-Code-like session over /v1/messages: long system prompt and tools, tool_use turns, a "
                   "subagent branch, a context edit",
    "opencode": "OpenCode-like session over chat completions: tool-call turns and a concurrent title request",
    "codex": "Codex-like session over /v1/responses: function calls, reasoning effort, a rewind",
    "openclaw": "OpenClaw-like long assistant session over chat completions on a ~24k-token floor",
    "reasoning": "one hard question with a long reasoning reply (chat completions)",
}
CODING_TOOLS = ["Bash", "Read", "Edit", "Write", "Glob", "Grep", "Task", "TodoWrite", "WebFetch", "WebSearch",
                "MultiEdit", "LS", "NotebookEdit", "BashOutput", "KillShell", "ExitPlanMode", "Skill", "AskUser"]


def names() -> list[str]:
    return list(DEFAULTS)


def generate(name: str, *, scale: float = 1.0, seed: int = 0, **overrides: float) -> Trace:
    """The named shape's trace; `overrides` replace its default parameters (see DEFAULTS)."""
    if name not in DEFAULTS:
        raise FreeTokenError(f"no bundled trace {name!r}; the bundled traces are {', '.join(DEFAULTS)} (or give "
                             "a trace file's path)")
    unknown = set(overrides) - set(DEFAULTS[name])
    if unknown:
        raise FreeTokenError(f"trace {name} has no parameter {', '.join(sorted(unknown))}; its parameters are "
                             f"{', '.join(DEFAULTS[name])}")
    if scale <= 0:
        raise FreeTokenError(f"scale must be above 0, got {scale}")
    params = {**DEFAULTS[name], **overrides}
    lengths = {k: max(8, round(v * scale)) if k.endswith("_tokens") else v for k, v in params.items()}
    builder = _Builder(TextGen(seed), lengths)
    _SHAPES[name](builder)
    return Trace(name, builder.turns, DESCRIPTIONS[name],
                 {"shape": name, "seed": seed, "scale": scale, "params": params})


class _Builder:
    """Turns as they are made: each request's full message list, its parent, its expected reply length."""

    def __init__(self, g: TextGen, p: dict[str, float]):
        self.g, self.p, self.turns = g, p, []
        self._calls = 0

    def int(self, key: str) -> int:
        return int(self.p[key])

    def turn(self, ident: str, session: str, protocol: str, request: dict, messages: list, *, output: int,
             label: str, parent: str | None = None, after: tuple[str, ...] | None = None) -> str:
        previous = next((t.id for t in reversed(self.turns) if t.session == session), None)
        default = (parent,) if parent else (previous,) if previous else ()
        think = round(self.g.rng.uniform(0.2, 2 * self.p.get("think_s", 1.0)), 2) if previous else 0.0
        self.turns.append(Turn(ident, session, protocol, request, list(messages), output, think,
                               default if after is None else after, parent, label))
        return ident

    def reply_length(self, key: str = "output_tokens") -> int:
        base = self.int(key)
        return self.g.between(max(1, base // 2), base * 3 // 2)

    def call_id(self, prefix: str) -> str:
        self._calls += 1
        return f"{prefix}{self._calls:04d}{self.g.rng.getrandbits(40):010x}"

    def tool_result(self, tool: str) -> str:
        size = self.g.between(self.int("result_tokens") // 3, self.int("result_tokens") * 2)
        if tool in ("Read", "read", "view_file", "read_file"):
            return self.g.code(size)
        if tool in ("Grep", "Glob", "LS", "grep", "glob", "list", "shell", "Bash", "bash"):
            return self.g.listing(size)
        return self.g.prose(size)

    def schema(self) -> dict:
        props = {f"{self.g.choice(IDENTIFIERS)}_{i}": {"type": self.g.choice(["string", "integer", "boolean"]),
                                                        "description": self.g.sentence()}
                 for i in range(self.g.between(2, 4))}
        return {"type": "object", "properties": props, "required": list(props)[:1]}

    def arguments(self, tool: str) -> dict:
        if tool in ("Read", "Edit", "Write", "read", "edit", "write"):
            return {"file_path": self.g.path()}
        if tool in ("Grep", "grep", "Glob", "glob"):
            return {"pattern": self.g.ident()}
        return {"command": f"pytest -q tests/{self.g.choice(IDENTIFIERS)}"}


def _claude_code(b: _Builder) -> None:
    g = b.g
    tools = [{"name": CODING_TOOLS[i % len(CODING_TOOLS)] + ("" if i < len(CODING_TOOLS) else str(i)),
              "description": g.prose(b.int("tool_tokens") // b.int("tools")), "input_schema": b.schema()}
             for i in range(b.int("tools"))]
    system = [{"type": "text", "text": "You are a coding agent working in the user's terminal and repository."},
              {"type": "text", "text": _sections(g, b.int("system_tokens")), "cache_control": {"type": "ephemeral"}}]
    request = {"system": system, "tools": tools, "max_tokens": 32000, "temperature": 1,
               "metadata": {"user_id": "eval-user"}}
    messages: list[dict] = [{"role": "user", "content": [
        {"type": "text", "text": f"<project-notes>\n{g.bullets(b.int('context_tokens'), 'Notes')}\n</project-notes>"},
        {"type": "text", "text": g.prose(b.int("user_tokens"))}]}]
    turns, sub_at, edit_at = b.int("turns"), b.int("subagent_at"), b.int("edit_at")
    previous, waits = None, ()
    tool_names = [t["name"] for t in tools if t["name"] not in ("Task", "AskUser")]
    for i in range(1, turns + 1):
        label = "first" if i == 1 else "final" if i == turns else "after_subagent" if i == sub_at + 1 else \
            "edit" if i == edit_at else "tool_result"
        if i == edit_at:  # context editing: tool results older than the last four turns are cleared
            for m in messages[:-8]:
                for block in m["content"] if isinstance(m["content"], list) else []:
                    if block.get("type") == "tool_result":
                        block["content"] = _CLEARED
        ident = f"main-{i:02d}"
        after = None if not waits else (previous, *waits)
        b.turn(ident, "main", "anthropic", request, _copy(messages),
               output=b.reply_length("final_output_tokens" if i == turns else "output_tokens"), label=label,
               parent=previous, after=after)
        previous, waits = ident, ()
        if i == turns:
            break
        tool = "Task" if i == sub_at else g.choice(tool_names)
        use = b.call_id("toolu_")
        args = {"description": "investigate", "prompt": g.prose(b.int("user_tokens"))} if tool == "Task" \
            else b.arguments(tool)
        messages.append({"role": "assistant", "content": [{"type": "text", "text": g.sentence()},
                                                          {"type": "tool_use", "id": use, "name": tool,
                                                           "input": args}]})
        if tool == "Task":
            result, last = _subagent(b, tools, args["prompt"], ident)
            waits = (last,)
        else:
            result = b.tool_result(tool)
        messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": use,
                                                      "content": result}]})


_CLEARED = "[this tool result was cleared to save context]"


def _subagent(b: _Builder, tools: list[dict], prompt: str, spawned_by: str) -> tuple[str, str]:
    """A Task subagent: its own system prompt, a subset of the tools, a fresh conversation; returns its final
    report (the parent's tool_result) and its last turn's id."""
    g = b.g
    request = {"system": [{"type": "text", "text": _sections(g, b.int("subagent_system_tokens"))}],
               "tools": [t for t in tools if t["name"] in ("Bash", "Read", "Glob", "Grep", "LS", "WebFetch")],
               "max_tokens": 32000, "temperature": 1}
    messages, previous = [{"role": "user", "content": prompt}], None
    n = b.int("subagent_turns")
    for i in range(1, n + 1):
        ident = f"task-1-{i:02d}"
        b.turn(ident, "task-1", "anthropic", request, _copy(messages), output=b.reply_length(),
               label="subagent", parent=previous, after=(spawned_by,) if previous is None else None)
        previous = ident
        if i == n:
            break
        use, tool = b.call_id("toolu_"), g.choice(["Read", "Grep", "Glob"])
        messages += [{"role": "assistant", "content": [{"type": "tool_use", "id": use, "name": tool,
                                                       "input": b.arguments(tool)}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use,
                                                   "content": b.tool_result(tool)}]}]
    return g.prose(b.int("output_tokens") * 2), previous


def _opencode(b: _Builder) -> None:
    g = b.g
    names_ = ["bash", "read", "edit", "write", "glob", "grep", "list", "task", "todowrite", "todoread", "webfetch"]
    tools = [_openai_tool(b, names_[i % len(names_)] + ("" if i < len(names_) else str(i)),
                          b.int("tool_tokens") // b.int("tools")) for i in range(b.int("tools"))]
    request = {"tools": tools, "max_tokens": 32000, "temperature": 0}
    task = g.prose(b.int("user_tokens"))
    messages = [{"role": "system", "content": _sections(g, b.int("system_tokens"))},
                {"role": "user", "content": task}]
    title = [{"role": "system", "content": g.bullets(200, "Write a short title for the conversation")},
             {"role": "user", "content": task}]
    b.turn("title-01", "title", "openai", {"max_tokens": 64, "temperature": 0.5}, title, output=12, label="title",
           after=())
    _tool_loop(b, "openai", request, messages, [n for n in names_ if n != "task"])


def _openclaw(b: _Builder) -> None:
    g = b.g
    names_ = ["read", "write", "edit", "exec", "process", "web_search", "web_fetch", "browser", "canvas", "nodes",
              "cron", "message", "gateway", "sessions_list", "sessions_send", "sessions_spawn", "session_status",
              "memory_search", "memory_get", "image"]
    tools = [_openai_tool(b, names_[i % len(names_)] + ("" if i < len(names_) else str(i)),
                          b.int("tool_tokens") // b.int("tools")) for i in range(b.int("tools"))]
    parts, total = ["Persona", "Workspace: AGENTS.md", "Workspace: SOUL.md", "Workspace: TOOLS.md", "Memory",
                    "Skills", "Runtime"], b.int("system_tokens")
    system = "\n\n".join(g.bullets(total // len(parts), heading) for heading in parts)
    request = {"tools": tools, "max_tokens": 8192, "temperature": 0.7}
    messages = [{"role": "system", "content": system}, {"role": "user", "content": g.prose(b.int("user_tokens"))}]
    previous, every = None, b.int("tool_every")
    for i in range(1, b.int("turns") + 1):
        ident = f"main-{i:02d}"
        tool_turn = i % every == 0 and i < b.int("turns")
        b.turn(ident, "main", "openai", request, _copy(messages), output=b.reply_length(),
               label="tool_call" if tool_turn else "chat", parent=previous)
        previous = ident
        if tool_turn:  # the reply was a lookup; the next request carries its result
            call = b.call_id("call_")
            messages += [{"role": "assistant", "content": None, "tool_calls": [
                {"id": call, "type": "function",
                 "function": {"name": "memory_search", "arguments": json.dumps({"query": g.sentence(6)})}}]},
                {"role": "tool", "tool_call_id": call, "content": b.tool_result("memory_search")}]
        else:
            messages += [{"role": "assistant", "content": g.prose(b.reply_length())},
                         {"role": "user", "content": g.prose(b.int("user_tokens"))}]


def _codex(b: _Builder) -> None:
    g = b.g
    names_ = ["shell", "apply_patch", "update_plan", "view_image", "read_file", "list_dir", "grep_files"]
    tools = [{"type": "function", "name": names_[i % len(names_)] + ("" if i < len(names_) else str(i)),
              "description": g.prose(b.int("tool_tokens") // b.int("tools")), "strict": False,
              "parameters": b.schema()} for i in range(b.int("tools"))]
    request = {"instructions": _sections(g, b.int("system_tokens")), "tools": tools, "tool_choice": "auto",
               "parallel_tool_calls": False, "reasoning": {"effort": "medium", "summary": "auto"}, "store": False,
               "include": [], "max_output_tokens": 32000}

    def text_item(role: str, text: str) -> dict:
        kind = "output_text" if role == "assistant" else "input_text"
        return {"type": "message", "role": role, "content": [{"type": kind, "text": text}]}

    items = [text_item("developer", g.bullets(b.int("context_tokens") // 2, "Permissions")),
             text_item("user", "<environment_context>\n" + g.listing(b.int("context_tokens") // 2) +
                       "\n</environment_context>"),
             text_item("user", g.prose(b.int("user_tokens")))]
    history: dict[int, list] = {}
    previous, rewind_at, rewind_to = None, b.int("rewind_at"), b.int("rewind_to")
    for i in range(1, b.int("turns") + 1):
        parent = previous
        if i == rewind_at:  # the user backs up to an earlier turn and asks differently
            parent = f"main-{rewind_to:02d}"
            items = _copy(history[rewind_to]) + [text_item("user", g.prose(b.int("user_tokens")))]
        ident = f"main-{i:02d}"
        history[i] = _copy(items)
        last = i == b.int("turns")
        b.turn(ident, "main", "responses", request, _copy(items),
               output=b.reply_length("final_output_tokens" if last else "output_tokens"),
               label="final" if last else "rewind" if i == rewind_at else "first" if i == 1 else "tool_result",
               parent=parent, after=(previous,) if parent != previous else None)
        previous = ident
        if last:
            break
        tool = g.choice(["shell", "shell", "apply_patch", "read_file", "grep_files"])
        call = b.call_id("call_")
        items += [{"type": "function_call", "name": tool, "arguments": json.dumps(b.arguments(tool)),
                   "call_id": call},
                  {"type": "function_call_output", "call_id": call, "output": b.tool_result(tool)}]


def _reasoning(b: _Builder) -> None:
    g = b.g
    messages = [{"role": "system", "content": g.prose(b.int("system_tokens"))},
                {"role": "user", "content": g.prose(b.int("user_tokens")) + "\nThink it through step by step."}]
    b.turn("main-01", "main", "openai", {"max_tokens": 32768, "reasoning_effort": "high"}, messages,
           output=b.int("output_tokens"), label="reasoning")


def _tool_loop(b: _Builder, protocol: str, request: dict, messages: list, tool_names: list[str]) -> None:
    """Chat-completions tool turns: each reply is a call, each next request carries its result."""
    g, previous, n = b.g, None, b.int("turns")
    for i in range(1, n + 1):
        ident = f"main-{i:02d}"
        b.turn(ident, "main", protocol, request, _copy(messages),
               output=b.reply_length("final_output_tokens" if i == n else "output_tokens"),
               label="first" if i == 1 else "final" if i == n else "tool_result", parent=previous)
        previous = ident
        if i == n:
            break
        tool, call = g.choice(tool_names), b.call_id("call_")
        messages += [{"role": "assistant", "content": g.sentence(), "tool_calls": [
            {"id": call, "type": "function", "function": {"name": tool, "arguments": json.dumps(b.arguments(tool))}}]},
            {"role": "tool", "tool_call_id": call, "content": b.tool_result(tool)}]


def _openai_tool(b: _Builder, name: str, tokens: int) -> dict:
    return {"type": "function", "function": {"name": name, "description": b.g.prose(tokens),
                                             "parameters": b.schema()}}


def _sections(g: TextGen, tokens: int) -> str:
    headings = ["Tone and style", "Doing tasks", "Tool use", "Code references", "Safety", "Git and commits",
                "Testing", "Environment"]
    return "\n\n".join(g.bullets(tokens // len(headings), h) for h in headings)


def _copy(messages: list) -> list[Any]:
    return json.loads(json.dumps(messages))


_SHAPES: dict[str, Callable[[_Builder], None]] = {"claude-code": _claude_code, "opencode": _opencode,
                                                   "codex": _codex, "openclaw": _openclaw, "reasoning": _reasoning}
