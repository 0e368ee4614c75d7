"""Where a decode step of the offloading executor spends its time: a torch-profiler trace plus a per-phase summary.

    python evals/scripts/profile_offload.py --layers 12 --budget 0 --strategy auto --out DIR

Builds a synthetic shape (`--shape`, default qwen3-30b-a3b; random weights) on CUDA, decodes through segmented
CUDA graphs as the engine does, and profiles a few steps with each host-side phase of the executor marked (the
work between two graph segments, dispatch, planning, copies, CPU start, prefetch, waiting for the CPU). Writes
DIR/trace-*.json (chrome://tracing) and prints the mean wall time per layer of each phase and the busy share of
each CUDA stream. A diagnostic, not a benchmark.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import os
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from freetoken.bench.decode import measure_ceilings
from freetoken.bench.synthetic import build_synthetic
from freetoken.engine import gpu_paths
from freetoken.engine.cuda_graphs import GraphedDecoder
from freetoken.engine.loader import attach_experts, build_executor
from freetoken.engine.offload import cpu_experts
from freetoken.engine.offload import executor as executor_module
from freetoken.engine.offload.block_store import BlockStore
from freetoken.engine.offload.expert_cache import ExpertCache
from freetoken.engine.offload.planner import MissPlanner
from freetoken.engine.offload.row_dequant import RowDequantizer
from freetoken.engine.offload.transfer import ExpertCopier
from freetoken.kernels.cpu_experts.kernel import CpuExpertKernel
from freetoken.kernels.gguf_dequant import fused
from freetoken.units import parse_bytes

PHASES = {  # (object, attribute) wrapped with a profiler range of the same name
    "layer": (executor_module.OffloadedExpertExecutor, "run_boundary"),  # host work between two graph segments
    "dispatch": (executor_module.OffloadedExpertExecutor, "_dispatch"),
    "plan": (executor_module.OffloadedExpertExecutor, "_plan"),
    "prefetch": (executor_module.OffloadedExpertExecutor, "_prefetch"),
    "backlog": (executor_module.OffloadedExpertExecutor, "_copy_backlog"),
    "prefetch_use": (executor_module.OffloadedExpertExecutor, "_count_prefetch_use"),
    "cache_step": (ExpertCache, "begin_step"),
    "cache_lookup": (ExpertCache, "lookup"),
    "record_step": (executor_module.OffloadedExpertExecutor, "_record_step"),  # the cache's bookkeeping
    "queue_copies": (executor_module.OffloadedExpertExecutor, "_queue_copies"),  # admissions and the copies
    "cache_admit": (ExpertCache, "admit"),
    "deferred_prefetch": (executor_module.OffloadedExpertExecutor, "_issue_deferred_prefetch"),
    "plan_prefetch": (executor_module.OffloadedExpertExecutor, "_plan_prefetch"),
    "copy_timings": (executor_module.OffloadedExpertExecutor, "_collect_copy_timings"),
    "to_device": (executor_module.OffloadedExpertExecutor, "_to_device"),  # slot map / CPU share to the device
    "step_time": (executor_module.OffloadedExpertExecutor, "_count_step_time"),  # counters, the guard
    "sync": (torch.cuda.Stream, "synchronize"),  # the wait for the segment's routing
    "cpu_launch_py": (cpu_experts.CpuExpertRunner, "_launch"),  # the workspace filled, then the kernel started
    "kernel_launch": (CpuExpertKernel, "launch"),  # argument conversion and ft_moe_start (waking the workers)
    # the block store's path (FREETOKEN_EXPERIMENTAL=block-store): its bookkeeping, copies, index and launches
    "store_copies": (ExpertCopier, "_store_copies"),
    "store_place": (BlockStore, "place"),
    "block_copies": (RowDequantizer, "block_copies"),
    "slot_index": (RowDequantizer, "_slot_index"),
    "dequant_rows": (ExpertCopier, "_dequantize_rows"),
}


class _Clock:
    """`--clock perf`: each marked range's inclusive wall time from perf_counter (~0.3 µs a call), no profiler.
    The profiler's own cost (~8 µs a range, more for every CUDA call it traces) hides what the host really
    spends; this gives the real split, without the GPU side."""

    def __init__(self):
        self.seconds = collections.defaultdict(float)
        self.calls = collections.Counter()

    @contextlib.contextmanager
    def __call__(self, label: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[label] += time.perf_counter() - t0
            self.calls[label] += 1

    def summary(self, steps: int) -> str:
        lines = [f"mean µs per layer-step over {steps} layer-steps (host thread, perf_counter, inclusive):"]
        for label, total in sorted(self.seconds.items(), key=lambda kv: -kv[1]):
            lines.append(f"  {label:<24} {total / steps * 1e6:8.1f}   ({self.calls[label] / steps:.2f} calls, "
                         f"{total / self.calls[label] * 1e6:.1f} µs each)")
        return "\n".join(lines)


def _mark(owner, name: str, label: str, scope=record_function) -> None:
    fn = getattr(owner, name)

    def marked(*args, **kwargs):
        with scope(label):
            return fn(*args, **kwargs)

    setattr(owner, name, marked)


def summarize(trace: dict, layers: int, tokens: int) -> str:
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    lines = []
    cpu_ranges = collections.defaultdict(float)
    for e in events:
        if e.get("cat") == "user_annotation" and e["name"].startswith("ft."):
            cpu_ranges[e["name"]] += e["dur"]
    steps = layers * tokens
    lines.append(f"mean µs per layer-step over {steps} layer-steps (host thread):")
    for name, total in sorted(cpu_ranges.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {name:<24} {total / steps:8.1f}")
    by_stream = collections.defaultdict(list)
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            by_stream[e.get("tid")].append((e["ts"], e["ts"] + e["dur"], e["cat"]))
    if by_stream:
        t0 = min(s for spans in by_stream.values() for s, _, _ in spans)
        t1 = max(f for spans in by_stream.values() for _, f, _ in spans)
        lines.append(f"GPU window {(t1 - t0) / 1e3:.2f} ms = {(t1 - t0) / steps:.1f} µs per layer-step; busy share:")
        for tid, spans in sorted(by_stream.items(), key=lambda kv: str(kv[0])):
            busy = sum(f - s for s, f, _ in spans)
            kinds = collections.Counter(c for _, _, c in spans)
            lines.append(f"  stream {tid}: {busy / (t1 - t0):6.1%} busy, {dict(kinds)}, "
                         f"{busy / steps:7.1f} µs per layer-step")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--budget", default="0", help="expert budget; several comma-separated: profiled one after "
                   "another on the same build")
    p.add_argument("--strategy", default="auto", choices=["auto", "auto-noprefetch", "copy", "cpu"])
    p.add_argument("--tokens", type=int, default=6)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--expert-format", default="dense", choices=["dense", "Q8_0"])
    p.add_argument("--clock", default="profiler", choices=["profiler", "perf"],
                   help="profiler: a torch-profiler trace (GPU streams too); perf: the host's real times, no trace")
    p.add_argument("--ab", metavar="PATHS", nargs="+",
                   help="with --clock perf: rounds with no experimental GPU path, then with each of these "
                   "(a FREETOKEN_EXPERIMENTAL value each: one path, or several joined by commas), twice over")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    clock = _Clock() if a.clock == "perf" else None
    scope = clock or record_function
    device, dtype = torch.device("cuda"), torch.bfloat16
    ceilings = measure_ceilings(device, a.expert_format, dtype, 512)
    lm = build_synthetic(a.shape, device=device, dtype=dtype, expert_cache=0, layers=a.layers, seed=0,
                         expert_format=a.expert_format)
    for label, (owner, name) in PHASES.items():
        _mark(owner, name, f"ft.{label}", scope)
    _mark(fused, "dequantize_into", "ft.dequant_launch", scope)
    _mark(cpu_experts.CpuExpertRunner, "start_pairs", "ft.cpu_start", scope)
    _mark(torch.cuda.CUDAGraph, "replay", "ft.graph_replay", scope)
    started = cpu_experts._Started.__init__

    def marked_wait(self, finish):
        def wait():
            with scope("ft.cpu_wait"):
                return finish()
        started(self, wait)

    cpu_experts._Started.__init__ = marked_wait
    host, runner = lm.experts.host, None
    for budget in a.budget.split(","):
        runner = _profile_budget(a, lm, host, ceilings, budget, clock, scope, runner)


def _profile_budget(a, lm, host, ceilings, budget: str, clock, scope, runner):
    """Decodes and reports with a fresh executor of expert budget `budget` on the model's host experts (and the
    previous executor's CPU runner, so one pool of kernel threads serves every budget). Returns its runner."""
    device = torch.device("cuda")
    miss_path = a.strategy.removesuffix("-noprefetch")
    executor = build_executor(host, lm.moe_spec, torch.bfloat16, device, parse_bytes(budget), "freq", miss_path)
    executor.prefetch = a.strategy == "auto"
    executor.planner = MissPlanner(ceilings.h2d, ceilings.cpu_experts)
    executor._cpu = runner
    attach_experts(lm.model, executor)
    lm.experts = executor
    _mark(executor.copier, "to_slots", "ft.copies", scope)
    a.budget_now = budget
    # --ab PATHS (perf clock): the same model and sequence decoded in rounds with no experimental GPU path, then
    # with each of PATHS, twice over: an A/B on one build, each round with a fresh planner and its own warm-up
    # (use --warmup 16 or more: the path guard measures each way three times first)
    rounds = [None] if a.ab is None else ["", *a.ab] * 2
    gen = torch.Generator().manual_seed(0)
    context, per_round = 256, a.warmup + a.tokens
    ids = torch.randint(0, lm.args.decoder.vocab_size, (context + per_round * len(rounds),), generator=gen).tolist()
    cache = lm.new_cache(initial_tokens=len(ids) + 16, max_tokens=len(ids) + 16)
    seq = cache.new_sequence()
    decoder = GraphedDecoder(lm, cache)
    with torch.inference_mode():
        executor.miss_path = "copy"
        lm.forward(torch.tensor(ids[:context], device=device), cache, seq, "last")
        executor.miss_path = miss_path
        for r, paths in enumerate(rounds):
            if paths is not None:  # each round learns afresh, so one round's state cannot favour the next
                executor.planner = MissPlanner(ceilings.h2d, ceilings.cpu_experts)
                executor.prefetch_lead_s = None
                os.environ["FREETOKEN_EXPERIMENTAL"] = paths
                gpu_paths.enabled.cache_clear()
                gpu_paths._named.cache_clear()
            start = context + r * per_round
            for token in ids[start:start + a.warmup]:
                int(decoder.step(seq, token).argmax())
            torch.cuda.synchronize()
            if clock is not None:
                clock.seconds.clear()
                clock.calls.clear()
            before = dataclasses.replace(executor.counters)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) if clock is None \
                    else contextlib.nullcontext() as prof:
                t0 = time.perf_counter()
                for token in ids[start + a.warmup:start + per_round]:
                    with scope("ft.token"):
                        int(decoder.step(seq, token).argmax())
                elapsed = time.perf_counter() - t0
            label = "" if paths is None else f" [{paths or 'no experimental path'}]"
            _report(a, executor, before, elapsed, label)
            if clock is not None:
                print(clock.summary(a.layers * a.tokens))
    if clock is not None:
        return executor._cpu
    a.out.mkdir(parents=True, exist_ok=True)
    trace_path = a.out / f"trace-{a.shape}-{a.strategy}-{budget}.json"
    prof.export_chrome_trace(str(trace_path))
    print(summarize(json.loads(trace_path.read_text()), a.layers, a.tokens))
    return executor._cpu


def _report(a, executor, before, elapsed: float, label: str) -> None:
    """The timed tokens' rate and the counters they moved."""
    c = executor.counters
    moved = {f.name: getattr(c, f.name) - getattr(before, f.name) for f in dataclasses.fields(c)}
    if moved["cpu_starts"]:
        print(f"CPU share started {moved['cpu_start_delay_seconds'] / moved['cpu_starts'] * 1e6:.0f} µs after the "
              f"routing reached the host (mean of {moved['cpu_starts']})")
    steps = moved["layer_steps"] or 1
    print(f"{a.shape} {a.strategy} budget {a.budget_now}{label}: {a.tokens / elapsed:.2f} tok/s under the {a.clock} "
          f"clock, {elapsed / (a.tokens * a.layers) * 1e6:.0f} µs per layer-step; per layer-step: "
          f"{moved['misses'] / steps:.2f} misses, {moved['cpu_experts'] / steps:.2f} on the CPU, "
          f"{moved['prefetched'] / steps:.2f} prefetched ({moved['prefetch_used'] / steps:.2f} used), "
          f"GPU wait / host / CPU wait {moved['gpu_wait_seconds'] / steps * 1e6:.0f} / "
          f"{moved['host_seconds'] / steps * 1e6:.0f} / {moved['cpu_wait_seconds'] / steps * 1e6:.0f} µs")
    print(f"planner: {executor.planner.describe()}")


if __name__ == "__main__":
    main()
