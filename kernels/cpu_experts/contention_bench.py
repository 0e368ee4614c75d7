"""Micro-benchmark: decode-sized CPU expert calls while other processes take cores now and then, with the pool's
job ending at its last task (`set_join(True)`, default) or only once every worker has checked in (`False`).

    python -m freetoken.kernels.cpu_experts.contention_bench [--noise 1] [--busy-us 500] [--idle-us 1500]

In the server the kernel's workers share the host with the GPU-driving thread, the event loop and, in an A1 run,
the client: now and then more threads want to run than there are cores, and the OS deschedules a worker for a
time slice (milliseconds). Each call here is one layer-step's CPU share (one token, `--experts` experts of
Qwen3-30B-A3B's shape from a pool far larger than the last-level cache), `--gap-us` apart (the GPU's part of a
layer). `--noise` processes each run busy `--busy-us`, then sleep `--idle-us`, over and over. Per join mode:
median, p90, p99 and mean call time, in µs; rounds alternate so a drifting machine shows as disagreeing repeats.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time

import torch

from freetoken.kernels.cpu_experts.bench import decode_launcher, kernel_and_pool
from freetoken.kernels.cpu_experts.kernel import CpuExpertKernel


def _noise(busy_s: float, idle_s: float, stop) -> None:
    while not stop.is_set():
        until = time.perf_counter() + busy_s
        while time.perf_counter() < until:
            pass
        time.sleep(idle_s)


def call_times(kernel: CpuExpertKernel, mats, experts: int, pool: int, calls: int, gap_s: float) -> list[float]:
    launch = decode_launcher(kernel, mats, experts)
    times = []
    for c in range(calls):
        ids = torch.arange(c * experts, (c + 1) * experts, dtype=torch.int32) % pool
        until = time.perf_counter() + gap_s  # the GPU's part of the layer: the caller busy, the workers spinning
        while time.perf_counter() < until:
            pass
        t0 = time.perf_counter()
        launch(ids).wait()
        times.append(time.perf_counter() - t0)
    return times


def summary(times: list[float]) -> dict[str, float]:
    q = statistics.quantiles(times, n=100)
    return {"p50": statistics.median(times) * 1e6, "p90": q[89] * 1e6, "p99": q[98] * 1e6,
            "mean": statistics.fmean(times) * 1e6}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--format", default="Q8_0", choices=["BF16", "Q8_0"])
    p.add_argument("--experts", type=int, default=8, help="experts per call (one token)")
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=2, help="rounds per join mode, alternated")
    p.add_argument("--gap-us", type=float, default=100.0)
    p.add_argument("--noise", type=int, default=1, help="processes taking a core now and then")
    p.add_argument("--busy-us", type=float, default=500.0)
    p.add_argument("--idle-us", type=float, default=1500.0)
    p.add_argument("--pool-mib", type=int, default=1024)
    a = p.parse_args(argv)
    kernel, mats, pool = kernel_and_pool(a.format, a.experts, a.pool_mib)
    call_times(kernel, mats, a.experts, pool, a.calls // 4, a.gap_us * 1e-6)  # page faults, warm caches
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    noise = [ctx.Process(target=_noise, args=(a.busy_us * 1e-6, a.idle_us * 1e-6, stop), daemon=True)
             for _ in range(a.noise)]
    for proc in noise:
        proc.start()
    print(f"threads {kernel.threads}; {a.format}, {a.experts} experts of one token a call, {a.calls} calls a round, "
          f"{a.gap_us:.0f} µs apart; {a.noise} noise processes ({a.busy_us:.0f} µs busy, {a.idle_us:.0f} µs idle)")
    print("| join | p50 µs | p90 µs | p99 µs | mean µs |")
    print("| --- | ---: | ---: | ---: | ---: |")
    try:
        for _ in range(a.rounds):
            for by_tasks in (True, False):
                kernel.set_join(by_tasks)
                r = summary(call_times(kernel, mats, a.experts, pool, a.calls, a.gap_us * 1e-6))
                print(f"| {'last task' if by_tasks else 'every worker'} | {r['p50']:.0f} | {r['p90']:.0f} | "
                      f"{r['p99']:.0f} | {r['mean']:.0f} |", flush=True)
    finally:
        kernel.set_join(True)
        stop.set()
        for proc in noise:
            proc.join()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
