"""The fused Triton dequantiser against the plain-torch reference, bit for bit.

Without a GPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1 must be set before the kernel is
defined, so that check runs in a fresh interpreter); with one it also runs compiled.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

pytest.importorskip("triton")

from freetoken.kernels.gguf_dequant import fused  # noqa: E402
from support.decode_checks import run_fresh  # noqa: E402

# Checks every output dtype, a block count that is not a multiple of the program's blocks, a row table that
# skips and reorders destination rows, rows left untouched, and the single-row form.
CHECK = textwrap.dedent("""
    import sys
    import torch
    from freetoken.kernels.gguf_dequant import fused
    from freetoken.kernels.gguf_dequant.reference import dequantize

    device = sys.argv[1]
    gen = torch.Generator().manual_seed(0)

    def random_matrix(n_blocks):
        blocks = torch.randint(0, 256, (n_blocks, 34), dtype=torch.uint8, generator=gen)
        scales = (torch.randn(n_blocks, generator=gen) * 0.01).half()
        scales[0] = 65504.0  # the largest fp16: products round near the top of bf16's range
        blocks[:, :2] = scales.view(torch.uint8).view(n_blocks, 2)
        return blocks.reshape(-1)

    shape, n_blocks = (8, 200), 50  # 50 blocks: one full program of 64 would overrun, so masking matters
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        experts = [torch.cat([random_matrix(n_blocks) for _ in range(3)]) for _ in range(3)]
        raw = torch.stack(experts).to(device)
        outs = [torch.full((6, *shape), 7.0, dtype=dtype, device=device) for _ in range(3)]
        fused.dequantize_into(raw, "Q8_0", outs, torch.tensor([4, 0, 2], device=device))
        fused.dequantize_into(raw[1], "Q8_0", outs, 5)
        for row, expert in ((4, 0), (0, 1), (2, 2), (5, 1)):
            for m in range(3):
                part = experts[expert][m * n_blocks * 34:(m + 1) * n_blocks * 34]
                want = dequantize(part, "Q8_0", 1600, dtype).view(shape)
                assert torch.equal(outs[m][row].cpu(), want), (dtype, row, m)
        assert all(bool((o[1] == 7).all() and (o[3] == 7).all()) for o in outs), "rows outside the table changed"
        # rows gathered from a store: raw rows 2 and 0 (in that order) into destination rows 1 and 3
        gathered = [torch.full((6, *shape), 7.0, dtype=dtype, device=device) for _ in range(3)]
        fused.dequantize_into(raw, "Q8_0", gathered, torch.tensor([1, 3], device=device),
                              sources=torch.tensor([2, 0], device=device))
        for m in range(3):
            assert torch.equal(gathered[m][1], outs[m][2]) and torch.equal(gathered[m][3], outs[m][4]), (dtype, m)
            assert bool((gathered[m][0] == 7).all() and (gathered[m][2] == 7).all()), "rows outside the table"
        two = [torch.zeros((1, *shape), dtype=dtype, device=device) for _ in range(2)]
        fused.dequantize_into(raw[2][: 2 * n_blocks * 34], "Q8_0", two, 0)  # fewer matrices per expert
        assert torch.equal(two[1][0], outs[1][2])

    def random_mxfp4(n_blocks):  # every code; scales across the range, the two subnormal ones included
        blocks = torch.randint(0, 256, (n_blocks, 17), dtype=torch.uint8, generator=gen)
        blocks[:, 0] = torch.randint(100, 140, (n_blocks,), dtype=torch.uint8, generator=gen)
        blocks[:3, 0] = torch.tensor([0, 1, 2], dtype=torch.uint8)
        return blocks.reshape(-1)

    def random_fp8_b32(n_blocks):  # every e4m3 byte (NaNs and subnormals included), random fp32 scales
        blocks = torch.randint(0, 256, (n_blocks, 36), dtype=torch.uint8, generator=gen)
        blocks[:8, 4:] = torch.arange(256, dtype=torch.uint8).view(8, 32)
        scales = torch.randn(n_blocks, generator=gen) * 0.01
        blocks[:, :4] = scales.view(torch.uint8).view(n_blocks, 4)
        return blocks.reshape(-1)

    def same(a, b):  # NaN where the reference has NaN, equal elsewhere
        return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())

    for type_name, make, block_bytes in (("MXFP4", random_mxfp4, 17), ("FP8_B32", random_fp8_b32, 36)):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            experts = [torch.cat([make(n_blocks) for _ in range(3)]) for _ in range(2)]
            raw = torch.stack(experts).to(device)
            outs = [torch.full((4, *shape), 7.0, dtype=dtype, device=device) for _ in range(3)]
            fused.dequantize_into(raw, type_name, outs, torch.tensor([3, 0], device=device))
            picked = [torch.full((4, *shape), 7.0, dtype=dtype, device=device) for _ in range(3)]
            fused.dequantize_into(raw, type_name, picked, torch.tensor([2], device=device),
                                  sources=torch.tensor([1], device=device))
            assert all(same(picked[m][2], outs[m][0]) for m in range(3)), (type_name, dtype)
            for row, expert in ((3, 0), (0, 1)):
                for m in range(3):
                    part = experts[expert][m * n_blocks * block_bytes:(m + 1) * n_blocks * block_bytes]
                    want = dequantize(part, type_name, 1600, dtype).view(shape)
                    assert same(outs[m][row].cpu(), want), (type_name, dtype, row, m)
            assert all(bool((o[1] == 7).all()) for o in outs), "rows outside the table changed"
    print("ok")
""")


def test_interpreted_kernel_matches_the_reference_bit_for_bit():
    run_fresh(CHECK, "cpu", interpret=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_compiled_kernel_matches_the_reference_bit_for_bit():
    run_fresh(CHECK, "cuda", interpret=False)


def test_rejects_what_it_cannot_decode():
    outs = [torch.zeros(2, 64)]
    with pytest.raises(ValueError, match="no fused kernel for 'Q4_K'"):  # (K-quants: GGUF dense weights only)
        fused.dequantize_into(torch.zeros(68, dtype=torch.uint8), "Q4_K", outs, 0)
    with pytest.raises(ValueError, match="do not hold 1 Q8_0 matrices of 64 values"):
        fused.dequantize_into(torch.zeros(60, dtype=torch.uint8), "Q8_0", outs, 0)
    with pytest.raises(ValueError, match="one destination row given for several raw rows"):
        fused.dequantize_into(torch.zeros(2, 68, dtype=torch.uint8), "Q8_0", outs, 0)
    with pytest.raises(ValueError, match="sources need a destination row tensor of the same length"):
        fused.dequantize_into(torch.zeros(2, 68, dtype=torch.uint8), "Q8_0", outs, torch.zeros(2, dtype=torch.long),
                              sources=torch.zeros(1, dtype=torch.long))
    assert not fused.available(torch.device("cpu"))
