"""One streamed request of a turn, timed: any OpenAI chat-completions, Responses or Anthropic Messages endpoint.

Standard library only (urllib in a thread per request), so the timing includes nothing but the server and the
loopback: TTFT is from sending the request to the first streamed piece of the reply (text, reasoning or a tool
call's arguments); the decode rate is the reply's other tokens over the time from that piece to the stream's
end. Token counts are the server's own usage.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from typing import Any

from freetoken.eval.trace import ROUTES


@dataclass(slots=True)
class Outcome:
    """What one request measured; `error` is set instead of raising (the run goes on)."""

    status: int = 0  # HTTP status; 0 when no answer came
    ttft_s: float | None = None
    total_s: float = 0.0
    decode_s: float | None = None  # first piece to the stream's last event
    pieces: int = 0  # streamed deltas that carried reply text
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int | None = None
    finish: str | None = None
    error: str | None = None
    host: dict[str, float] | None = None  # this machine's CPU time shares during the request (freetoken/host_load.py)
    piece_ms: list[float] | None = None  # when each piece arrived, ms after the first (where a reply is slow)

    STEADY_SKIP = 4  # pieces left out of the steady rate: a reply's first steps may pay for warming up

    @property
    def steady_decode_tok_s(self) -> float | None:
        """The decode rate past the first STEADY_SKIP pieces, from the last of those to the stream's end: with
        `decode_tok_s`, whether a slow reply was slow throughout or only at its start. Tokens after that piece
        are counted in proportion to the pieces (a piece may carry more than one token)."""
        pieces, n, times, s = self.pieces, self.output_tokens, self.piece_ms, self.decode_s
        skip = self.STEADY_SKIP
        if not (times and n and s) or pieces < 2 * skip or len(times) != pieces:
            return None
        span = s - times[skip] / 1e3
        tokens = (n - 1) * (pieces - 1 - skip) / (pieces - 1)
        return tokens / span if span > 0 else None

    @property
    def decode_tok_s(self) -> float | None:
        """The reply's tokens after the first over the time from the first piece to the stream's end."""
        n, s = self.output_tokens, self.decode_s
        return (n - 1) / s if n and n > 1 and s else None

    def to_json(self) -> dict[str, Any]:
        """Its measurements with the decode rates derived from them."""
        return {**asdict(self), "decode_tok_s": self.decode_tok_s, "steady_decode_tok_s": self.steady_decode_tok_s}


def fixed_length(body: dict, protocol: str, tokens: int | None, ignore_eos: bool) -> dict:
    """`body` asking for exactly `tokens` reply tokens: the protocol's length field, plus `ignore_eos` (freetoken's,
    vLLM's and llama.cpp's extension) so an early end of turn does not shorten the reply."""
    if tokens is None:
        return body
    key = {"anthropic": "max_tokens", "openai": "max_tokens", "responses": "max_output_tokens"}[protocol]
    return {**body, key: tokens, **({"ignore_eos": True} if ignore_eos else {})}


def send(endpoint: str, protocol: str, body: dict, *, headers: dict[str, str] | None = None,
         timeout_s: float = 3600.0) -> Outcome:
    """Sends `body` (streamed) to `endpoint` + the protocol's route and times the reply."""
    if protocol == "openai":
        body = {**body, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(endpoint.rstrip("/") + ROUTES[protocol], json.dumps(body).encode(),
                                 {"Content-Type": "application/json", "anthropic-version": "2023-06-01",
                                  **(headers or {})})
    out, started = Outcome(), time.perf_counter()
    reader = READERS[protocol](out)
    first = last = None
    arrivals: list[float] = []
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            out.status = r.status
            for data in _sse_data(r):
                now = time.perf_counter()
                if reader(data):  # a piece of the reply
                    first = first or now
                    out.pieces += 1
                    arrivals.append(now)
                if first is not None:  # the reply ends with the last event (its usage), whatever its tokens read
                    last = now
    except urllib.error.HTTPError as e:
        out.status, out.error = e.code, f"HTTP {e.code}: {_error_message(e)}"
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
        reason = getattr(e, "reason", e)
        out.error = f"no answer from {endpoint}: {reason}"
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        out.error = f"unreadable stream from {endpoint}: {type(e).__name__}: {e}"
    out.total_s = time.perf_counter() - started
    if first is not None:
        out.ttft_s, out.decode_s = first - started, last - first
        out.piece_ms = [round((t - first) * 1e3, 2) for t in arrivals]
    if out.error is None and out.output_tokens is None:
        out.error = "the stream ended without the usage the protocol reports at its end"
    return out


def _sse_data(response) -> Any:
    """The JSON payloads of a server-sent-event stream (`data:` lines; `[DONE]` ends it)."""
    for raw in response:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            return
        yield json.loads(payload)


def _openai_reader(out: Outcome):
    def read(chunk: dict) -> bool:
        if chunk.get("error"):
            raise ValueError(f"the stream reported an error: {chunk['error']}")
        if chunk.get("usage"):
            usage = chunk["usage"]
            out.prompt_tokens, out.output_tokens = usage.get("prompt_tokens"), usage.get("completion_tokens")
            out.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        piece = False
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            piece |= bool(delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
                          or delta.get("tool_calls"))
            out.finish = choice.get("finish_reason") or out.finish
        return piece
    return read


def _anthropic_reader(out: Outcome):
    def read(event: dict) -> bool:
        kind = event.get("type")
        if kind == "error":
            raise ValueError(f"the stream reported an error: {event.get('error')}")
        usage = (event.get("message") or {}).get("usage") if kind == "message_start" else event.get("usage")
        if usage:
            cached = usage.get("cache_read_input_tokens") or 0
            if "input_tokens" in usage:
                out.prompt_tokens = usage["input_tokens"] + cached + (usage.get("cache_creation_input_tokens") or 0)
                out.cached_tokens = cached
            if kind == "message_delta":
                out.output_tokens = usage.get("output_tokens")
        if kind == "message_delta":
            out.finish = (event.get("delta") or {}).get("stop_reason")
        if kind == "content_block_delta":
            delta = event.get("delta") or {}
            return bool(delta.get("text") or delta.get("thinking") or delta.get("partial_json"))
        return False
    return read


def _responses_reader(out: Outcome):
    def read(event: dict) -> bool:
        kind = event.get("type", "")
        if kind in ("error", "response.failed"):
            raise ValueError(f"the stream reported an error: {event.get('error') or event}")
        if kind in ("response.completed", "response.incomplete"):
            response = event.get("response") or {}
            usage = response.get("usage") or {}
            out.prompt_tokens, out.output_tokens = usage.get("input_tokens"), usage.get("output_tokens")
            out.cached_tokens = (usage.get("input_tokens_details") or {}).get("cached_tokens", 0)
            out.finish = response.get("status")
        return kind.endswith(".delta") and bool(event.get("delta"))
    return read


READERS = {"openai": _openai_reader, "anthropic": _anthropic_reader, "responses": _responses_reader}


def _error_message(e: urllib.error.HTTPError) -> str:
    try:
        body = json.loads(e.read())
        err = body.get("error", body)
        return str(err.get("message", err) if isinstance(err, dict) else err)[:500]
    except (json.JSONDecodeError, ValueError, AttributeError, OSError):
        return e.reason if isinstance(e.reason, str) else "error"
