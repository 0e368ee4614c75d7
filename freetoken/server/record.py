"""`ft serve --record DIR`: every answered API request written as a turn of an agent trace (eval/trace.py), so a
real session can be replayed later with `ft eval --trace FILE`.

An ASGI middleware copies each request body on its way in and the reply on its way out (the reply only to read
its usage: the recorded reply length). Turns are grouped into sessions by their messages: a request whose
messages extend an earlier one's is that conversation's next turn; one that shares only a beginning is an edit
or a branch of it (its parent, with `keep`); anything else starts a session. Think time is the gap since the
parent's reply ended. The file is private (0600): it holds the prompts.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import threading
import time
from pathlib import Path

from freetoken.eval.client import READERS, Outcome
from freetoken.eval.trace import FORMAT, ROUTES, VERSION, Turn, common_prefix, turn_record

log = logging.getLogger(__name__)
PROTOCOL_OF = {route: protocol for protocol, route in ROUTES.items()}
MAX_CAPTURE = 64 * 2**20  # reply bytes kept to read the usage from (a streamed reply's usage comes last)
REMEMBERED = 512  # turns kept in memory to match later requests against
_DROPPED = ("model", "stream", "stream_options", "ignore_eos")  # the replayer sets these


class TraceRecorder:
    def __init__(self, directory: str | Path, model_id: str):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        self.path = self.dir / f"trace-{stamp}-{os.getpid()}.jsonl"
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        self._file = os.fdopen(fd, "w", encoding="utf-8")
        self._lock = threading.Lock()
        self._turns: list[Turn] = []
        self._ended: dict[str, float] = {}  # turn id → when its reply ended
        self._sessions = 0
        self._warned_stateful = False
        self._write({"type": "header", "format": FORMAT, "version": VERSION, "name": self.path.stem,
                     "description": f"recorded by ft serve ({model_id}) from {stamp}"})
        log.info("recording requests as a trace in %s", self.path)

    def record(self, protocol: str, body: dict, reply: bytes, started: float, ended: float) -> Turn | None:
        """Adds one answered request; returns its turn (None for a body that is no chat request)."""
        key = "input" if protocol == "responses" else "messages"
        messages = body.get(key)
        if isinstance(messages, str):  # Responses takes a bare string for one user message
            messages = [{"type": "message", "role": "user", "content": messages}]
        if not isinstance(messages, list) or not messages:
            return None
        request = {k: v for k, v in body.items() if k not in _DROPPED and k != key}
        label = ""
        if request.pop("previous_response_id", None):
            label = "stateful: the input holds only the items after the previous response"
            if not self._warned_stateful:
                log.warning("recording a Responses request that continues a stored response: the trace holds only "
                            "its new items (send the whole input, store=false, for replayable traces)")
                self._warned_stateful = True
        with self._lock:
            parent = self._parent(protocol, messages)
            if parent is None:
                self._sessions += 1
                session = f"s{self._sessions:03d}"
            else:
                session = parent.session
            previous = next((t.id for t in reversed(self._turns) if t.session == session), None)
            ident = f"{session}-{sum(t.session == session for t in self._turns) + 1:03d}"
            after = (parent.id,) if parent is not None else (previous,) if previous else ()
            think = started - self._ended[parent.id] if parent is not None and parent.id in self._ended else 0.0
            turn = Turn(ident, session, protocol, request, messages, _output_tokens(protocol, reply),
                        max(0.0, think), after, parent.id if parent else None, label)
            self._write(turn_record(turn, parent, after))
            self._turns.append(turn)
            self._ended[ident] = ended
            if len(self._turns) > REMEMBERED:
                gone = self._turns.pop(0)
                self._ended.pop(gone.id, None)
        return turn

    def _parent(self, protocol: str, messages: list) -> Turn | None:
        """The remembered turn this request continues (its messages a prefix of these, latest first), else the
        one sharing the longest beginning of at least two messages (an edit or a branch)."""
        best, best_keep = None, 1
        for turn in reversed(self._turns):
            if turn.protocol != protocol:
                continue
            keep = common_prefix(turn.messages, messages)
            if keep == len(turn.messages) and keep < len(messages):
                return turn
            if keep > best_keep:
                best, best_keep = turn, keep
        return best

    def _write(self, record: dict) -> None:
        self._file.write(json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n")
        self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


def _output_tokens(protocol: str, reply: bytes) -> int | None:
    """The reply's length from its usage: a JSON reply's, or a stream's last usage event."""
    text = reply.decode("utf-8", errors="replace")
    if not text.lstrip().startswith(("data:", "event:")):
        try:
            usage = json.loads(text).get("usage") or {}
        except (ValueError, AttributeError):
            return None
        return usage.get("completion_tokens", usage.get("output_tokens"))
    out = Outcome()
    read = READERS[protocol](out)
    for line in text.splitlines():
        if line.startswith("data:") and line[5:].strip() != "[DONE]":
            try:
                read(json.loads(line[5:]))
            except (ValueError, KeyError, TypeError):
                continue
    return out.output_tokens


class RecordMiddleware:
    """Copies the body of each POST to a chat route and its reply, and hands both to the recorder once the reply
    is complete with status 200. Failed requests are not recorded."""

    def __init__(self, app, recorder: TraceRecorder):
        self.app, self.recorder = app, recorder

    async def __call__(self, scope, receive, send) -> None:
        protocol = PROTOCOL_OF.get(scope.get("path", "")) if scope["type"] == "http" else None
        if protocol is None or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        body, reply, status, started = bytearray(), bytearray(), [0], time.time()

        async def copying_receive():
            message = await receive()
            if message["type"] == "http.request" and len(body) < MAX_CAPTURE:
                body.extend(message.get("body", b""))
            return message

        async def copying_send(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            elif message["type"] == "http.response.body":
                if len(reply) < MAX_CAPTURE:
                    reply.extend(message.get("body", b""))
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body") and status[0] == 200:
                self._record(protocol, bytes(body), bytes(reply), started)

        await self.app(scope, copying_receive, copying_send)

    def _record(self, protocol: str, body: bytes, reply: bytes, started: float) -> None:
        try:
            data = json.loads(body)
            if isinstance(data, dict):
                self.recorder.record(protocol, data, reply, started, time.time())
        except Exception:  # noqa: BLE001 - recording must never fail a request that was answered
            log.exception("could not record a request")
