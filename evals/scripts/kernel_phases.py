"""Where a CPU expert kernel call's time goes at a given batch: per format, tokens per expert and experts per call,
the median call's GB/s, its split (posting to the first task, gate/up, down: `ft_moe_timing`) and the minor page
faults per call. Written to find why 32+ tokens per expert ran 8x slower than 16 on the H200 host
(evals/results/cpu-kernel-prefill-batches-h200.md).

    python evals/scripts/kernel_phases.py [--threads 15] [--batches 8 16 17 24 32 64] [--experts 8 64]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

import torch

from freetoken.kernels.cpu_experts.bench import HIDDEN, INTER, expert_pool
from freetoken.kernels.cpu_experts.kernel import CpuExpertKernel


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=15)
    p.add_argument("--batches", nargs="+", type=int, default=[8, 16, 17, 24, 32, 64])
    p.add_argument("--experts", nargs="+", type=int, default=[8, 64])
    p.add_argument("--formats", nargs="+", default=["BF16", "Q8_0"])
    p.add_argument("--pool-mib", type=int, default=1024)
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--preallocated", action="store_true", help="act/y/x_bf16 buffers made once, as decode does")
    a = p.parse_args()
    os.environ["FREETOKEN_CPU_THREADS"] = str(a.threads)
    kernel = CpuExpertKernel.get()
    gen = torch.Generator().manual_seed(0)
    print(f"threads {kernel.threads}, amx {kernel.amx}, preallocated {a.preallocated}")
    print("| format | tokens/expert | experts/call | GB/s | call ms | to first task ms | gate/up ms | down ms | "
          "minor faults/call |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for fmt in a.formats:
        per_expert = 3 * HIDDEN * INTER * {"BF16": 2, "Q8_0": 34 / 32}[fmt]
        pool_n = max(max(a.experts), int(a.pool_mib * 2**20 / per_expert))
        gate, up, down = expert_pool(fmt, pool_n, gen)
        for n_exp in a.experts:
            for batch in a.batches:
                x = torch.randn(batch, HIDDEN, generator=gen).bfloat16().float()
                xb = x.bfloat16()
                offsets = torch.arange(0, n_exp + 1, dtype=torch.int32) * batch
                tokens = torch.arange(batch, dtype=torch.int32).repeat(n_exp)
                weights = torch.rand(n_exp * batch, generator=gen)
                pairs = n_exp * batch
                act = torch.empty(pairs, INTER)
                actb = torch.empty(pairs, INTER, dtype=torch.bfloat16)
                y = torch.empty(batch, HIDDEN)
                rows = []
                for c in range(a.calls + 3):
                    first = (c * n_exp) % (pool_n - n_exp + 1)
                    experts = torch.arange(first, first + n_exp, dtype=torch.int32)
                    before = kernel.timing()
                    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                    t0 = time.perf_counter()
                    if a.preallocated:
                        kernel.launch(x, gate, up, down, experts, n_exp, offsets, tokens, weights, act, y,
                                      torch.bfloat16, xb, actb).wait()
                    else:
                        kernel.moe_forward(x, gate, up, down, experts, offsets, tokens, weights,
                                           round_to=torch.bfloat16)
                    seconds = time.perf_counter() - t0
                    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
                    after = kernel.timing()
                    if c >= 3:
                        wake, gate_up, job = (after[i] - before[i] for i in (1, 2, 3))
                        rows.append((seconds, wake, gate_up - wake, job - gate_up, faults))
                med = [statistics.median(r[i] for r in rows) for i in range(5)]
                gb_s = n_exp * per_expert / med[0] / 1e9
                print(f"| {fmt} | {batch} | {n_exp} | {gb_s:.1f} | {med[0] * 1e3:.2f} | {med[1] * 1e3:.3f} | "
                      f"{med[2] * 1e3:.2f} | {med[3] * 1e3:.2f} | {med[4]:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
