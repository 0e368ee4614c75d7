"""Would reading a layer's CPU-bound experts into the caches ahead of their job speed the job up? A diagnostic for
an idea, not a benchmark: during decode the CPU idles while the GPU runs a layer's dense work, and the next
layer's experts are predicted by then, so the kernel's threads could pull the predicted experts' weights from DRAM
into L2/L3 meanwhile and compute them from there once the routing arrives.

    python evals/scripts/warm_experts.py [--threads 15] [--formats Q8_0 BF16] [--experts 1 2 4 6] [--tokens 1]
                                         [--gaps 100 200 400]

Per format and expert count, in turn: a job on experts not read for a while (cold: drawn from ~1 GiB of
Qwen3-30B-A3B-shaped experts); a job on experts `ft_read_bytes` has just read on all threads (read); and a job
posted GAP µs after `ft_warm` started reading its experts in the background, as decode would (`--gaps`; the job
cancels what the warming has not read yet, and its time includes that); the same job run again at once (again:
each worker finds in its caches what some worker read, the bound for warming with this pool's task order); and
both with owned rows (`ft_set_owned_rows`: each worker computes the rows `ft_warm_rows` had it read: owned GAP,
owned again).
Medians of the jobs' own clock (posting to last task), and each against cold.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch

from freetoken.kernels.cpu_experts.bench import HIDDEN, expert_pool
from freetoken.kernels.cpu_experts.kernel import CpuExpertKernel


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=15)
    p.add_argument("--formats", nargs="+", default=["Q8_0", "BF16"])
    p.add_argument("--experts", nargs="+", type=int, default=[1, 2, 4, 6])
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--gaps", nargs="+", type=int, default=[100, 200, 400], help="µs from warming to the job")
    args = p.parse_args(argv)
    os.environ.setdefault("FREETOKEN_CPU_THREADS", str(args.threads))
    torch.set_num_threads(1)  # torch's own pool would spin on the kernel's cores
    kernel = CpuExpertKernel.get(threads=args.threads)
    x = torch.randn(args.tokens, HIDDEN) * 0.5
    print(f"threads {kernel.threads}, {args.tokens} token(s) per expert, medians of {args.rounds} rounds")
    cases = ["read", *(f"warm {g}" for g in args.gaps), "again", *(f"owned {g}" for g in args.gaps), "owned again"]
    print("| format | experts | MB | cold µs | " + " | ".join(f"{c} µs" for c in cases) + " | "
          + " | ".join(f"cold / {c}" for c in cases) + " | cold GB/s |")
    print("| --- " + "| ---: " * (2 * len(cases) + 4) + "|")
    for fmt in args.formats:
        pool_experts = 200 if fmt == "Q8_0" else 110  # ~1 GiB, far over any last-level cache
        mats = expert_pool(fmt, pool_experts, torch.Generator().manual_seed(0))
        constants = kernel.launch_constants(*mats)
        expert_bytes = sum(m.data[0].numel() * m.data[0].element_size() for m in mats)
        for n in args.experts:
            rnd = random.Random(n)
            times: dict[str, list[float]] = {"cold": [], **{c: [] for c in cases}}
            for _ in range(args.rounds):
                times["cold"].append(_job(kernel, mats, x, rnd.sample(range(pool_experts), n)))
                ids = rnd.sample(range(pool_experts), n)
                for m in mats:
                    for e in ids:
                        kernel.read_bytes(m.data[e])
                times["read"].append(_job(kernel, mats, x, ids))
                for owned in (False, True):
                    kernel.set_owned_rows(owned)
                    for g in args.gaps:
                        ids = rnd.sample(range(pool_experts), n)
                        if owned:
                            kernel.warm_rows(constants, torch.tensor(ids, dtype=torch.int32), HIDDEN)
                        else:
                            kernel.warm([(m.data[e].data_ptr(), m.data[e].numel() * m.data[e].element_size())
                                         for m in mats for e in ids])
                        until = time.perf_counter() + g / 1e6
                        while time.perf_counter() < until:
                            pass
                        times[f"{'owned' if owned else 'warm'} {g}"].append(_job(kernel, mats, x, ids))
                    times["owned again" if owned else "again"].append(_job(kernel, mats, x, ids))
                kernel.set_owned_rows(False)
            med = {key: statistics.median(v) for key, v in times.items()}
            gb = n * expert_bytes / 1e9
            print(f"| {fmt} | {n} | {gb * 1e3:.1f} | {med['cold'] * 1e6:.0f} | "
                  + " | ".join(f"{med[c] * 1e6:.0f}" for c in cases) + " | "
                  + " | ".join(f"{med['cold'] / med[c]:.2f}" for c in cases) + f" | {gb / med['cold']:.1f} |",
                  flush=True)
    return 0


def _job(kernel: CpuExpertKernel, mats, x: torch.Tensor, ids: list[int]) -> float:
    tokens, n = x.shape[0], len(ids)
    pending = kernel.start(x, *mats, torch.tensor(ids, dtype=torch.int32),
                           torch.arange(0, (n + 1) * tokens, tokens, dtype=torch.int32),
                           torch.arange(tokens, dtype=torch.int32).repeat(n), torch.full((n * tokens,), 0.1),
                           round_to=torch.bfloat16, x_bf16=x.bfloat16())
    pending.wait()
    return pending.seconds


if __name__ == "__main__":
    raise SystemExit(main())
