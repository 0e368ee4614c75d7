"""Host time to queue a batch of Q8_0 expert copies, and the copy stream's time to land them (H200 diagnostic).

    python evals/scripts/copier_host_cost.py [--batches 1 2 4 8 16 32] [--reps 50]

The host thread that queues the copies is a decode step's critical path, so its cost per batch decides how
much the planner can send over the link. One layer of the synthetic qwen3-30b-a3b shape with Q8_0 experts in
pinned memory; each batch is queued, timed on the host, then drained (so every sample starts from an idle
stream). Rows for the fused dequantiser launched by Triton and replayed from a CUDA graph, plus the parts:
the runtime copies alone, one Triton launch, one graph replay. Prints a markdown table; a diagnostic, not a
benchmark.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from freetoken.bench.synthetic import build_synthetic
from freetoken.engine.offload import cudart, row_dequant
from freetoken.engine.offload.transfer import ExpertCopier
from freetoken.kernels.gguf_dequant import fused


def _median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def batch_costs(host, n: int, reps: int, graphs: bool) -> tuple[float, float]:
    """(median host µs to queue a batch of n, median µs the copy stream took for it)."""
    row_dequant.DEQUANT_GRAPHS = graphs
    copier = ExpertCopier(host, torch.device("cuda"), torch.bfloat16, staging_slots=max(16, n))
    dest = copier.allocate(max(64, n))
    layer = next(iter(host))
    experts = list(range(n))
    host_s, gpu_s = [], []
    for rep in range(reps + 3):
        slots = [(rep + i) % dest.gate_proj.shape[0] for i in range(n)]
        t0 = time.perf_counter()
        copier.begin()
        copier.to_slots(layer, experts, dest, slots)
        copier.end()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        timings = copier.finished_timings()
        if rep >= 3:  # the first ones compile and capture
            host_s.append(t1 - t0)
            gpu_s.extend(s for _, s, sample, _ in timings if sample)
    return _median_us(host_s), _median_us(gpu_s)


def part_costs(host, n: int, reps: int) -> dict[str, float]:
    """Median host µs of the parts of a batch: runtime copies alone, one Triton launch, one graph replay."""
    copier = ExpertCopier(host, torch.device("cuda"), torch.bfloat16, staging_slots=max(16, n))
    dest, layer = copier.allocate(max(64, n)), next(iter(host))
    rows = copier._raw_rows(n)
    stream = copier.stream.cuda_stream
    index = torch.arange(n, device="cuda")
    stacks = (dest.gate_proj, dest.up_proj, dest.down_proj)
    out = {"runtime copies": [], "triton launch": [], "graph replay": []}
    fused.dequantize_into(rows, "Q8_0", stacks, index)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(copier.stream):
        graph.capture_begin(capture_error_mode="thread_local")
        fused.dequantize_into(rows, "Q8_0", stacks, index)
        graph.capture_end()
    sources = copier.fused._sources[layer]
    for _ in range(reps):
        t0 = time.perf_counter()
        at = rows.data_ptr()
        for e in range(n):
            for address, nbytes in sources:
                cudart.copy_to_device(at, address + e * nbytes, nbytes, stream)
                at += nbytes
        t1 = time.perf_counter()
        fused.dequantize_into(rows, "Q8_0", stacks, index)
        t2 = time.perf_counter()
        graph.replay()
        t3 = time.perf_counter()
        torch.cuda.synchronize()
        out["runtime copies"].append(t1 - t0)
        out["triton launch"].append(t2 - t1)
        out["graph replay"].append(t3 - t2)
    return {k: _median_us(v) for k, v in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--reps", type=int, default=50)
    a = parser.parse_args()
    lm = build_synthetic("qwen3-30b-a3b", device="cuda", dtype=torch.bfloat16, expert_cache=0, layers=1,
                         expert_format="Q8_0")
    host = lm.experts.host
    expert_mb = lm.experts.expert_bytes / 1e6
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; one Q8_0 expert = {expert_mb:.2f} MB\n")
    print("| experts per batch | dequantiser | host µs per batch | host µs per copy | copy stream µs | GB/s |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    for n in a.batches:
        for graphs in (False, True):
            host_us, gpu_us = batch_costs(host, n, a.reps, graphs)
            print(f"| {n} | {'graph replay' if graphs else 'Triton launch'} | {host_us:.1f} | {host_us / n:.1f} | "
                  f"{gpu_us:.0f} | {n * expert_mb * 1e6 / gpu_us / 1e3:.1f} |", flush=True)
    print("\n| experts per batch | part | host µs |")
    print("| ---: | --- | ---: |")
    for n in (1, 8):
        for name, us in part_costs(host, n, a.reps).items():
            print(f"| {n} | {name} | {us:.1f} |", flush=True)


if __name__ == "__main__":
    main()
