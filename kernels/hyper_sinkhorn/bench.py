"""Micro-benchmark: µs per call of DeepSeek-V4's hyper-connection weights, the Triton kernel against the plain-torch
reference, on CUDA, at decode (1 token) and prefill-chunk sizes; V4's shape (4 streams, 20 Sinkhorn rounds).

    python -m freetoken.kernels.hyper_sinkhorn.bench [--tokens 1 64 2048]

Host-bound at decode (the reference's ~120 launches), so the time is wall time per call, synchronised every call.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from freetoken.kernels.hyper_sinkhorn import kernel, reference


def time_call(fn, args: tuple, calls: int = 200) -> float:
    """Median µs of one call, the device synchronised after each."""
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn(*args)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[calls // 10:]) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 2048])
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("hyper_sinkhorn bench: needs CUDA")
    n, iters = 4, 20
    print("| tokens | torch µs | Triton µs | speed-up |\n| ---: | ---: | ---: | ---: |")
    for t in a.tokens:
        mixes = torch.randn(t, (2 + n) * n, device="cuda")
        base, scale = torch.randn((2 + n) * n, device="cuda"), torch.ones(3, device="cuda")
        args = (mixes, base, scale, n, iters, 1e-6)
        slow, fast = time_call(reference.hyper_mix, args), time_call(kernel.hyper_mix, args)
        print(f"| {t} | {slow:.1f} | {fast:.1f} | {slow / fast:.1f}× |")


if __name__ == "__main__":
    main()
