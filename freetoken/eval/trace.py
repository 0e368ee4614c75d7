"""The agent-trace format (`freetoken-trace`, version 1): what `ft eval` replays and `ft serve --record` writes.

A trace is a JSONL file. Line 1 is the header; every further line is one turn: one request as the client sends it.

    {"type": "header", "format": "freetoken-trace", "version": 1, "name": "claude-code", "description": "...",
     "generator": {...}}            # generator: the parameters a generated trace was made with (optional)
    {"type": "turn", "id": "main-01", "session": "main", "protocol": "anthropic",
     "request": {"system": [...], "tools": [...], "max_tokens": 32000, "thinking": {...}},
     "messages": [...], "output_tokens": 120, "think_s": 1.5, "label": "tool_result"}
    {"type": "turn", "id": "main-02", "session": "main", "parent": "main-01", "keep": 2, "append": [...],
     "output_tokens": 80}

- `protocol`: `anthropic` (POST /v1/messages), `openai` (/v1/chat/completions) or `responses` (/v1/responses).
- `request`: the body without its message list (`messages`; `input` for responses) and without `model` and
  `stream`, which the replayer sets. A turn with a `parent` and no `request` or `protocol` takes its parent's.
- The message list is either whole (`messages`) or the parent's first `keep` messages followed by `append`.
  Appending to the whole parent list is the next turn of a conversation; a smaller `keep` is a history edit (a
  compaction, a cleared tool result, a rewind) or a branch. Messages are in the turn's protocol's own shape.
- `after`: ids of turns that must have finished before this one is sent (default: the parent, or else the
  session's previous turn). A subagent is a session of its own whose first turn comes `after` the turn that
  spawned it; the turn that reads its result comes after the subagent's last turn.
- `output_tokens`: the reply's length in the recorded session; the replayer asks for exactly that many tokens
  where the server allows it (null: the server decides). `think_s`: seconds the client spent before sending
  (tool runs, the user typing); honoured or skipped at replay. `label`: free text for reports.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from freetoken.errors import FreeTokenError

FORMAT, VERSION = "freetoken-trace", 1
ROUTES = {"anthropic": "/v1/messages", "openai": "/v1/chat/completions", "responses": "/v1/responses"}
_TURN_KEYS = {"type", "id", "session", "protocol", "request", "messages", "parent", "keep", "append", "after",
              "output_tokens", "think_s", "label"}


class TraceError(FreeTokenError):
    """A trace file that cannot be replayed; the message names the file and line."""


@dataclass(slots=True)
class Turn:
    id: str
    session: str
    protocol: str
    request: dict[str, Any]  # the body without messages, model and stream
    messages: list[Any]  # whole, parents resolved
    output_tokens: int | None = None
    think_s: float = 0.0
    after: tuple[str, ...] = ()
    parent: str | None = None
    label: str = ""
    line: int = 0  # in the file it was read from (0: built in memory)

    def body(self, model: str) -> dict[str, Any]:
        """The request body as the client sends it (streamed; the replayer adds its length fields)."""
        key = "input" if self.protocol == "responses" else "messages"
        return {"model": model, **self.request, key: self.messages, "stream": True}


@dataclass(slots=True)
class Trace:
    name: str
    turns: list[Turn]
    description: str = ""
    generator: dict[str, Any] = field(default_factory=dict)

    def turn(self, ident: str) -> Turn:
        return next(t for t in self.turns if t.id == ident)

    @property
    def sessions(self) -> list[str]:
        return list(dict.fromkeys(t.session for t in self.turns))


def read_trace(path: str | Path) -> Trace:
    """Reads and checks a trace file; every problem is a TraceError naming the line."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise TraceError(f"cannot read the trace {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise TraceError(f"{path} is not a UTF-8 text file (a trace is JSONL)") from None
    return parse_trace(lines, str(path))


def parse_trace(lines: Iterable[str], source: str = "<trace>") -> Trace:
    header, turns, by_id = None, [], {}
    last_of_session: dict[str, str] = {}
    for number, text in enumerate(lines, 1):
        if not text.strip():
            continue
        where = f"{source} line {number}"
        try:
            record = json.loads(text)
        except json.JSONDecodeError as e:
            raise TraceError(f"{where}: not valid JSON ({e.msg}, column {e.colno})") from None
        if not isinstance(record, dict):
            raise TraceError(f"{where}: each line must be a JSON object")
        if header is None:
            header = _header(record, where)
            continue
        turn = _turn(record, where, by_id, last_of_session)
        turn.line = number
        turns.append(turn)
        by_id[turn.id] = turn
        last_of_session[turn.session] = turn.id
    if header is None:
        raise TraceError(f"{source} is empty; a trace starts with a header line "
                         f'{{"type": "header", "format": "{FORMAT}", "version": {VERSION}, ...}}')
    if not turns:
        raise TraceError(f"{source} has a header but no turns")
    return Trace(header.get("name") or Path(source).stem, turns, header.get("description", ""),
                 header.get("generator") or {})


def _header(record: dict, where: str) -> dict:
    if record.get("type") != "header" or record.get("format") != FORMAT:
        raise TraceError(f'{where}: the first line must be the header {{"type": "header", "format": "{FORMAT}", '
                         f'"version": {VERSION}}}')
    if record.get("version") != VERSION:
        raise TraceError(f"{where}: trace version {record.get('version')!r}; this freetoken reads version "
                         f"{VERSION} (upgrade freetoken for newer traces)")
    return record


def _turn(record: dict, where: str, by_id: dict[str, Turn], last_of_session: dict[str, str]) -> Turn:
    if record.get("type") != "turn":
        raise TraceError(f"{where}: unknown record type {record.get('type')!r} (expected \"turn\")")
    unknown = set(record) - _TURN_KEYS
    if unknown:
        raise TraceError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
    ident = _string(record, "id", where)
    if ident in by_id:
        raise TraceError(f"{where}: turn id {ident!r} is used twice (also line {by_id[ident].line})")
    session = _string(record, "session", where)
    parent_id = record.get("parent")
    parent = None
    if parent_id is not None:
        parent = by_id.get(parent_id)
        if parent is None:
            raise TraceError(f"{where}: turn {ident!r} names parent {parent_id!r}, which no earlier line defines")
    protocol = record.get("protocol", parent.protocol if parent else None)
    if protocol not in ROUTES:
        raise TraceError(f"{where}: protocol {protocol!r} is unknown; use one of {', '.join(ROUTES)}")
    if parent is not None and protocol != parent.protocol and "messages" not in record:
        raise TraceError(f"{where}: turn {ident!r} changes protocol from its parent's; give its whole messages")
    request = record.get("request", parent.request if parent else None)
    if not isinstance(request, dict):
        raise TraceError(f"{where}: turn {ident!r} needs a request object (or a parent to take it from)")
    if {"messages", "input", "model"} & set(request):
        raise TraceError(f"{where}: the request must not hold model, messages or input (they are fields of the "
                         "turn; the replayer sets the model)")
    messages = _messages(record, where, ident, parent)
    output_tokens = record.get("output_tokens")
    if output_tokens is not None and (not isinstance(output_tokens, int) or isinstance(output_tokens, bool)
                                      or output_tokens < 1):
        raise TraceError(f"{where}: output_tokens must be a positive integer or null, got {output_tokens!r}")
    think = record.get("think_s", 0.0)
    if not isinstance(think, int | float) or isinstance(think, bool) or think < 0:
        raise TraceError(f"{where}: think_s must be a number of seconds ≥ 0, got {think!r}")
    after = record.get("after")
    if after is None:
        after = [parent_id] if parent_id else [last_of_session[session]] if session in last_of_session else []
    if not isinstance(after, list) or not all(isinstance(a, str) for a in after):
        raise TraceError(f"{where}: after must be a list of turn ids")
    for dep in after:
        if dep not in by_id:
            raise TraceError(f"{where}: turn {ident!r} comes after {dep!r}, which no earlier line defines")
    return Turn(ident, session, protocol, request, messages, output_tokens, float(think), tuple(after), parent_id,
                str(record.get("label", "")))


def _messages(record: dict, where: str, ident: str, parent: Turn | None) -> list:
    if "messages" in record:
        if "keep" in record or "append" in record:
            raise TraceError(f"{where}: turn {ident!r} gives messages and keep/append; give one or the other")
        messages = record["messages"]
    elif parent is None:
        raise TraceError(f"{where}: turn {ident!r} has neither messages nor a parent to continue")
    else:
        keep = record.get("keep", len(parent.messages))
        if not isinstance(keep, int) or isinstance(keep, bool) or not 0 <= keep <= len(parent.messages):
            raise TraceError(f"{where}: keep must be 0..{len(parent.messages)} (the parent's messages), "
                             f"got {keep!r}")
        append = record.get("append", [])
        if not isinstance(append, list):
            raise TraceError(f"{where}: append must be a list of messages")
        messages = parent.messages[:keep] + append
    if not isinstance(messages, list) or not messages:
        raise TraceError(f"{where}: turn {ident!r} has no messages")
    return messages


def _string(record: dict, key: str, where: str) -> str:
    value = record.get(key)
    if not isinstance(value, str) or not value:
        raise TraceError(f"{where}: missing field {key!r} (a non-empty string)")
    return value


def trace_lines(trace: Trace) -> list[str]:
    """The trace as JSONL lines: each turn with a parent is written as the part it adds (keep + append)."""
    header = {"type": "header", "format": FORMAT, "version": VERSION, "name": trace.name,
              "description": trace.description}
    if trace.generator:
        header["generator"] = trace.generator
    out, by_id, last_of_session = [_json(header)], {}, {}
    for turn in trace.turns:
        parent = by_id.get(turn.parent)
        previous = last_of_session.get(turn.session)
        default_after = (parent.id,) if parent is not None else (previous,) if previous else ()
        out.append(_json(turn_record(turn, parent, default_after)))
        by_id[turn.id], last_of_session[turn.session] = turn, turn.id
    return out


def turn_record(turn: Turn, parent: Turn | None, default_after: tuple[str, ...]) -> dict:
    """One turn as its JSONL record, relative to `parent` where it has one; `after` is written when it differs
    from `default_after` (what a reader assumes)."""
    record: dict[str, Any] = {"type": "turn", "id": turn.id, "session": turn.session}
    if parent is None or parent.protocol != turn.protocol:
        record["protocol"] = turn.protocol
    if parent is None or parent.request != turn.request:
        record["request"] = turn.request
    if parent is None or parent.protocol != turn.protocol:
        record["messages"] = turn.messages
    else:
        keep = common_prefix(parent.messages, turn.messages)
        record["parent"] = parent.id
        if keep != len(parent.messages):
            record["keep"] = keep
        record["append"] = turn.messages[keep:]
    if turn.after != default_after:
        record["after"] = list(turn.after)
    if turn.output_tokens is not None:
        record["output_tokens"] = turn.output_tokens
    if turn.think_s:
        record["think_s"] = round(turn.think_s, 3)
    if turn.label:
        record["label"] = turn.label
    return record


def write_trace(trace: Trace, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(trace_lines(trace)) + "\n", encoding="utf-8")
    return path


def common_prefix(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _json(record: dict) -> str:
    return json.dumps(record, ensure_ascii=False, separators=(",", ":"))
