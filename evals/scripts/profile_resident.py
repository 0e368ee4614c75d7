"""Where resident work goes on a synthetic real-shape model (every expert on the device): one long prefill
chunk, or (`--decode`) captured decode steps after it, timed, then profiled by operator or kernel (device time and
host time). A diagnostic, not a benchmark.

    python evals/scripts/profile_resident.py [--shape qwen3-30b-a3b] [--layers 8] [--tokens 16384] [--decode 16]

On the H200, a 16k-token resident prefill of the 48-layer Qwen3-30B-A3B shape took 0.97-1.42 s against ~0.3 s of
attention and expert arithmetic at the measured matmul rate (evals/results/p1-*): it bounds every offloaded
prefill too, since streaming overlaps compute. A resident decode step took 15 ms at 1k context where the bytes
it must read (~6 GB) take ~1.5 ms at HBM speed (evals/results/d1-*): `--decode` shows which kernels hold it.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from freetoken.bench.decode import _on_device
from freetoken.bench.synthetic import build_synthetic
from freetoken.engine.experts import (
    ResidentExpertExecutor,
    grouped_expert_forward,
    grouped_mm_available,
    sorted_expert_forward,
)
from freetoken.engine.loader import attach_experts


def check_sorted(stacks, device: torch.device) -> None:
    """Where the sorted grouped-matmul path is on, its output against the expert-by-expert one (fresh inputs)."""
    hidden = torch.randn(4096, stacks.gate_proj.shape[2], device=device, dtype=torch.bfloat16)
    if not grouped_mm_available(hidden):
        print("sorted grouped matmuls: off here (bf16 on Hopper or newer; FREETOKEN_DISABLE=grouped-mm)")
        return
    ids = torch.rand(4096, stacks.num_experts, device=device).topk(8, dim=-1).indices
    weights = torch.rand(4096, 8, device=device)
    want = grouped_expert_forward(stacks, hidden, ids, weights).float()
    got = sorted_expert_forward(stacks, hidden, ids, weights).float()
    print(f"sorted grouped matmuls vs expert by expert: relative error {(got - want).norm() / want.norm():.2e}")


def profile_decode(lm, ids: torch.Tensor, a: argparse.Namespace) -> int:
    """The prompt prefilled, then `a.decode` steps replayed from CUDA graphs, timed and profiled by kernel."""
    from freetoken.engine.cuda_graphs import GraphedDecoder

    capacity = len(ids) + 2 * a.decode + 16
    cache = lm.new_cache(initial_tokens=capacity, max_tokens=capacity)
    seq = cache.new_sequence()
    decoder = GraphedDecoder(lm, cache)
    with torch.inference_mode():
        lm.forward(ids, cache, seq, "last")
        feed = torch.randint(0, lm.args.decoder.vocab_size, (2 * a.decode,)).tolist()
        decoder.step(seq, feed[0])  # captures
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for token in feed[1:a.decode + 1]:
            int(decoder.step(seq, token).argmax())
        elapsed = time.perf_counter() - t0
        print(f"{a.layers} layers, {a.tokens} tokens of context: {elapsed / a.decode * 1e3:.2f} ms per decode step "
              f"({elapsed / a.decode / a.layers * 1e3:.3f} ms per layer)")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for token in feed[a.decode + 1:]:
                int(decoder.step(seq, token).argmax())
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=a.rows, max_name_column_width=70))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--device", default="cuda")
    p.add_argument("--decode", type=int, default=0, help="profile this many captured decode steps after the prompt "
                   "(instead of the prefill)")
    a = p.parse_args()
    device = torch.device(a.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    lm = build_synthetic(a.shape, device=device, layers=a.layers, expert_cache=0)
    resident = ResidentExpertExecutor({i: _on_device(le, device, torch.bfloat16) for i, le in lm.experts.host.items()})
    attach_experts(lm.model, resident)
    lm.experts = resident
    ids = torch.randint(0, lm.args.decoder.vocab_size, (a.tokens,), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)

    def prefill():
        cache = lm.new_cache(initial_tokens=a.tokens + 16, max_tokens=a.tokens + 16)
        seq = cache.new_sequence()
        with torch.inference_mode():
            lm.forward(ids, cache, seq, "last")
        sync()
        cache.release(seq)

    if a.decode:
        return profile_decode(lm, ids, a)
    check_sorted(resident.layers[next(iter(resident.layers))], device)
    prefill()  # warm-up
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        prefill()
        times.append(time.perf_counter() - t0)
    print(f"{a.layers} layers, {a.tokens} tokens: {sorted(times)[1] * 1e3:.1f} ms per prefill (median of 3), "
          f"{sorted(times)[1] / a.layers * 1e3:.2f} ms per layer")
    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        prefill()
    by = "cuda_time_total" if cuda else "cpu_time_total"
    print(prof.key_averages().table(sort_by=by, row_limit=a.rows, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
