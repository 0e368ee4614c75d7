"""Where a batched decode step goes: one sequence's step against B sequences' step, timed, then profiled.

    python evals/scripts/profile_batch.py --model M.gguf [--batch 4] [--expert-cache SIZE] [--steps 8]

`ft bench serve` on the H200 (evals/results/serve-q3-8l-*-h200.md) found 4 concurrent sessions of an 8-layer
Qwen3-30B-A3B-shaped Q8_0 GGUF at ~100 ms per step against 2.7 ms for one: far beyond the extra arithmetic.
This prints the median wall time of `forward` (one sequence, eager) and `forward_batch` (B sequences, eager) over
several steps with changing token counts per expert, how many torch.compile recompilations happened, and the
profiler's top operators by self CPU and by device time. A diagnostic, not a benchmark.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from freetoken.engine.loader import load_model
from freetoken.units import parse_bytes


def _timed(fn, device: torch.device, steps: int) -> float:
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--expert-cache", default=None)
    p.add_argument("--steps", type=int, default=8)
    a = p.parse_args()
    device = torch.device(a.device)
    lm = load_model(a.model, device=device, progress=False,
                    expert_cache=None if a.expert_cache is None else parse_bytes(a.expert_cache))
    cache = lm.new_cache(page_size=16)
    seqs = [cache.new_sequence() for _ in range(a.batch)]
    gen = torch.Generator().manual_seed(0)
    vocab = lm.args.decoder.vocab_size

    def tokens(n: int) -> torch.Tensor:
        return torch.randint(0, vocab, (n,), generator=gen).to(device)

    from torch._dynamo.utils import counters

    with torch.inference_mode():
        for s in seqs:
            lm.forward(tokens(32), cache, s, "last")
        single = _timed(lambda: lm.forward(tokens(1), cache, seqs[0], "last"), device, a.steps)
        before = sum(counters["stats"].values()) if "stats" in counters else 0
        batched = _timed(lambda: lm.forward_batch(tokens(a.batch), cache, seqs, [1] * a.batch), device, a.steps)
        after = sum(counters["stats"].values()) if "stats" in counters else 0
        print(f"one sequence: {single * 1e3:.2f} ms/step   {a.batch} sequences: {batched * 1e3:.2f} ms/step")
        print(f"dynamo counters during the batched steps: {after - before}  {dict(counters.get('stats', {}))}")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            for _ in range(2):
                lm.forward_batch(tokens(a.batch), cache, seqs, [1] * a.batch)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    table = prof.key_averages()
    print(table.table(sort_by="self_cpu_time_total", row_limit=25))
    if device.type == "cuda":
        print(table.table(sort_by="self_device_time_total", row_limit=15))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
