"""MXFP4 (OCP microscaling): blocks of 32 FP4 values (e2m1: sign, 2 exponent bits, 1 mantissa bit, so ±{0, 0.5,
1, 1.5, 2, 3, 4, 6}) sharing one power-of-two scale stored as an E8M0 byte (2^(byte − 127)). gpt-oss checkpoints
keep `*_blocks` [..., G, 16] (two values a byte, the low nibble first) and `*_scales` [..., G] (one byte a
block of 32). Plain torch: the reference any fused kernel is checked against.
"""

from __future__ import annotations

import torch

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # values sharing a scale


def to_gguf_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """gpt-oss's layout (blocks [..., G, 16], values 2j and 2j+1 in byte j; scales [..., G]) → ggml's MXFP4 blocks
    [..., G, 17]: the scale byte (the same exponent: ggml doubles the codes and halves the scale), then value j
    in the low and value j + 16 in the high nibble of byte j. Lossless."""
    b = blocks.to(torch.uint8)
    values = torch.stack((b & 0x0F, b >> 4), dim=-1).flatten(-2)  # [..., G, 32] codes in order
    packed = values[..., :16] | (values[..., 16:] << 4)
    return torch.cat((scales.to(torch.uint8)[..., None], packed), dim=-1)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] → values [..., G × 32] in `dtype`."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match "
                         f"(blocks [..., G, {BLOCK // 2}] with scales [..., G])")
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    b = blocks.to(torch.int64)
    values = torch.stack((table[b & 0x0F], table[b >> 4]), dim=-1).flatten(-2)  # [..., G, 32], low nibble first
    exponent = scales.to(torch.int32) - 127
    out = torch.ldexp(values, exponent[..., None].to(torch.float32))
    return out.flatten(-2).to(dtype)
