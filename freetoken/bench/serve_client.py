"""The client side of `ft bench serve`: one streaming chat session over HTTP, standard library only, so the
benchmark can run each concurrent session in a process of its own (as agents are) without importing torch."""

from __future__ import annotations

import json
import time
import urllib.request

PROMPT = "Write a detailed story about a lighthouse keeper."


def session(url: str, tokens: int) -> tuple[int, float]:
    """One streaming chat session: (tokens generated, seconds per token from the first to the last)."""
    body = {"model": "bench", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(f"{url}/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    first = last = None
    usage = None
    with urllib.request.urlopen(req, timeout=3600) as r:
        for line in r:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            elif chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                last = time.perf_counter()
                first = first or last
    n = usage["completion_tokens"]
    return n, (last - first) / max(n - 1, 1)
