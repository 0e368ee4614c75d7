"""CPU expert kernel variants compared fairly on a noisy host: every variant is timed once per round, rounds
interleave, and the table gives each variant's median and best GB/s with the DRAM read probe timed the same way.

    python evals/scripts/kernel_variants.py [--rounds 15] [--threads 15] [--pool-mib 1024] [--variants NAME ...]
                                            [--out FILE]

Variants are the kernel's switches (`ft_set_q16`: Q8_0 rows against int16 activations at one token per expert, or
the fp32 path; `ft_set_q16_form`: that path's rows in interleaved pairs or one at a time; `ft_set_amx`: tiles on or
off, and from how many tokens per expert Q8_0 takes bf16 tiles; `ft_set_amx_q8`: the token counts Q8_0 takes int8
tiles at; `ft_set_avx2_dots`: the dot products on 8-lane registers, the default without AVX-512, or on the 16-lane
vectors; `ft_set_dots_prefetch`: the rows' software prefetch distance; `ft_set_q16_rows` and `ft_set_q16_rows_from`:
the token counts Q8_0 takes the int16 path 16 rows at a time at), switched between calls in one process, so every
variant reads the very same expert pool; "huge pages" reads a copy of the pool advised for transparent huge pages
(the probe is then also timed on such a copy). (Earlier variants, measured and dropped: an earlier software
prefetch, Q8_0 through bf16 dot products (commit 7389ec5), the int16 path's block scales by scalar loads instead of
one gather (d867a6f), rows of the other paths dotted one at a time instead of two interleaved (commit 48d99b5), the
int16 path's rows one at a time (d867a6f).)
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time
from dataclasses import dataclass

import torch

from freetoken.kernels.cpu_experts.bench import HIDDEN, INTER, PER_CALL, expert_pool
from freetoken.kernels.cpu_experts.kernel import CpuExpertKernel
from freetoken.kernels.cpu_experts.reference import ExpertMatrix


@dataclass(frozen=True)
class Variant:
    """The kernel's switches for one variant, and where it differs from the default (formats, batches)."""
    q16: int = 1              # ft_set_q16: Q8_0 at one token per expert against int16 activations
    q8_tiles_from: int = 6    # ft_set_amx's second argument: fewest tokens per expert for Q8_0's bf16 tiles
    amx_off: int = 0          # ft_set_amx's third: every tile path off
    two_rows: int = 1         # ft_set_q16_form: the int16 path's rows in interleaved pairs
    int8_tiles: tuple = (2, 0)  # ft_set_amx_q8: the token counts Q8_0's int8 tiles take ((2, 0): never, default)
    rows: int = 16            # ft_set_amx_q8_rows: weight rows a pass of the int8 tiles takes
    prefetch: int = 0         # ft_set_amx_prefetch: the tile paths' software prefetch distance (32-weight chunks)
    dequant_prefetch: int = 4096  # ft_set_amx_dequant_prefetch: bytes ahead while block formats dequantize for tiles
    dequant_streams: int = 4  # ft_set_amx_dequant_streams: interleaved runs of rows a 16-row block is dequantized as
    tile_pairs: int = 1       # ft_set_amx_tile_pairs: two of an expert's token tiles a bf16 tile pass (17+ tokens)
    vector_act: int = 1       # ft_set_vector_act: the epilogues (activations, pair outputs) 16 values at a time
    avx2_dots: int | None = None  # ft_set_avx2_dots: 8-lane dot products (1) or 16-lane (0); None: the build's
    dots_prefetch: int | None = None  # ft_set_dots_prefetch: bytes ahead in each row on the vector paths; None: the
    #                                   build's
    q16_rows: int | None = None  # ft_set_q16_rows: up to how many tokens Q8_0 takes the int16 path 16 rows at a
    #                              time; None: the build's
    q16_rows_from: int | None = None  # ft_set_q16_rows_from: from how many tokens; None: the build's
    huge: bool = False        # the expert pool on huge pages
    formats: tuple = ("BF16", "Q8_0")
    batches: tuple = (1, 2, 3, 4, 5, 6, 8, 16, 32, 48, 64)


VARIANTS = {
    "default": Variant(),
    "Q8_0 fp32 path": Variant(q16=0, formats=("Q8_0",)),
    "Q8_0 int8 tiles": Variant(int8_tiles=(2, 32), formats=("Q8_0",), batches=(2, 4, 8, 16, 32)),
    "Q8_0 int8 tiles, 32 rows": Variant(int8_tiles=(2, 32), rows=32, formats=("Q8_0",), batches=(2, 4, 8, 16, 32)),
    "tiles, prefetch 4": Variant(prefetch=4, batches=(2, 4, 8, 16, 32)),
    "tiles, prefetch 8": Variant(prefetch=8, batches=(2, 4, 8, 16, 32)),
    "Q8_0 tiles, dequantized as one run": Variant(dequant_streams=1, formats=("Q8_0",), batches=(5, 6, 8, 16)),
    "Q8_0 tiles, dequantized as 2 runs": Variant(dequant_streams=2, formats=("Q8_0",), batches=(6, 8, 16)),
    "Q8_0 tiles, dequantized as 8 runs": Variant(dequant_streams=8, formats=("Q8_0",), batches=(6, 8, 16)),
    "Q8_0 tiles from 4": Variant(q8_tiles_from=4, formats=("Q8_0",), batches=(4, 5)),
    "Q8_0 tiles, no dequant prefetch": Variant(dequant_prefetch=0, formats=("Q8_0",), batches=(6, 8, 16)),
    "Q8_0 tiles, dequant prefetch 16 KiB": Variant(dequant_prefetch=16384, formats=("Q8_0",), batches=(6, 8, 16)),
    "tiles, one token tile a pass": Variant(tile_pairs=0, batches=(32, 48, 64)),
    "epilogues one by one": Variant(vector_act=0, batches=(6, 8, 16, 32, 64)),
    "8-lane dots": Variant(avx2_dots=1, batches=(1, 2, 4, 8)),
    "16-lane dots": Variant(avx2_dots=0, batches=(1, 2, 4, 8)),
    "8-lane dots, Q8_0 fp32 path": Variant(avx2_dots=1, q16=0, formats=("Q8_0",), batches=(1, 2, 4, 8)),
    "Q8_0 int16 rows": Variant(q16_rows=8, q16_rows_from=2, formats=("Q8_0",), batches=(2, 3, 4, 5, 6, 8)),
    "Q8_0 int16 rows, no bf16 tiles": Variant(q16_rows=8, q16_rows_from=2, q8_tiles_from=99, formats=("Q8_0",),
                                              batches=(6, 8)),
    "Q8_0 no int16 rows": Variant(q16_rows=1, formats=("Q8_0",), batches=(2, 3, 4, 5, 6, 8)),
    "no vector prefetch": Variant(dots_prefetch=0, batches=(1, 2, 3, 4, 5, 8)),
    "vector prefetch 1 KiB": Variant(dots_prefetch=1024, batches=(1, 2, 3, 4, 5, 8)),
    "vector prefetch 4 KiB": Variant(dots_prefetch=4096, batches=(1, 2, 3, 4, 5, 8)),
    "vector prefetch 16 KiB": Variant(dots_prefetch=16384, batches=(1, 2, 3, 4, 5, 8)),
}
MADV_HUGEPAGE = 14


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A copy of t in memory advised for transparent huge pages before it is first touched (the 2 MiB-aligned
    part of it; whether the kernel grants them is /sys/kernel/mm/transparent_hugepage's call)."""
    out = torch.empty_like(t)
    start, size = out.data_ptr(), out.numel() * out.element_size()
    lo, hi = (start + (1 << 21) - 1) & ~((1 << 21) - 1), (start + size) & ~((1 << 21) - 1)
    if hi > lo:
        ctypes.CDLL(None).madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), MADV_HUGEPAGE)
    return out.copy_(t)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--threads", type=int, default=15)
    p.add_argument("--pool-mib", type=int, default=1024)
    p.add_argument("--batches", nargs="+", type=int, default=[1, 2, 4, 8])
    p.add_argument("--formats", nargs="+", default=["BF16", "Q8_0"])
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--out")
    a = p.parse_args()
    variants = {name: VARIANTS[name] for name in a.variants}
    os.environ["FREETOKEN_CPU_THREADS"] = str(a.threads)
    kernel = CpuExpertKernel.get()
    avx2_default = kernel.lib.ft_set_avx2_dots(0)  # -1: a build without AVX2, where the switch does nothing
    kernel.lib.ft_set_avx2_dots(avx2_default)
    prefetch_default = kernel.lib.ft_set_dots_prefetch(0)
    rows_default = kernel.lib.ft_set_q16_rows(1)
    rows_from_default = kernel.lib.ft_set_q16_rows_from(2)
    gen = torch.Generator().manual_seed(0)
    probe = torch.randint(0, 256, (1 << 30,), dtype=torch.uint8)
    huge_probe = on_huge_pages(probe) if any(v.huge for v in variants.values()) else None
    pools = {}
    for fmt in a.formats:
        per_expert = 3 * HIDDEN * INTER * {"BF16": 2, "Q8_0": 34 / 32}[fmt]
        n = max(PER_CALL, int(a.pool_mib * 2**20 / per_expert) // PER_CALL * PER_CALL)
        pools[fmt] = (expert_pool(fmt, n, gen), n, n * per_expert)
        if any(v.huge for v in variants.values()):
            mats = tuple(ExpertMatrix(on_huge_pages(m.data), m.format, m.shape) for m in pools[fmt][0])
            pools[fmt, "huge"] = (mats, n, n * per_expert)
    xs = {b: torch.randn(b, HIDDEN, generator=gen).bfloat16().float() for b in a.batches}

    def one_pass(fmt: str, batch: int, huge: bool) -> float:
        (gate, up, down), n, nbytes = pools[(fmt, "huge") if huge else fmt]
        offsets = torch.arange(0, PER_CALL + 1, dtype=torch.int32) * batch
        tokens = torch.arange(batch, dtype=torch.int32).repeat(PER_CALL)
        weights = torch.rand(PER_CALL * batch, generator=gen)
        t0 = time.perf_counter()
        for c in range(n // PER_CALL):
            experts = torch.arange(c * PER_CALL, (c + 1) * PER_CALL, dtype=torch.int32)
            kernel.moe_forward(xs[batch], gate, up, down, experts, offsets, tokens, weights,
                               round_to=torch.bfloat16)
        return nbytes / (time.perf_counter() - t0) / 1e9

    results: dict[tuple, list[float]] = {}
    for r in range(a.rounds):
        t0 = time.perf_counter()
        kernel.read_bytes(probe)
        results.setdefault(("DRAM read probe", "", 0), []).append(probe.numel() / (time.perf_counter() - t0) / 1e9)
        if huge_probe is not None:
            t0 = time.perf_counter()
            kernel.read_bytes(huge_probe)
            results.setdefault(("DRAM read probe, huge pages", "bytes", 0), []).append(
                probe.numel() / (time.perf_counter() - t0) / 1e9)
        for name, v in variants.items():
            kernel.lib.ft_set_q16(v.q16)
            kernel.lib.ft_set_amx(2, v.q8_tiles_from, v.amx_off)
            kernel.lib.ft_set_q16_form(v.two_rows)
            kernel.lib.ft_set_amx_q8(*v.int8_tiles)
            kernel.lib.ft_set_amx_prefetch(v.prefetch)
            kernel.lib.ft_set_amx_dequant_prefetch(v.dequant_prefetch)
            kernel.lib.ft_set_amx_dequant_streams(v.dequant_streams)
            kernel.lib.ft_set_amx_q8_rows(v.rows)
            kernel.lib.ft_set_amx_tile_pairs(v.tile_pairs)
            kernel.lib.ft_set_vector_act(v.vector_act)
            kernel.lib.ft_set_avx2_dots(avx2_default if v.avx2_dots is None else v.avx2_dots)
            kernel.lib.ft_set_dots_prefetch(prefetch_default if v.dots_prefetch is None else v.dots_prefetch)
            kernel.lib.ft_set_q16_rows(rows_default if v.q16_rows is None else v.q16_rows)
            kernel.lib.ft_set_q16_rows_from(rows_from_default if v.q16_rows_from is None else v.q16_rows_from)
            for fmt in a.formats:
                for batch in a.batches:
                    if fmt in v.formats and batch in v.batches:
                        results.setdefault((name, fmt, batch), []).append(one_pass(fmt, batch, v.huge))
        print(f"round {r + 1}/{a.rounds} done", flush=True)
    kernel.lib.ft_set_q16(1)
    kernel.lib.ft_set_amx(2, 6, 0)
    kernel.lib.ft_set_q16_form(1)
    kernel.lib.ft_set_amx_q8(2, 0)
    kernel.lib.ft_set_amx_prefetch(0)
    kernel.lib.ft_set_amx_dequant_prefetch(Variant.dequant_prefetch)
    kernel.lib.ft_set_amx_dequant_streams(Variant.dequant_streams)
    kernel.lib.ft_set_amx_q8_rows(16)
    kernel.lib.ft_set_amx_tile_pairs(1)
    kernel.lib.ft_set_vector_act(1)
    kernel.lib.ft_set_avx2_dots(avx2_default)
    kernel.lib.ft_set_dots_prefetch(prefetch_default)
    kernel.lib.ft_set_q16_rows(rows_default)
    kernel.lib.ft_set_q16_rows_from(rows_from_default)
    probes = results[("DRAM read probe", "", 0)]
    dram = max(probes)
    lines = [f"threads {kernel.threads}, {a.rounds} interleaved rounds, pool {a.pool_mib} MiB, bf16 activations; "
             f"best DRAM read probe {dram:.1f} GB/s (median {statistics.median(probes):.1f})",
             "", "| variant | format | batch | median GB/s | best GB/s | best of best probe |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for (name, fmt, batch), v in results.items():
        if fmt:
            lines.append(f"| {name} | {fmt} | {batch} | {statistics.median(v):.1f} | {max(v):.1f} | "
                         f"{max(v) / dram:.0%} |")
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
