"""Micro-benchmark: GB/s of output written when dequantising ~64 MiB of each ggml type.

    python -m freetoken.kernels.gguf_dequant.bench [--device cuda] [--dtype bfloat16] [--mib 64]

The ceiling printed beside each figure is a plain device copy into a preallocated buffer of the output size, the
most any memory-bound dequantiser can hope for; the fused kernel should approach it, the reference will not.
"""

from __future__ import annotations

import argparse
import time

import torch

from freetoken.kernels.gguf_dequant.reference import BLOCK_SIZES, dequantize

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seconds(fn, device: torch.device, iters: int) -> float:
    fn()  # warm-up: allocator, lazy init, kernel compilation
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / iters


def _random_raw(type_name: str, n_elements: int, device: torch.device) -> torch.Tensor:
    per_block, block_bytes = BLOCK_SIZES[type_name]
    n_blocks = n_elements // per_block
    blocks = torch.randint(0, 256, (n_blocks, block_bytes), dtype=torch.uint8, device=device)
    if per_block > 1:  # keep the fp16 scales finite so the timing is of ordinary numbers
        at = 208 if type_name == "Q6_K" else 0
        scales = torch.rand(n_blocks, 1, device=device, dtype=torch.float16)
        blocks[:, at : at + 2] = scales.view(torch.uint8)
    return blocks.view(-1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="torch device to run on, e.g. cpu or cuda")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="output dtype")
    parser.add_argument("--mib", type=int, default=64, help="MiB of output per type (in the output dtype)")
    parser.add_argument("--iters", type=int, default=0, help="timed repetitions (default: 3 on cpu, 20 on gpu)")
    args = parser.parse_args(argv)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    iters = args.iters or (3 if device.type == "cpu" else 20)
    n_elements = (args.mib << 20) // dtype.itemsize // 256 * 256
    out_bytes = n_elements * dtype.itemsize

    src = torch.ones(n_elements, dtype=dtype, device=device)
    dst = torch.empty_like(src)
    ceiling = out_bytes / _seconds(lambda: dst.copy_(src), device, iters) / 1e9
    print(f"device={device} dtype={args.dtype} output={out_bytes >> 20} MiB; copy ceiling {ceiling:.1f} GB/s")
    print(f"{'type':<6} {'in MiB':>8} {'ms':>9} {'out GB/s':>9} {'of ceiling':>10}")
    for type_name in BLOCK_SIZES:
        raw = _random_raw(type_name, n_elements, device)
        if dequantize(raw, type_name, n_elements, dtype).data_ptr() == raw.data_ptr():
            print(f"{type_name:<6} {raw.numel() / 2**20:>8.1f}   a view of the input, nothing to do")
            continue
        sec = _seconds(lambda: dequantize(raw, type_name, n_elements, dtype), device, iters)  # noqa: B023
        gbs = out_bytes / sec / 1e9
        in_mib = raw.numel() / 2**20
        print(f"{type_name:<6} {in_mib:>8.1f} {sec * 1e3:>9.2f} {gbs:>9.1f} {gbs / ceiling:>9.0%}")


if __name__ == "__main__":
    main()
