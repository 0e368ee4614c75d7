"""A session's reply as it is generated: stream it (sync or async) or wait for the whole of it.

Whatever produces the reply (the local engine's worker thread, or a stream from a server) puts its parts into
the reply's queue from another thread and closes it with the final stats or an error; readers take them out in
order. Reading is optional: the reply completes whether or not anyone iterates it, and `text`, `reasoning`,
`tool_calls` and `stats` wait for the end.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

from freetoken.server.output import Part, ToolCall

_END = object()


@dataclass(slots=True)
class ReplyStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose K/V were reused (the session's history, a shared prefix)
    completion_tokens: int = 0
    ttft_s: float | None = None  # request to first token
    decode_tok_s: float | None = None  # tokens per second after the first
    finish_reason: str | None = None  # "stop", "length", or "tool_calls"


class Reply:
    def __init__(self) -> None:
        self._queue: queue.Queue = queue.Queue()
        self._parts: list[Part] = []
        self._done = threading.Event()
        self._reading = threading.Lock()
        self._error: BaseException | None = None
        self._stats = ReplyStats()
        self.generated_ids: list[int] = []  # set by the producer before `close` (in-process sessions only)

    # -- the producer's side (another thread) --

    def put(self, part: Part) -> None:
        self._queue.put(part)

    def close(self, stats: ReplyStats | None = None, error: BaseException | None = None) -> None:
        if stats is not None:
            self._stats = stats
        self._error = error
        self._queue.put(_END)

    # -- the reader's side --

    def parts(self) -> Iterator[Part]:
        """Every part (answer text, reasoning, tool calls) as it comes; any number of readers, in any threads,
        each see all of them."""
        i = 0
        while (part := self._part(i)) is not None:
            yield part
            i += 1
        if self._error is not None:
            raise self._error

    def _part(self, i: int) -> Part | None:
        """Part `i`, waiting for it; None once the reply has no more."""
        with self._reading:
            while i >= len(self._parts) and not self._done.is_set():
                item = self._queue.get()
                if item is _END:
                    self._done.set()
                else:
                    self._parts.append(item)
            return self._parts[i] if i < len(self._parts) else None

    def __iter__(self) -> Iterator[str]:
        """The answer's text deltas (reasoning and tool calls are in `parts()`)."""
        return (p.text for p in self.parts() if p.kind == "text")

    def wait(self) -> Reply:
        for _ in self.parts():
            pass
        return self

    @property
    def stats(self) -> ReplyStats:
        """Token counts and timings (waits for the end)."""
        return self.wait()._stats

    @property
    def token_ids(self) -> list[int]:
        """The generated token ids (in-process sessions; a server sends text only, so this stays empty)."""
        return self.wait().generated_ids

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.wait()._parts if p.kind == "text")

    @property
    def reasoning(self) -> str:
        return "".join(p.text for p in self.wait()._parts if p.kind == "reasoning")

    @property
    def tool_calls(self) -> list[ToolCall]:
        return [p.call for p in self.wait()._parts if p.kind == "tool_call"]

    async def aparts(self) -> AsyncIterator[Part]:
        """`parts()` for asyncio code: waiting happens in a thread, never on the event loop."""
        it = self.parts()
        loop = asyncio.get_running_loop()
        while True:
            part = await loop.run_in_executor(None, next, it, _END)
            if part is _END:
                return
            yield part

    async def __aiter__(self) -> AsyncIterator[str]:
        async for p in self.aparts():
            if p.kind == "text":
                yield p.text

    def __await__(self):
        return asyncio.get_running_loop().run_in_executor(None, self.wait).__await__()
