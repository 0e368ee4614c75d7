"""A/B of the CPU kernel's int16-activation path against its fp32 path at one token per expert (decode), MXFP4
and Q8_0, interleaved rounds:  python evals/scripts/q16_ab.py POOL_MIB  (FREETOKEN_CPU_THREADS sets the threads)."""

import statistics
import sys

import torch

from freetoken.kernels.cpu_experts.bench import dram_read_gb_s, expert_gb_s
from freetoken.kernels.cpu_experts.kernel import CpuExpertKernel

k = CpuExpertKernel.get()
gen = torch.Generator().manual_seed(0)
pool_mib = int(sys.argv[1])
print("threads", k.threads, "DRAM", round(dram_read_gb_s(k), 1))
res = {}
for _round in range(3):
    for fmt in ["MXFP4", "Q8_0"]:
        per = 3 * 2048 * 768 * {"MXFP4": 17 / 32, "Q8_0": 34 / 32}[fmt]
        pool = max(8, int(pool_mib * 2**20 / per) // 8 * 8)
        for on in (1, 0):
            k.lib.ft_set_q16(on)
            res.setdefault((fmt, on), []).append(expert_gb_s(k, fmt, 1, pool, "kernel", gen))
k.lib.ft_set_q16(1)
for (fmt, on), v in res.items():
    print(fmt, "int16" if on else "fp32 ", " ".join(f"{x:5.1f}" for x in v), " median", round(statistics.median(v), 1))
