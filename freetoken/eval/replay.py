"""Replaying a trace: every turn sent once its `after` turns have finished, `concurrency` copies of the trace at
once (as that many users of one agent), think time honoured or skipped, single-turn references measured before
and after it (short ones, and optionally as many over a long prompt: a decode rate falls with the context it
attends over, so those tell a multi-turn gap from the longer context's own cost).

A failed turn (an HTTP error, a dropped connection, a server that died) is recorded with its error and the run
goes on, so a partial run still yields its result file.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from freetoken import host_load
from freetoken.eval.client import Outcome, fixed_length, send
from freetoken.eval.convert import converted
from freetoken.eval.text import TextGen
from freetoken.eval.trace import Trace, Turn

REFERENCE_TOKENS = 64
REFERENCE_PROMPT = "Write a long, detailed story about a lighthouse keeper and the storm that changed the coast."


@dataclass(slots=True)
class ReplayOptions:
    endpoint: str
    model: str
    protocol: str = "auto"  # auto: each turn's own
    concurrency: int = 1
    fixed_output: bool = True  # ask for each turn's recorded reply length, ignoring end of turn
    think: bool = False  # honour think time
    reference_runs: int = 3  # single-turn requests measured before the trace, and as many after it (0: none)
    reference_context: int = 0  # also as many over a prompt of about this many tokens, each side (0: none)
    ignore_eos: bool = True  # send the extension with fixed lengths; cleared when the server refuses it
    headers: dict[str, str] = field(default_factory=dict)
    timeout_s: float = 3600.0
    stop: threading.Event = field(default_factory=threading.Event)  # set: send no further turns (Ctrl-C)
    warmup: Outcome | None = None  # the untimed request before the references (the server counted it)
    engine_counters: bool = False  # freetoken behind the endpoint: its expert counters around each turn
    host_load: bool = False  # the endpoint on this machine: its CPU time shares during each request


@dataclass(slots=True)
class TurnResult:
    replica: int
    turn: Turn
    protocol: str
    sent_at: float  # seconds from the run's start
    outcome: Outcome
    engine: dict[str, Any] | None = None  # the expert counters' change over the turn (`engine_counters`)

    def to_json(self) -> dict[str, Any]:
        o, t = self.outcome, self.turn
        new = None if o.prompt_tokens is None else o.prompt_tokens - (o.cached_tokens or 0)
        prefill = None if new is None or not o.ttft_s else new / o.ttft_s
        return {"replica": self.replica, "id": t.id, "session": t.session, "label": t.label,
                "protocol": self.protocol, "sent_at_s": round(self.sent_at, 4), "expected_output_tokens":
                t.output_tokens, **o.to_json(), "new_prompt_tokens": new, "prefill_tok_s": prefill,
                **({"engine": self.engine} if self.engine is not None else {})}


def replay(trace: Trace, opts: ReplayOptions,
           on_turn=None) -> tuple[list[TurnResult], list[tuple[str, str, Outcome]]]:
    """(every turn's result in the order they finished, the single-turn reference requests, each as ("before" or
    "after" the trace, "short" or "long" its prompt, outcome)). References run on both sides because a server's
    single-turn rate depends on its state: with offloaded experts, on what the expert cache holds (the same server
    measured 16 and 25 tok/s before two traces of one session), and the trace's turns decode in the state the
    trace leaves."""
    # one untimed first: a server's first request pays its warm-up (planner, caches); kept in `warmup`
    opts.warmup = reference_turn(trace, opts) if opts.reference_runs else None
    reference = _references(trace, opts, "before")
    started = time.perf_counter()
    results: list[TurnResult] = []
    lock = threading.Lock()

    def one(replica: int) -> None:
        for result in _replica(trace, opts, replica, started):
            with lock:
                results.append(result)
            if on_turn is not None:
                on_turn(result)

    with ThreadPoolExecutor(max_workers=opts.concurrency, thread_name_prefix="ft-eval-replica") as pool:
        try:
            for f in [pool.submit(one, r) for r in range(opts.concurrency)]:
                f.result()
        except KeyboardInterrupt:  # the turns in flight finish; no new ones are sent
            opts.stop.set()
            raise
    if not opts.stop.is_set():
        reference += _references(trace, opts, "after")
    return results, reference


def _references(trace: Trace, opts: ReplayOptions, when: str) -> list[tuple[str, str, Outcome]]:
    out = [(when, "short", reference_turn(trace, opts)) for _ in range(opts.reference_runs)]
    if opts.reference_context:
        out += [(when, "long", reference_turn(trace, opts, opts.reference_context))
                for _ in range(opts.reference_runs)]
    return out


def _replica(trace: Trace, opts: ReplayOptions, replica: int, started: float):
    """One copy of the trace; yields each turn's result as it finishes. Turns whose `after` turns are done run
    at once (a subagent beside its parent's next turn, a title request beside the first turn)."""
    done: set[str] = set()
    pending = list(trace.turns)
    running: dict[Future, Turn] = {}
    workers = max(1, len(trace.sessions))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"ft-eval-{replica}") as pool:
        while (pending and not opts.stop.is_set()) or running:
            for turn in [t for t in pending if all(a in done for a in t.after) and not opts.stop.is_set()]:
                pending.remove(turn)
                running[pool.submit(_send_turn, turn, opts, replica, started)] = turn
            if not running:
                if opts.stop.is_set():
                    return
                # unreachable for a parsed trace (after names earlier turns only)
                raise RuntimeError(f"turns {[t.id for t in pending]} wait on turns that never run")
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for f in finished:
                done.add(running.pop(f).id)
                yield f.result()


def _send_turn(turn: Turn, opts: ReplayOptions, replica: int, started: float) -> TurnResult:
    protocol = turn.protocol if opts.protocol == "auto" else opts.protocol
    request, messages = converted(turn, protocol)
    body = Turn(turn.id, turn.session, protocol, request, messages).body(opts.model)
    if opts.think and turn.think_s and opts.stop.wait(turn.think_s):
        return TurnResult(replica, turn, protocol, time.perf_counter() - started,
                          Outcome(error="not sent: the run was interrupted"))
    before = expert_counters(opts.endpoint, opts.headers) if opts.engine_counters else None
    sent = time.perf_counter() - started
    outcome = _send_sized(opts, protocol, body, turn.output_tokens if opts.fixed_output else None)
    after = expert_counters(opts.endpoint, opts.headers) if before is not None else None
    return TurnResult(replica, turn, protocol, sent, outcome, counters_delta(before, after))


def _send_sized(opts: ReplayOptions, protocol: str, body: dict, tokens: int | None) -> Outcome:
    """Sends `body` asking for `tokens` reply tokens; a server that refuses the `ignore_eos` extension (a 400
    naming it) is asked again without it, and for the rest of the run (its replies may then end early)."""
    cpu = host_load.read() if opts.host_load else None
    outcome = send(opts.endpoint, protocol, fixed_length(body, protocol, tokens, opts.ignore_eos),
                   headers=opts.headers, timeout_s=opts.timeout_s)
    if tokens is not None and opts.ignore_eos and outcome.status == 400 and "ignore_eos" in (outcome.error or ""):
        opts.ignore_eos = False
        cpu = host_load.read() if opts.host_load else None
        outcome = send(opts.endpoint, protocol, fixed_length(body, protocol, tokens, False), headers=opts.headers,
                       timeout_s=opts.timeout_s)
    if cpu is not None:
        outcome.host = host_load.shares(cpu, host_load.read())
    return outcome


def reference_turn(trace: Trace, opts: ReplayOptions, context: int = 0) -> Outcome:
    """One single-turn request with the trace's typical reply length (at least REFERENCE_TOKENS, so the rate is
    not a few tokens' noise): the decode rate the multi-turn rate is compared with. Short (nothing cached), or
    with `context` tokens of seeded filler prose before the same request (the same bytes every time, so a server
    that reuses prefixes prefills it once)."""
    protocol = trace.turns[0].protocol if opts.protocol == "auto" else opts.protocol
    lengths = sorted(t.output_tokens for t in trace.turns if t.output_tokens) or [128]
    tokens = max(REFERENCE_TOKENS, lengths[len(lengths) // 2])
    text = f"{TextGen(0).prose(context)}\n\n{REFERENCE_PROMPT}" if context else REFERENCE_PROMPT
    messages: list[Any] = [{"role": "user", "content": text}]
    if protocol == "responses":
        messages = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}]
    body = Turn("reference", "reference", protocol, {}, messages).body(opts.model)
    return _send_sized(opts, protocol, body, tokens)


def served_model(endpoint: str, headers: dict[str, str]) -> str | None:
    """The first model `GET /v1/models` lists, or None where the endpoint has no such route."""
    try:
        req = urllib.request.Request(endpoint.rstrip("/") + "/v1/models", headers=headers)
        with urllib.request.urlopen(req, timeout=10) as r:
            data = json.load(r).get("data") or []
        return data[0]["id"] if data else None
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None


def _server_stats(endpoint: str, headers: dict[str, str]) -> dict | None:
    """freetoken's `/v1/stats` JSON, or None where the endpoint has no such route (another server)."""
    try:
        req = urllib.request.Request(endpoint.rstrip("/") + "/v1/stats", headers=headers)
        with urllib.request.urlopen(req, timeout=10) as r:
            stats = json.load(r)
        return stats if isinstance(stats, dict) else None
    except (OSError, ValueError):
        return None


def server_counters(endpoint: str, headers: dict[str, str]) -> dict | None:
    """freetoken's request counters (`/v1/stats`), or None from another server."""
    counters = (_server_stats(endpoint, headers) or {}).get("requests")
    return counters if isinstance(counters, dict) else None


# an offloading server's expert counters that say where a turn's time went: its hit rate, the copies and CPU work
# of its misses, and the decode host thread's waits (for the routing, planning and queueing, the CPU share)
EXPERT_COUNTERS = ("hits", "misses", "evictions", "cpu_experts", "bytes_copied", "copy_seconds", "cpu_seconds",
                   "prefetched", "prefetch_used", "layer_steps", "gpu_wait_seconds", "host_seconds",
                   "cpu_wait_seconds", "cpu_starts", "cpu_start_delay_seconds", "step_cpu_experts",
                   "step_cpu_seconds")


def expert_counters(endpoint: str, headers: dict[str, str]) -> dict | None:
    """freetoken's expert counters and its miss path's current way (`/v1/stats`), or None from another server."""
    try:
        stats = _server_stats(endpoint, headers)
        experts = stats["engine"]["experts"]
        counters = {**{k: experts[k] for k in EXPERT_COUNTERS}, "guard_way": experts.get("guard_way", ""),
                    "expert_bytes": experts["host_bytes_per_expert"],
                    "guard_windows_closed": experts.get("guard_windows_closed", 0),
                    "guard_windows": experts.get("guard_windows", [])}
    except (KeyError, TypeError):
        return None
    gc = stats.get("gc")  # the collector's pauses (servers since 2026-12-05): they stop the decode thread too
    if isinstance(gc, dict):
        counters.update(gc_seconds=gc["pause_seconds"], gc_full=gc["full_collections"])
    return counters


def counters_delta(before: dict | None, after: dict | None) -> dict | None:
    """What the counters gained between two reads (with turns in flight beside it, theirs too), and the hit rate
    and miss path way over that span; None unless both reads succeeded."""
    if before is None or after is None:
        return None
    delta: dict[str, Any] = {k: round(after[k] - before[k], 6) for k in EXPERT_COUNTERS}
    looked_up = delta["hits"] + delta["misses"]
    delta["hit_rate"] = round(delta["hits"] / looked_up, 4) if looked_up else None
    delta["guard_way"] = after["guard_way"]
    # the path guard's windows closed over the span (its latest ones, as many as it keeps): way, bias, µs per miss
    closed = after["guard_windows_closed"] - before["guard_windows_closed"]
    delta["guard_windows"] = after["guard_windows"][-closed:] if closed > 0 else []
    # the decode CPU share's kernel rate and its start delay over the turn: a slower kernel (DRAM shared, cores
    # taken) against a later start (the host) when the CPU wait grows
    seconds, starts = delta["step_cpu_seconds"], delta["cpu_starts"]
    delta["step_cpu_gb_s"] = round(delta["step_cpu_experts"] * after["expert_bytes"] / seconds / 1e9, 2) \
        if seconds > 0 else None
    delta["cpu_start_delay_ms"] = round(delta["cpu_start_delay_seconds"] / starts * 1e3, 4) if starts else None
    if "gc_seconds" in before and "gc_seconds" in after:
        delta["gc_seconds"] = round(after["gc_seconds"] - before["gc_seconds"], 6)
        delta["gc_full"] = after["gc_full"] - before["gc_full"]
    return delta
