"""Micro-benchmark: weight GB/s of the CPU expert kernel against the DRAM read bandwidth measured in the same run.

    python -m freetoken.kernels.cpu_experts.bench [--formats BF16 Q8_0] [--batches 1 2 4 8] [--json PATH]

Experts have Qwen3-30B-A3B's shape (H 2048, I 768); each call runs one layer's worth (8 experts, every token
routed to each), cycling through a pool of experts several times the last-level cache, so weights come from DRAM
as in decode. "kernel" calls it as the engine does (`launch`: buffers made once, x passed in bf16); "kernel-fresh"
(`--fresh-calls`) through `moe_forward`, which makes them per call. The ceiling is `ft_read_bytes` over a 1 GiB
buffer on the same threads. The plain-torch reference (bf16 F.linear, what the engine used before) is timed
beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from freetoken.engine.experts import expert_mlp
from freetoken.kernels.cpu_experts import reference
from freetoken.kernels.cpu_experts.kernel import CpuExpertKernel
from freetoken.kernels.cpu_experts.reference import ExpertMatrix

HIDDEN, INTER, PER_CALL = 2048, 768, 8


def random_q8_0(experts: int, out: int, inp: int, std: float, gen: torch.Generator) -> torch.Tensor:
    """[E, bytes] of Q8_0 blocks: random int8 and an fp16 scale per 32 weights, so each row has the given std."""
    blocks = torch.randint(-128, 128, (experts, out * inp // 32, 34), dtype=torch.int16, generator=gen)
    raw = blocks.to(torch.int8).view(torch.uint8)
    scales = (torch.rand(experts, out * inp // 32, generator=gen) * std / 37 + std / 148).to(torch.float16)
    raw[:, :, :2] = scales.view(torch.uint8).view(experts, -1, 2)
    return raw.reshape(experts, -1).contiguous()


def random_mxfp4(experts: int, out: int, inp: int, gen: torch.Generator) -> torch.Tensor:
    """[E, bytes] of ggml MXFP4 blocks: random codes, scale 2^-8 (std ≈ 0.023, like the other formats' 0.02)."""
    blocks = torch.randint(0, 256, (experts, out * inp // 32, 17), dtype=torch.uint8, generator=gen)
    blocks[:, :, 0] = 120
    return blocks.reshape(experts, -1)


def expert_pool(fmt: str, experts: int, gen: torch.Generator,
                pin: bool = False) -> tuple[ExpertMatrix, ExpertMatrix, ExpertMatrix]:
    """`pin`: in page-locked memory, as the engine's host store keeps them (needs CUDA)."""
    shapes = ((INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER))
    if fmt == "Q8_0":
        mats = [ExpertMatrix(random_q8_0(experts, o, i, 0.02, gen), "Q8_0", (o, i)) for o, i in shapes]
    elif fmt == "MXFP4":
        mats = [ExpertMatrix(random_mxfp4(experts, o, i, gen), "MXFP4", (o, i)) for o, i in shapes]
    else:
        dtype = {"BF16": torch.bfloat16, "F32": torch.float32}[fmt]
        mats = [ExpertMatrix.of((torch.randn(experts, o, i, generator=gen) * 0.02).to(dtype)) for o, i in shapes]
    return tuple(ExpertMatrix(m.data.pin_memory(), m.format, m.shape) if pin else m for m in mats)


def kernel_and_pool(fmt: str, experts: int, pool_mib: int) -> tuple[CpuExpertKernel, tuple, int]:
    """The kernel (or exit with why not), and a pool of `fmt` experts filling `pool_mib` MiB (at least `experts`):
    what the decode-sized micro-benchmarks cycle through so that weights come from DRAM. Returns (kernel, the
    pool's matrices, its size in experts)."""
    kernel = CpuExpertKernel.get()
    if kernel is None:
        raise SystemExit("the CPU expert kernel could not be built here (no C compiler?)")
    per_expert = 3 * HIDDEN * INTER * (2 if fmt == "BF16" else 34 / 32)
    pool = max(experts, int(pool_mib * 2**20 / per_expert))
    return kernel, expert_pool(fmt, pool, torch.Generator().manual_seed(0)), pool


def decode_launcher(kernel: CpuExpertKernel, mats, experts: int):
    """`launch(ids)`: starts one decode-sized call (one token, `experts` experts of `mats`) from buffers made
    once, as the engine's decode calls the kernel, and returns the pending call."""
    gate, up, down = mats
    x = torch.randn(1, HIDDEN).bfloat16().float()
    bf16 = kernel.wants_bf16_activations(gate, up, down, torch.bfloat16)
    xb = x.bfloat16() if bf16 else None
    offsets = torch.arange(experts + 1, dtype=torch.int32)
    tokens = torch.zeros(experts, dtype=torch.int32)
    weights = torch.full((experts,), 1 / experts)
    act, y = torch.empty(experts, INTER), torch.empty(1, HIDDEN)
    actb = torch.empty(experts, INTER, dtype=torch.bfloat16) if bf16 else None
    constants = kernel.launch_constants(gate, up, down)

    def launch(ids: torch.Tensor):
        return kernel.launch(x, gate, up, down, ids, experts, offsets, tokens, weights, act, y, torch.bfloat16, xb,
                             actb, None, constants)
    return launch


def _median(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def dram_read_gb_s(kernel: CpuExpertKernel, nbytes: int = 1 << 30) -> float:
    buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    return nbytes / _median(lambda: kernel.read_bytes(buf), 7) / 1e9


def expert_gb_s(kernel, fmt: str, batch: int, pool_experts: int, impl: str, gen: torch.Generator,
                pin: bool = False, fp32_activations: bool = False) -> float:
    gate, up, down = expert_pool(fmt, pool_experts, gen, pin)
    # as in a bf16 model: bf16 activations and bf16 rounding points (AVX-512-BF16 dot products where available)
    x = torch.randn(batch, HIDDEN, generator=gen).bfloat16().float()
    round_to = torch.float32 if fp32_activations else torch.bfloat16
    offsets = torch.arange(0, PER_CALL + 1, dtype=torch.int32) * batch
    tokens = torch.arange(batch, dtype=torch.int32).repeat(PER_CALL)
    weights = torch.rand(PER_CALL * batch, generator=gen)
    calls = pool_experts // PER_CALL
    forward = kernel.moe_forward if impl == "kernel-fresh" else reference.moe_forward
    if impl == "torch-bf16":  # the engine's old CPU path: bf16 F.linear per expert
        x = x.to(torch.bfloat16)
    # "kernel": as the engine calls it (decode's and the prefill share's `launch`): buffers made once, x in bf16
    bf16 = kernel.wants_bf16_activations(gate, up, down, round_to)
    xb = x.bfloat16() if bf16 else None
    act, y = torch.empty(PER_CALL * batch, INTER), torch.empty(batch, HIDDEN)
    actb = torch.empty(PER_CALL * batch, INTER, dtype=torch.bfloat16) if bf16 else None
    constants = kernel.launch_constants(gate, up, down)
    ids = [torch.arange(c * PER_CALL, (c + 1) * PER_CALL, dtype=torch.int32) for c in range(calls)]

    def run():
        for experts in ids:
            if impl == "kernel":
                kernel.launch(x, gate, up, down, experts, PER_CALL, offsets, tokens, weights, act, y, round_to, xb,
                              actb, None, constants).wait()
            elif impl == "torch-bf16":
                for e in experts.tolist():
                    expert_mlp(x, *(m.data[e] for m in (gate, up, down)))
            else:
                forward(x, gate, up, down, experts, offsets, tokens, weights, round_to=round_to)

    seconds = _median(run, 5)
    nbytes = sum(m.data[0].numel() * m.data.element_size() for m in (gate, up, down)) * calls * PER_CALL
    return nbytes / seconds / 1e9


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--formats", nargs="+", default=["BF16", "Q8_0"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 2, 4, 8])
    p.add_argument("--pool-mib", type=int, default=1024, help="expert bytes cycled through (≫ last-level cache)")
    p.add_argument("--torch-baseline", action="store_true", help="also time torch bf16 F.linear (slow)")
    p.add_argument("--fresh-calls", action="store_true",
                   help="also time `moe_forward` (buffers and the bf16 copy of x made per call)")
    p.add_argument("--pinned", action="store_true", help="experts in page-locked memory, as the engine keeps them")
    p.add_argument("--fp32-activations", action="store_true",
                   help="fp32 activations and rounding (an fp32 model): no bf16 dot products")
    p.add_argument("--json", help="write the rows here too")
    a = p.parse_args(argv)
    kernel = CpuExpertKernel.get()
    if kernel is None:
        raise SystemExit("the CPU expert kernel could not be built here (no C compiler?)")
    gen = torch.Generator().manual_seed(0)
    dram = dram_read_gb_s(kernel)
    print(f"threads {kernel.threads}   DRAM read {dram:.1f} GB/s   bf16 dot products: {kernel.bf16_dot}")
    rows = []
    print(f"{'format':<7}{'batch':>6}{'impl':>13}{'GB/s':>9}{'of DRAM':>9}")
    for fmt in a.formats:
        per_expert = 3 * HIDDEN * INTER * {"BF16": 2, "F32": 4, "Q8_0": 34 / 32, "MXFP4": 17 / 32}[fmt]
        pool = max(PER_CALL, int(a.pool_mib * 2**20 / per_expert) // PER_CALL * PER_CALL)
        impls = ["kernel", *(["kernel-fresh"] if a.fresh_calls else []),
                 *(["torch-bf16"] if a.torch_baseline and fmt == "BF16" else [])]
        for batch in a.batches:
            for impl in impls:
                gb_s = expert_gb_s(kernel, fmt, batch, pool, impl, gen, a.pinned, a.fp32_activations)
                rows.append(dict(format=fmt, batch=batch, impl=impl, gb_s=gb_s, dram_gb_s=dram))
                print(f"{fmt:<7}{batch:>6}{impl:>13}{gb_s:>9.1f}{gb_s / dram:>9.0%}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(threads=kernel.threads, dram_read_gb_s=dram, rows=rows), f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
