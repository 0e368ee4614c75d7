"""What the server has been doing, for the dashboard (`/v1/stats` → "activity"): running requests, the last
finished ones (TTFT, decode speed, prompt and cached tokens), token counters the dashboard turns into rates, and a
short log of answered HTTP requests. Bounded: a long-running server keeps the last `KEEP` of each."""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field

KEEP = 64


@dataclass(slots=True)
class _Running:
    id: int
    started: float
    prompt_tokens: int
    generated: int = 0
    cached_tokens: int = 0
    first_token_s: float | None = None


@dataclass
class Activity:
    tokens_generated: int = 0  # every generated token, counted as it streams
    tokens_prefilled: int = 0  # prompt tokens computed (not taken from the prefix cache)
    running: dict[int, _Running] = field(default_factory=dict)
    finished: deque = field(default_factory=lambda: deque(maxlen=KEEP))
    log: deque = field(default_factory=lambda: deque(maxlen=KEEP))
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))
    _lock: threading.Lock = field(default_factory=threading.Lock)  # the engine thread writes, handlers read

    def start(self, prompt_tokens: int) -> int:
        with self._lock:
            rid = next(self._ids)
            self.running[rid] = _Running(rid, time.perf_counter(), prompt_tokens)
            return rid

    def token(self, rid: int, generated: int, cached_tokens: int) -> None:
        """An event of request `rid` with `generated` tokens so far."""
        with self._lock:
            r = self.running.get(rid)
            if r is None:
                return
            if r.first_token_s is None and generated:
                r.first_token_s = time.perf_counter() - r.started
                r.cached_tokens = cached_tokens
                self.tokens_prefilled += max(0, r.prompt_tokens - cached_tokens)
            self.tokens_generated += max(0, generated - r.generated)
            r.generated = generated

    def end(self, rid: int, reason: str) -> None:
        with self._lock:
            r = self.running.pop(rid, None)
            if r is None:
                return
            seconds = time.perf_counter() - r.started
            decode_s = seconds - (r.first_token_s or seconds)
            self.finished.append({"id": rid, "reason": reason, "prompt_tokens": r.prompt_tokens,
                                  "cached_tokens": r.cached_tokens, "generated": r.generated,
                                  "ttft_s": r.first_token_s, "seconds": seconds,
                                  "decode_tok_s": (r.generated - 1) / decode_s if decode_s > 0 else None})

    def answered(self, method: str, path: str, status: int, seconds: float) -> None:
        with self._lock:
            self.log.append({"at": time.time(), "method": method, "path": path, "status": status,
                             "seconds": round(seconds, 3)})

    def snapshot(self) -> dict:
        now = time.perf_counter()
        with self._lock:
            ttfts = sorted(f["ttft_s"] for f in self.finished if f["ttft_s"] is not None)
            return {"tokens_generated": self.tokens_generated, "tokens_prefilled": self.tokens_prefilled,
                    "running": [{"id": r.id, "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
                                 "generated": r.generated, "seconds": round(now - r.started, 3)}
                                for r in self.running.values()],
                    "finished": list(self.finished)[-16:], "log": list(self.log)[-32:],
                    "ttft_p50_s": _quantile(ttfts, 0.5), "ttft_p95_s": _quantile(ttfts, 0.95)}


def _quantile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]
