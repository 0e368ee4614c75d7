"""The server's side of the engine: one loaded model, one worker thread that runs generations, and asyncio streams
of `GenerationEvent`s for the request handlers.

Requests wait in a bounded FIFO and run one at a time on the worker (the model's forward is not re-entrant;
batching several sequences into one forward is the scheduler's next step). The worker hands events to the
handler's event loop with `call_soon_threadsafe`, so the loop never blocks on the model. A request whose client
went away is cancelled: the worker stops at its next token and the sequence's KV pages are freed at once.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from freetoken.engine.generator import GenerationEvent, Generator
from freetoken.engine.loader import LoadedModel
from freetoken.engine.sampling import SamplingParams
from freetoken.engine.stats import snapshot
from freetoken.errors import FreeTokenError

log = logging.getLogger(__name__)


class ContextLengthExceeded(FreeTokenError):
    """The prompt leaves no room to generate in the context this server holds."""

    def __init__(self, prompt_tokens: int, limit: int):
        super().__init__(f"the prompt has {prompt_tokens} tokens; this server holds at most {limit} tokens per "
                         f"request, including the reply")
        self.prompt_tokens, self.limit = prompt_tokens, limit


class Saturated(FreeTokenError):
    """The request queue is full."""


@dataclass(slots=True)
class Counters:
    received: int = 0
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    rejected: int = 0  # queue full
    prompt_tokens: int = 0
    completion_tokens: int = 0
    busy_seconds: float = 0.0  # worker time spent generating
    last_ttft_s: float = 0.0  # of the last request: from being queued to its first token
    last_decode_tok_s: float = 0.0


class _Job:
    """One queued generation; the worker fills `events`, the handler drains it."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, loop: asyncio.AbstractEventLoop):
        self.prompt_ids, self.params, self.loop = prompt_ids, params, loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.queued_at = time.perf_counter()

    def emit(self, item: GenerationEvent | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the handler's loop is gone (server shutting down): nobody is listening
            self.cancelled.set()


class ServingEngine:
    def __init__(self, lm: LoadedModel, model_id: str, *, max_queue: int = 64, max_seq_len: int | None = None):
        self.lm, self.model_id, self.max_queue = lm, model_id, max_queue
        self.generator = Generator(lm, max_seq_len=max_seq_len)
        self.counters = Counters()
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._running: _Job | None = None
        self._worker = threading.Thread(target=self._work, name="ft-engine", daemon=True)
        self._worker.start()

    # -- what the handlers ask --

    @property
    def context_length(self) -> int:
        """Tokens one request may hold, prompt and reply together: the model's context or the KV limit."""
        return self.generator.capacity

    @property
    def tokenizer(self):
        return self.lm.tokenizer

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None,
                    enable_thinking: bool | None = None) -> tuple[str, list[int]]:
        """The chat template's rendering of a conversation and its token ids (ChatTemplateError if it fails)."""
        text = self.tokenizer.apply_chat_template(messages, tools=tools or None, enable_thinking=enable_thinking)
        return text, self.tokenizer.encode(text)

    def check_fits(self, prompt_ids: list[int]) -> None:
        if len(prompt_ids) >= self.context_length:
            raise ContextLengthExceeded(len(prompt_ids), self.context_length)

    def check_admission(self) -> None:
        """Saturated when the queue is full (the handlers check before answering, so the status code says it)."""
        if self._jobs.qsize() >= self.max_queue:
            self.counters.rejected += 1
            raise Saturated(f"{self._jobs.qsize()} requests are already waiting; retry later")

    async def stream(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[GenerationEvent]:
        """Queues a generation and yields its events; closing the iterator early cancels it."""
        self.check_fits(prompt_ids)
        self.check_admission()
        job = _Job(prompt_ids, params, asyncio.get_running_loop())
        self.counters.received += 1
        self._jobs.put(job)
        try:
            while True:
                item = await job.events.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            job.cancelled.set()  # a no-op once finished; otherwise the worker stops at its next token

    def stats(self) -> dict[str, Any]:
        """JSON for /v1/stats: the engine snapshot (experts, KV pages) plus the request counters."""
        snap = snapshot(self.lm, self.generator._cache)
        return {"model": self.model_id, "context_length": self.context_length,
                "queued": self._jobs.qsize(), "running": int(self._running is not None),
                "requests": asdict(self.counters), "engine": asdict(snap)}

    def close(self) -> None:
        if self._running is not None:
            self._running.cancelled.set()
        self._jobs.put(None)
        self._worker.join(timeout=30)

    # -- the worker thread --

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            if job.cancelled.is_set():  # the client left while queued
                self.counters.cancelled += 1
                continue
            self._running = job
            try:
                self._run(job)
            except Exception as e:  # reported to the handler; the worker lives on
                self.counters.failed += 1
                if not isinstance(e, FreeTokenError):
                    log.exception("generation failed")
                job.emit(e)
            finally:
                self._running = None

    def _run(self, job: _Job) -> None:
        started = time.perf_counter()
        events = self.generator.stream(job.prompt_ids, job.params)
        try:
            for ev in events:
                if ev.completion_tokens == 1:
                    self.counters.last_ttft_s = time.perf_counter() - job.queued_at
                job.emit(ev)
                if ev.finish_reason is not None:
                    c = self.counters
                    c.completed += 1
                    c.prompt_tokens += ev.prompt_tokens
                    c.completion_tokens += ev.completion_tokens
                    t = ev.timings
                    if t is not None and t.decode_s > 0:
                        c.last_decode_tok_s = max(ev.completion_tokens - 1, 0) / t.decode_s
                if ev.finish_reason is None and job.cancelled.is_set():
                    self.counters.cancelled += 1
                    break
        finally:
            events.close()  # frees the sequence's KV pages now, not at garbage collection
            self.counters.busy_seconds += time.perf_counter() - started
