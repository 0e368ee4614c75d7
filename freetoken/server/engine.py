"""The server's side of the engine: one loaded model, one worker thread that runs generations, and asyncio streams
of `GenerationEvent`s for the request handlers.

Requests wait in a bounded FIFO; the worker admits them into a continuous batch (`BatchScheduler`: every step is
one forward over all decoding requests plus one prefill chunk) as slots free up. The worker hands events to the
handler's event loop with `call_soon_threadsafe`, so the loop never blocks on the model. A request whose client
went away is cancelled: it leaves the batch at the next step and its KV pages are freed at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import logging
import queue
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from freetoken.engine.batching import BatchRequest, BatchScheduler
from freetoken.engine.call_languages import CALL_MARKERS, opening_of
from freetoken.engine.generator import GenerationEvent
from freetoken.engine.json_schema import SchemaError, compile_schema
from freetoken.engine.loader import LoadedModel
from freetoken.engine.offload.budget import split_expert_budget
from freetoken.engine.offload.executor import OffloadedExpertExecutor
from freetoken.engine.sampling import SamplingParams
from freetoken.engine.stats import snapshot
from freetoken.errors import FreeTokenError
from freetoken.server.activity import Activity
from freetoken.server.gc_pauses import GcPauses
from freetoken.server.harmony import HarmonyParser, reply_parser
from freetoken.server.limits import reply_budget
from freetoken.server.output import OutputParser, text_parameters
from freetoken.server.tool_choice import ToolChoice, call_opener, call_syntax, with_tools_described

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ChatPrompt:
    text: str  # the rendered prompt, ending with `opener`
    ids: list[int]
    opener: str  # written on the model's behalf (a forced tool call's opening), or ""
    in_reasoning: bool  # the template left a reasoning block open
    tools: bool  # the reply may hold calls (tools offered, tool_choice not "none"): the parser looks for them
    # how the model writes calls where the sampler can constrain them (a language of engine/call_languages.py:
    # "hermes", also for described tools, "qwen-xml", "mistral-json", "mistral-args", "llama3"), else ""; and the
    # offered tools as (name, parameter names)
    call_format: str = ""
    call_tools: tuple[tuple[str, tuple[str, ...]], ...] = ()
    call_schemas: tuple[tuple[str, str], ...] = ()  # (name, parameters schema) of tools whose schema is usable
    harmony: bool = False  # rendered by a Harmony template (gpt-oss): channels, not tags, mark the parts
    single_call: bool = False  # at most one call (the request turned parallel calls off)

    def parser(self, stream_calls: bool = False) -> OutputParser | HarmonyParser:
        """`stream_calls`: for a streamed reply, whose calls go out while they form (see OutputParser)."""
        return reply_parser(harmony=self.harmony, in_reasoning=self.in_reasoning, tools=self.tools,
                            prefix=self.opener, text_params=text_parameters(self.call_schemas),
                            stream_calls=stream_calls)

    def constrain(self, params: SamplingParams) -> SamplingParams:
        """`params` with the reply's tool calls constrained to calls of the offered tools where the model writes
        them in a format the sampler knows (a forced call starts inside one); a reply already constrained to a
        JSON object stays so."""
        if not self.call_format or params.json_object:
            return params
        opening = opening_of(self.opener, self.call_format)
        return dataclasses.replace(params, call_format=self.call_format, call_opening=opening,
                                   call_tools=self.call_tools, call_schemas=self.call_schemas,
                                   call_single=self.single_call)


def template_messages(tok, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None):
    """(the messages to render, the template, its call syntax): a template that never renders tools gets them
    described in the system message instead (tool_choice.with_tools_described)."""
    template = (tok.tool_use_template if tools else None) or tok.chat_template
    syntax = call_syntax(template.source) if tools and template is not None else "none"
    if tools and syntax == "none":
        messages = with_tools_described(list(messages), list(tools))
    return messages, template, syntax


def render_chat(tok, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None,
                enable_thinking: bool | None = None, choice: ToolChoice | None = None,
                reasoning_effort: str | None = None) -> ChatPrompt:
    """The chat template's rendering of a conversation and its token ids (ChatTemplateError if it fails), for
    the server and the SDK alike. Tools go through the template (or are described: `template_messages`). A
    `choice` that forces a call ends the prompt with the opening of one (see tool_choice.py).
    `reasoning_effort` ("low" | "medium" | "high") goes to templates that read it (gpt-oss's)."""
    messages, template, syntax = template_messages(tok, messages, tools)
    text = tok.apply_chat_template(messages, tools=tools or None, enable_thinking=enable_thinking,
                                   reasoning_effort=reasoning_effort)
    in_reasoning = text.rstrip().endswith("<think>")
    opener = call_opener(choice, syntax, in_reasoning) if tools and choice is not None else ""
    # "none": the tools stay in the prompt (Anthropic keeps them too), so the turn reuses the K/V of a history
    # rendered with them; the reply is read and sampled as plain text
    calls = bool(tools) and (choice is None or choice.mode != "none")
    return ChatPrompt(text + opener, tok.encode(text + opener), opener, in_reasoning, calls,
                      call_format=constrained_format(syntax) if calls else "",
                      call_tools=offered_tools(tools or ()), call_schemas=offered_schemas(tools or ()),
                      harmony=template is not None and call_syntax(template.source) == "harmony",
                      single_call=calls and choice is not None and not choice.parallel)


def constrained_format(syntax: str) -> str:
    """The constrained call language for a template's call syntax (tool_choice.call_syntax); templates that
    ignore tools get the Hermes format described, so their calls are Hermes calls."""
    fmt = "hermes" if syntax == "none" else syntax
    return fmt if fmt in CALL_MARKERS else ""


def offered_tools(tools: Sequence[Mapping[str, Any]]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(name, parameter names) of OpenAI-shaped tools, for constrained calls (no properties: any names)."""
    out = []
    for t in tools:
        fn = t["function"]
        properties = (fn.get("parameters") or {}).get("properties") if isinstance(fn.get("parameters"), dict) else None
        out.append((fn["name"], tuple(properties) if isinstance(properties, dict) else ()))
    return tuple(out)


def offered_schemas(tools: Sequence[Mapping[str, Any]]) -> tuple[tuple[str, str], ...]:
    """(name, parameters schema as compact JSON) of the OpenAI-shaped tools whose parameters schema the call
    constraint can read (an object schema; see engine/json_schema.py); the others' arguments stay any object."""
    out = []
    for t in tools:
        fn = t["function"]
        params = fn.get("parameters")
        if not isinstance(params, dict):
            continue
        text = json.dumps(params, separators=(",", ":"), sort_keys=True)
        try:
            root = compile_schema(text)
        except SchemaError:
            continue
        if root.types is None or "object" in root.types:
            out.append((fn["name"], text))
    return tuple(out)


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
    last_ttft_s: float = 0.0  # of the last request: from being queued to its first token
    last_decode_tok_s: float = 0.0  # of the last request to finish


class _Job:
    """One queued generation; the worker fills `events`, the handler drains it."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, loop: asyncio.AbstractEventLoop):
        self.prompt_ids, self.params, self.loop = prompt_ids, params, loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.queued_at = time.perf_counter()
        self.activity_id = 0  # its entry in ServingEngine.activity, once admitted

    def emit(self, item: GenerationEvent | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the handler's loop is gone (server shutting down): nobody is listening
            self.cancelled.set()


_WAKE = object()  # put on the job queue to wake an idle worker for a control
# The engine thread gives up the GIL at every device sync (a batched step has several per layer) and must get it
# back while the event loop formats other streams' chunks: at CPython's default 5 ms switch interval each such
# handoff can cost a whole interval. A shorter one bounds that wait (process-wide; the server is the process).
SWITCH_INTERVAL_S = 0.0005


class ServingEngine:
    def __init__(self, lm: LoadedModel, model_id: str, *, max_queue: int = 64, max_seq_len: int | None = None,
                 kv_tokens: int | None = None, max_batch: int = 16, prefix_cache: bool = True,
                 speculative: bool = False):
        self.lm, self.model_id, self.max_queue = lm, model_id, max_queue
        self.scheduler = BatchScheduler(lm, max_batch=max_batch, max_seq_len=max_seq_len, kv_tokens=kv_tokens,
                                        prefix_cache=prefix_cache, speculative=speculative)
        self.counters = Counters()
        self.activity = Activity()
        self.gc_pauses = GcPauses()  # the collector's pauses stop the worker too: counted for /v1/stats
        self.gc_pauses.start()
        self._running: dict[int, _Job] = {}  # activity id → job, while the scheduler holds it
        self._jobs: queue.Queue = queue.Queue()  # _Job, _WAKE, or None to stop
        self._controls: queue.Queue = queue.Queue()
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        self._worker = threading.Thread(target=self._work, name="ft-engine", daemon=True)
        self._worker.start()

    # -- what the handlers ask --

    @property
    def context_length(self) -> int:
        """Tokens one request may hold, prompt and reply together: the model's context or the KV limit."""
        return self.scheduler.capacity

    @property
    def reply_budget(self) -> int:
        """The output budget agents are told to ask for (`ft launch` reads it from /v1/models)."""
        return reply_budget(self.context_length)

    @property
    def tokenizer(self):
        return self.lm.tokenizer

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None,
                    enable_thinking: bool | None = None, choice: ToolChoice | None = None,
                    reasoning_effort: str | None = None) -> ChatPrompt:
        """`render_chat` with this server's tokenizer."""
        return render_chat(self.tokenizer, messages, tools, enable_thinking, choice, reasoning_effort)

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
        snap = snapshot(self.lm, self.scheduler.cache, self.scheduler.prefix, self.scheduler.snapshots)
        speculator = self.scheduler.speculator
        return {"model": self.model_id, "context_length": self.context_length, "queued": self._jobs.qsize(),
                "running": len(self.scheduler.active), "max_batch": self.scheduler.max_batch,
                "forwards": self.scheduler.forwards, "requests": asdict(self.counters), "engine": asdict(snap),
                "activity": self.activity.snapshot(), "gc": self.gc_pauses.snapshot(),
                "drafts": None if speculator is None else asdict(speculator.stats)}

    def control(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Runs `fn()` on the worker between two batch steps, where nothing else touches the model; the future
        holds its result (or its exception)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._controls.put((fn, future))
        self._jobs.put(_WAKE)  # an idle worker sleeps on the job queue
        return future

    def resize_expert_cache(self, nbytes: int) -> dict[str, int]:
        """On the worker: the device expert cache to `nbytes` (whole slots), without reloading weights."""
        ex, spec = self.lm.experts, self.lm.moe_spec
        if not isinstance(ex, OffloadedExpertExecutor):
            raise FreeTokenError("this model's experts are not offloaded; start the server with --expert-cache "
                                 "SIZE to get a resizable cache")
        per_slot, store = spec.bytes_per_expert(ex.dtype), ex.copier.store
        slots, rows = split_expert_budget(nbytes, ex.block_share if store is not None else 0.0, per_slot,
                                          ex.expert_bytes if store is not None else None, spec.total_routed_experts)
        if store is not None and not rows:
            raise FreeTokenError(f"{nbytes} bytes hold no expert in its block format ({ex.expert_bytes} bytes "
                                 "each); give the cache more bytes")
        try:
            ex.resize(slots)
            if store is not None:
                ex.resize_store(rows)
        except ValueError as e:  # below the pinned experts
            raise FreeTokenError(str(e)) from None
        info = {"slots": slots, "bytes": slots * per_slot, "cached": len(ex.cache.slot_of),
                "total_experts": spec.total_routed_experts}
        if store is not None:
            info.update(block_rows=rows, bytes=info["bytes"] + rows * ex.expert_bytes,
                        block_cached=len(store.cache.slot_of))
        return info

    def pin_layer(self, layer: int, pinned: bool) -> dict[str, object]:
        """On the worker: keeps a MoE layer's experts on the device (or lets them go), without reloading weights."""
        ex, spec = self.lm.experts, self.lm.moe_spec
        if not isinstance(ex, OffloadedExpertExecutor):
            raise FreeTokenError("this model's experts are not offloaded; start the server with --expert-cache "
                                 "SIZE to pin layers")
        if layer not in spec.moe_layers:
            raise FreeTokenError(f"layer {layer} has no routed experts; MoE layers are {spec.moe_layers[0]}–"
                                 f"{spec.moe_layers[-1]}")
        try:
            held = ex.pin_layer(layer, spec.num_experts, pinned)
        except ValueError as e:
            raise FreeTokenError(str(e)) from None
        return {"layer": layer, "pinned": pinned, "pinned_experts": held,
                "pinned_layers": sorted({k[0] for k in ex.cache.pinned})}

    def resize_kv_cache(self, nbytes: int) -> dict[str, int]:
        """On the worker: the KV pool to `nbytes` (whole pages), keeping every running request."""
        from freetoken.engine.offload.budget import kv_bytes_per_token

        per_token = kv_bytes_per_token(self.lm.args, self.lm.dtype)
        if nbytes < 16 * per_token:
            raise FreeTokenError(f"{nbytes} bytes hold fewer than 16 tokens of this model's KV ({per_token} bytes "
                                 "per token); give more")
        try:
            info = self.scheduler.resize_kv(nbytes // per_token)
        except ValueError as e:
            raise FreeTokenError(str(e)) from None
        return {**info, "bytes": info["pages"] * self.scheduler.cache.page_size * per_token,
                "context": self.context_length}

    def close(self) -> None:
        self._jobs.put(None)
        self._worker.join(timeout=30)
        self.gc_pauses.stop()

    # -- the worker thread --

    def _work(self) -> None:
        scheduler = self.scheduler
        while True:
            while not self._controls.empty():
                fn, future = self._controls.get_nowait()
                try:
                    future.set_result(fn())
                except Exception as e:  # noqa: BLE001 - handed to the caller
                    future.set_exception(e)
            while scheduler.has_room():  # admit what waits; sleep on the queue only when nothing runs
                try:
                    job = self._jobs.get(block=not scheduler.active)
                except queue.Empty:
                    break
                if job is None:
                    scheduler.abort_all(Saturated("the server is shutting down"))
                    return
                if job is _WAKE:
                    break  # a control waits: run it before anything else
                self._admit(job)
            try:
                dropped = scheduler.step()
            except Exception as e:  # every request in the batch hears of it; the worker lives on
                log.exception("a batch step failed")
                scheduler.abort_all(e)
                continue
            self.counters.cancelled += len(dropped)
            if dropped:  # the clients left: their requests end in the activity log too
                for rid in [rid for rid, job in self._running.items() if job.cancelled.is_set()]:
                    self.activity.end(rid, "cancelled")
                    del self._running[rid]

    def _admit(self, job: _Job) -> None:
        if job.cancelled.is_set():  # the client left while queued
            self.counters.cancelled += 1
            return
        try:
            job.activity_id = self.activity.start(len(job.prompt_ids))
            self._running[job.activity_id] = job
            self.scheduler.add(BatchRequest(job.prompt_ids, job.params, emit=lambda ev: self._emit(job, ev),
                                            cancelled=job.cancelled.is_set))
        except Exception as e:  # noqa: BLE001 - a request the engine cannot take fails alone; the worker lives on
            if not isinstance(e, FreeTokenError):
                log.exception("a request could not be admitted")
            self.counters.failed += 1
            self.activity.end(job.activity_id, "error")
            self._running.pop(job.activity_id, None)
            job.emit(e)

    def _emit(self, job: _Job, ev: GenerationEvent | BaseException) -> None:
        c, rid = self.counters, job.activity_id
        if isinstance(ev, BaseException):
            c.failed += 1
            self.activity.end(rid, "error")
            self._running.pop(rid, None)
        else:
            self.activity.token(rid, ev.completion_tokens, ev.cached_tokens)
            if ev.finish_reason is not None:
                self.activity.end(rid, ev.finish_reason)
                self._running.pop(rid, None)
            if ev.completion_tokens == 1:
                c.last_ttft_s = time.perf_counter() - job.queued_at
            if ev.finish_reason is not None:
                c.completed += 1
                c.prompt_tokens += ev.prompt_tokens
                c.completion_tokens += ev.completion_tokens
                t = ev.timings
                if t is not None and t.decode_s > 0:
                    c.last_decode_tok_s = max(ev.completion_tokens - 1, 0) / t.decode_s
        job.emit(ev)
