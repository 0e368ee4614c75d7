"""A/B of one of the CPU kernel's paths against what runs without it, interleaved rounds in one process:

    python evals/scripts/kernel_path_ab.py PATH POOL_MIB [--formats F ...] [--batches B ...] [--rounds N]

PATH: `q16` (int16 activations at one token per expert against the fp32 path; default formats MXFP4 Q8_0, batch
1), `block-bf16` (block formats dequantized to bf16 in registers at several tokens per expert against the fp32
path, both forced at every batch; default Q8_0 at batches 2 4 8) or `amx` (AMX tiles at their default token
counts against the vector paths; BF16 and Q8_0 at 2-16; needs a CPU with AMX). FREETOKEN_CPU_THREADS sets the
threads."""

import argparse
import statistics

import torch

from freetoken.kernels.cpu_experts.bench import dram_read_gb_s, expert_gb_s
from freetoken.kernels.cpu_experts.kernel import CpuExpertKernel

# path: (switch(lib, on), what runs when it is off, default formats, default batches)
PATHS = {"q16": (lambda lib, on: lib.ft_set_q16(on), "fp32", ["MXFP4", "Q8_0"], [1]),
         "block-bf16": (lambda lib, on: lib.ft_set_block_bf16(2 if on else 1 << 30), "fp32", ["Q8_0"], [2, 4, 8]),
         "amx": (lambda lib, on: lib.ft_set_amx(2, 6, int(not on)), "vector", ["BF16", "Q8_0"], [2, 4, 6, 8, 16])}
BYTES_PER_WEIGHT = {"MXFP4": 17 / 32, "Q8_0": 34 / 32, "BF16": 2.0}

parser = argparse.ArgumentParser()
parser.add_argument("path", choices=sorted(PATHS))
parser.add_argument("pool_mib", type=int)
parser.add_argument("--formats", nargs="+")
parser.add_argument("--batches", nargs="+", type=int)
parser.add_argument("--rounds", type=int, default=3)
args = parser.parse_args()
switch, off_label, formats, batches = PATHS[args.path]
k = CpuExpertKernel.get()
block_bf16_default = k.lib.ft_set_block_bf16(2)  # (restored below: the switch moves it)
k.lib.ft_set_block_bf16(block_bf16_default)
gen = torch.Generator().manual_seed(0)
print("threads", k.threads, "DRAM", round(dram_read_gb_s(k), 1))
res = {}
for _round in range(args.rounds):
    for fmt in args.formats or formats:
        pool = max(8, int(args.pool_mib * 2**20 / (3 * 2048 * 768 * BYTES_PER_WEIGHT[fmt])) // 8 * 8)
        for batch in args.batches or batches:
            for on in (1, 0):
                switch(k.lib, on)
                res.setdefault((fmt, batch, on), []).append(expert_gb_s(k, fmt, batch, pool, "kernel", gen))
switch(k.lib, 1)  # the defaults again: q16 on, AMX on,
k.lib.ft_set_block_bf16(block_bf16_default)  # block formats' threshold
for (fmt, batch, on), v in res.items():
    print(f"{fmt:5} b{batch:<2} {args.path if on else off_label:10}", " ".join(f"{x:5.1f}" for x in v),
          " median", round(statistics.median(v), 1))
