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
import json
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from freetoken.bench.decode import measure_ceilings
from freetoken.bench.synthetic import build_synthetic
from freetoken.engine.cuda_graphs import GraphedDecoder
from freetoken.engine.loader import attach_experts, build_executor
from freetoken.engine.offload import cpu_experts
from freetoken.engine.offload import executor as executor_module
from freetoken.engine.offload.expert_cache import ExpertCache
from freetoken.engine.offload.planner import MissPlanner
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
    "cpu_launch_py": (cpu_experts.CpuExpertRunner, "_launch"),  # the workspace filled, then the kernel started
    "kernel_launch": (CpuExpertKernel, "launch"),  # argument conversion and ft_moe_start (waking the workers)
}


def _mark(owner, name: str, label: str) -> None:
    fn = getattr(owner, name)

    def marked(*args, **kwargs):
        with record_function(label):
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
    p.add_argument("--budget", default="0")
    p.add_argument("--strategy", default="auto", choices=["auto", "auto-noprefetch", "copy", "cpu"])
    p.add_argument("--tokens", type=int, default=6)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--expert-format", default="dense", choices=["dense", "Q8_0"])
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    ceilings = measure_ceilings(device, a.expert_format, dtype, 512)
    lm = build_synthetic(a.shape, device=device, dtype=dtype, expert_cache=0, layers=a.layers, seed=0,
                         expert_format=a.expert_format)
    miss_path = a.strategy.removesuffix("-noprefetch")
    executor = build_executor(lm.experts.host, lm.moe_spec, dtype, device, parse_bytes(a.budget), "freq", miss_path)
    executor.prefetch = a.strategy == "auto"
    executor.planner = MissPlanner(ceilings.h2d, ceilings.cpu_experts)
    attach_experts(lm.model, executor)
    lm.experts = executor
    for label, (owner, name) in PHASES.items():
        _mark(owner, name, f"ft.{label}")
    _mark(executor.copier, "to_slots", "ft.copies")
    _mark(fused, "dequantize_into", "ft.dequant_launch")
    _mark(type(executor.cpu), "start_pairs", "ft.cpu_start")
    started = cpu_experts._Started.__init__

    def marked_wait(self, finish):
        def wait():
            with record_function("ft.cpu_wait"):
                return finish()
        started(self, wait)

    cpu_experts._Started.__init__ = marked_wait
    gen = torch.Generator().manual_seed(0)
    context = 256
    ids = torch.randint(0, lm.args.decoder.vocab_size, (context + a.warmup + a.tokens,), generator=gen).tolist()
    cache = lm.new_cache(initial_tokens=len(ids) + 16, max_tokens=len(ids) + 16)
    seq = cache.new_sequence()
    decoder = GraphedDecoder(lm, cache)
    with torch.inference_mode():
        executor.miss_path = "copy"
        lm.forward(torch.tensor(ids[:context], device=device), cache, seq, "last")
        executor.miss_path = miss_path
        for token in ids[context:context + a.warmup]:
            int(decoder.step(seq, token).argmax())
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for token in ids[context + a.warmup:]:
                with record_function("ft.token"):
                    int(decoder.step(seq, token).argmax())
            elapsed = time.perf_counter() - t0
    a.out.mkdir(parents=True, exist_ok=True)
    trace_path = a.out / f"trace-{a.shape}-{a.strategy}-{a.budget}.json"
    prof.export_chrome_trace(str(trace_path))
    c = executor.counters
    if c.cpu_starts:
        print(f"CPU share started {c.cpu_start_delay_seconds / c.cpu_starts * 1e6:.0f} µs after the routing reached "
              f"the host (mean of {c.cpu_starts}, warm-up included)")
    print(f"{a.shape} {a.strategy} budget {a.budget}: {a.tokens / elapsed:.2f} tok/s under the profiler, "
          f"{elapsed / (a.tokens * a.layers) * 1e6:.0f} µs per layer-step; counters {c}")
    print(summarize(json.loads(trace_path.read_text()), a.layers, a.tokens))


if __name__ == "__main__":
    main()
