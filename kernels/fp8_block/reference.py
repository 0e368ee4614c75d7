"""Block-wise FP8 (e4m3) weights as the DeepSeek-V3, Qwen3-FP8 and GLM-4.5-FP8 checkpoints store them: a weight
[N, K] in float8_e4m3fn and `weight_scale_inv` [⌈N/bn⌉, ⌈K/bk⌉] in fp32, one scale per bn × bk block (128 × 128
in every released checkpoint); the real weight is the FP8 value times its block's scale. Plain torch: the
reference any fused kernel is checked against, and what the loader uses today.
"""

from __future__ import annotations

import torch


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128),
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """weight [N, K] float8 and scale_inv [⌈N/bn⌉, ⌈K/bk⌉] → the weight in `dtype` (edge blocks may be partial)."""
    n, k = weight.shape
    bn, bk = block
    if scale_inv.shape != (-(-n // bn), -(-k // bk)):
        raise ValueError(f"FP8 scales of shape {tuple(scale_inv.shape)} do not tile a {n}×{k} weight in "
                         f"{bn}×{bk} blocks")
    scales = scale_inv.float().repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    return (weight.float() * scales).to(dtype)


ROW_BLOCK = 32  # values per block of the row-block layout (FP8_B32)


def to_row_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """weight [N, K] float8 with its 2-D block scales → [N, K/32 × 36] uint8: each row as blocks of 32 values,
    each block its fp32 scale then its 32 e4m3 bytes (the `FP8_B32` layout the CPU kernel and the copier read:
    a row is self-contained, like a GGUF block format's). Lossless; needs K and the scale blocks' width in whole
    blocks of 32 (the released checkpoints' 128 is)."""
    n, k = weight.shape
    bn, bk = block
    if k % ROW_BLOCK or bk % ROW_BLOCK:
        raise ValueError(f"a {n}×{k} FP8 weight in {bn}×{bk} scale blocks does not cut into rows of "
                         f"{ROW_BLOCK}-value blocks")
    if scale_inv.shape != (-(-n // bn), -(-k // bk)):
        raise ValueError(f"FP8 scales of shape {tuple(scale_inv.shape)} do not tile a {n}×{k} weight in "
                         f"{bn}×{bk} blocks")
    groups = k // ROW_BLOCK
    scales = scale_inv.float().repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk // ROW_BLOCK, dim=1)[:, :groups]
    values = weight.contiguous().view(torch.uint8).view(n, groups, ROW_BLOCK)
    return torch.cat((scales.contiguous().view(torch.uint8).view(n, groups, 4), values), dim=-1).view(n, -1)


def quantize_fp8_blocks(weight: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse, for tests and synthetic checkpoints: each block scaled so its largest magnitude maps to
    e4m3's largest finite value (448)."""
    n, k = weight.shape
    bn, bk = block
    w = weight.float()
    rows, cols = -(-n // bn), -(-k // bk)
    padded = torch.zeros(rows * bn, cols * bk)
    padded[:n, :k] = w
    amax = padded.view(rows, bn, cols, bk).abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale_inv = amax / 448.0
    scales = scale_inv.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    return (w / scales).to(torch.float8_e4m3fn), scale_inv
