"""`ft bench prefill`: time to first token of long prompts on a synthetic real-shape MoE model, per strategy.

Strategies: `resident` (every expert on the device: the upper bound), `copy` (experts streamed over PCIe into the
expert cache of each --budgets size, through staging when it is full), `auto` (the product's executor: the same,
with the miss planner free to compute experts on the CPU); `copy-ahead` / `auto-ahead` also stream the next layer's
experts (every one the cache lacks) while each layer computes, so the link works through the next layer's
attention. Each prompt is
prefilled in chunks of --chunk tokens; a long chunk routes to nearly every expert of a layer, so each chunk streams
the experts the cache lacks once. The PCIe streaming bound is that: chunks × uncached expert bytes over the pinned
host→device bandwidth measured at the start of the run. Streaming overlaps compute, so a row's true floor is the
larger of that bound and the `resident` row's TTFT (the compute alone); both ratios are reported.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import dataclass, replace

import torch

from freetoken.bench.decode import (
    _on_device,
    _routing,
    _sync,
    add_model_args,
    add_run_args,
    emit,
    h2d_bandwidth,
    result_header,
)
from freetoken.bench.synthetic import build_synthetic
from freetoken.engine.experts import ResidentExpertExecutor
from freetoken.engine.loader import attach_experts, build_executor
from freetoken.units import parse_bytes


@dataclass(slots=True)
class Row:
    strategy: str
    budget: str
    prompt: int
    ttft_s: float
    copied_gb: float = 0.0
    cpu_experts: int = 0
    bound_s: float | None = None  # PCIe streaming bound
    compute_s: float | None = None  # the resident row's TTFT for this prompt
    same_first: bool | None = None  # the first token equals the first row's for this prompt (lossless check)


def prefill_once(lm, prompt: int, chunk: int, seed: int) -> tuple[float, int]:
    """(seconds from the prompt to the first sampled token, that token), greedy, all chunks prefilled."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, lm.args.decoder.vocab_size, (prompt,), generator=gen).to(lm.device)
    cache = lm.new_cache(initial_tokens=prompt + 16, max_tokens=prompt + 16)
    seq = cache.new_sequence()
    with torch.inference_mode():
        _sync(lm.device)
        t0 = time.perf_counter()
        for start in range(0, prompt, chunk):
            logits = lm.forward(ids[start:start + chunk], cache, seq, "last")
        first = int(logits[0].argmax())  # the host has the first token
        elapsed = time.perf_counter() - t0
    cache.release(seq)
    return elapsed, first


def bench(a: argparse.Namespace) -> tuple[list[Row], float | None]:
    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    h2d = h2d_bandwidth(device)
    lm = build_synthetic(a.shape, device=device, dtype=dtype, expert_cache=0, layers=a.layers, seed=a.seed,
                         skew=a.skew, expert_format=a.expert_format, prefill_ahead=False)  # rows build their own
    host, spec = lm.experts.host, lm.moe_spec
    expert_bytes = lm.experts.expert_bytes
    rows: list[Row] = []
    resident_s: dict[int, float] = {}
    first_of: dict[int, int] = {}  # prompt → the first row's first token
    for strategy in a.strategies:
        for budget in ["all"] if strategy == "resident" else a.budgets:
            if strategy == "resident":
                executor = ResidentExpertExecutor({layer: _on_device(le, device, dtype) for layer, le in host.items()})
            else:
                executor = build_executor(host, spec, dtype, device, parse_bytes(budget), "freq",
                                          strategy.removesuffix("-ahead"), prefill_ahead=strategy.endswith("-ahead"))
            attach_experts(lm.model, executor)
            lm.experts = executor
            # warm-up at full chunk length: the allocator's blocks and kernel choices of the timed runs
            prefill_once(lm, min(a.chunk, max(a.prompts)), a.chunk, a.seed + 1)
            for prompt in a.prompts:
                before = replace(executor.counters) if hasattr(executor, "counters") else None
                runs = [prefill_once(lm, prompt, a.chunk, a.seed) for _ in range(a.repeats)]
                row = Row(strategy, budget, prompt, statistics.median(t for t, _ in runs))
                first = first_of.setdefault(prompt, runs[0][1])
                row.same_first = all(token == first for _, token in runs)
                if before is not None:
                    c = executor.counters
                    row.copied_gb = (c.bytes_copied - before.bytes_copied) / 1e9 / a.repeats
                    row.cpu_experts = (c.cpu_experts - before.cpu_experts) // a.repeats
                    cached = executor.cache.capacity
                    uncached = max(spec.total_routed_experts - cached, 0) * expert_bytes
                    if h2d:
                        row.bound_s = math.ceil(prompt / a.chunk) * uncached / (h2d * 1e9)
                    row.compute_s = resident_s.get(prompt)
                else:
                    resident_s[prompt] = row.ttft_s
                rows.append(row)
                print(_format_row(row), file=sys.stderr, flush=True)
            lm.experts = None
            attach_experts(lm.model, None)
            del executor
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows, h2d


def _format_row(r: Row) -> str:
    bound = "—" if r.bound_s is None else f"{r.bound_s:.2f}"
    ratio = "—" if not r.bound_s else f"{r.ttft_s / r.bound_s:.2f}×"
    floor = max(r.bound_s or 0.0, r.compute_s or 0.0)
    of_floor = "—" if r.bound_s is None or r.compute_s is None else f"{r.ttft_s / floor:.2f}×"
    return (f"| {r.strategy} | {r.budget} | {r.prompt} | {r.ttft_s:.3f} | {r.prompt / r.ttft_s:.0f} | "
            f"{r.copied_gb:.3f} | {r.cpu_experts} | {bound} | {ratio} | {of_floor} | "
            f"{ {True: 'yes', False: 'no', None: '—'}[r.same_first]} |")


def render(rows: list[Row], a: argparse.Namespace, h2d: float | None) -> str:
    lines = [
        *result_header("Prefill / TTFT", "prefill", a),
        f"- random prompts, chunks of {a.chunk} tokens, median of {a.repeats} prefill(s) per row after a "
        f"full-chunk warm-up, random weights, {_routing(a.skew)}",
        f"- pinned host→device bandwidth measured in this run: {h2d:.1f} GB/s" if h2d else "- no PCIe (CPU run)",
        "- PCIe bound: chunks × uncached expert bytes / that bandwidth; floor: the larger of it and the resident "
        "row's TTFT (streaming overlaps compute)",
        "",
        "| strategy | expert budget | prompt tokens | TTFT s | prefill tok/s | GB copied | CPU experts | "
        "PCIe streaming bound s | TTFT / PCIe bound | TTFT / floor | same first token as first row |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
        *(_format_row(r) for r in rows),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="ft bench prefill", description=__doc__.splitlines()[0])
    add_model_args(p)
    p.add_argument("--prompts", default="4096,16384,32768", help="comma-separated prompt lengths")
    p.add_argument("--chunk", type=int, default=8192, help="prefill chunk in tokens")
    p.add_argument("--budgets", default="0,8GiB", help="comma-separated expert-cache sizes")
    p.add_argument("--strategies", default="resident,copy,auto",
                   help="comma-separated: resident, copy, auto, copy-ahead, auto-ahead (-ahead: while a layer "
                        "computes, the next layer's experts stream, so the link works through its attention)")
    p.add_argument("--repeats", type=int, default=1, help="prefills per row (the median TTFT is reported)")
    p.add_argument("--skew", type=float, default=0.0)
    add_run_args(p)
    a = p.parse_args(argv)
    a.argv, a.budgets, a.strategies = argv, a.budgets.split(","), a.strategies.split(",")
    a.prompts = [int(x) for x in a.prompts.split(",")]
    rows, h2d = bench(a)
    return emit(render(rows, a, h2d), a.out)
