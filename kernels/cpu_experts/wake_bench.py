"""Micro-benchmark: what posting a decode-sized job to the pool costs when its workers sleep, woken all by the
poster (a condition-variable broadcast) or as a tree (`CpuExpertKernel.set_tree_wake`).

    python -m freetoken.kernels.cpu_experts.wake_bench [--format Q8_0] [--experts 4] [--calls 300]

Each call is one layer-step's CPU share of Qwen3-30B-A3B's shape (one token, `--experts` experts, from a pool far
larger than the last-level cache). Between calls the caller sleeps `--gap-us`: past the workers' spin (200 µs) they
are asleep, as between a decode step's CPU shares; a short gap finds them spinning. Per mode, medians of: the
start call (the caller's time until it can go on), the delay to the first task, and the whole job.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from freetoken.kernels.cpu_experts.bench import decode_launcher, kernel_and_pool
from freetoken.kernels.cpu_experts.kernel import CpuExpertKernel


def run_mode(kernel: CpuExpertKernel, mats, experts: int, pool: int, calls: int, gap_s: float) -> dict[str, float]:
    launch = decode_launcher(kernel, mats, experts)
    starts, firsts, totals = [], [], []
    for c in range(calls):
        ids = torch.arange(c * experts, (c + 1) * experts, dtype=torch.int32) % pool
        time.sleep(gap_s)
        before = kernel.timing()
        t0 = time.perf_counter()
        pending = launch(ids)
        t1 = time.perf_counter()
        pending.wait()
        t2 = time.perf_counter()
        after = kernel.timing()
        starts.append(t1 - t0)
        firsts.append((after[1] - before[1]) / max(after[0] - before[0], 1))
        totals.append(t2 - t0)
    skip = calls // 10  # the first calls pay for page faults
    return {name: statistics.median(v[skip:]) * 1e6 for name, v in
            (("start call", starts), ("to first task", firsts), ("job", totals))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--format", default="Q8_0", choices=["BF16", "Q8_0"])
    p.add_argument("--experts", type=int, default=4, help="experts per call (one token)")
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--gaps-us", nargs="+", type=float, default=[1000.0, 50.0])
    p.add_argument("--pool-mib", type=int, default=1024)
    a = p.parse_args(argv)
    kernel, mats, pool = kernel_and_pool(a.format, a.experts, a.pool_mib)
    print(f"threads {kernel.threads}; {a.format}, {a.experts} experts of one token a call, {a.calls} calls a row; "
          "µs, medians")
    print("| wake-up | gap between calls µs | start call | to first task | job |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for gap in a.gaps_us:
        for tree in (False, True, False, True):  # alternated: a drifting machine shows as disagreeing repeats
            mode = "tree" if kernel.set_tree_wake(tree) else "broadcast"
            if tree and mode != "tree":
                continue
            r = run_mode(kernel, mats, a.experts, pool, a.calls, gap * 1e-6)
            print(f"| {mode} | {gap:.0f} | {r['start call']:.1f} | {r['to first task']:.1f} | {r['job']:.1f} |",
                  flush=True)
    kernel.set_tree_wake(False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
