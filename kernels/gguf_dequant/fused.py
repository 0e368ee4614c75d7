"""Fused GPU dequantisation (Triton): block-format bytes on the device → floats, written straight into the rows
of a destination tensor (expert slots), in one launch for several matrices.

Quantized experts cross PCIe in their block format (Q8_0 is 1.06 bytes per weight against bf16's 2). The plain-
torch reference needs several kernels and temporaries per matrix; this is one launch per batch of experts, so the
copy stream stays busy with copies. Results are bit-identical to `reference.dequantize` (fp32 products, one
round-to-nearest-even cast to the destination dtype); tests run it under Triton's interpreter on the CPU.

Shapes: N matrices in the batch, M matrices per expert (gate, up, down), B bytes of one matrix, S destination rows.
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no triton on this platform: `available()` says so and callers use the reference
    triton = None

SUPPORTED = frozenset({"Q8_0"})
_Q8_0_BYTES, _Q8_0_VALUES = 34, 32
_BLOCKS_PER_PROGRAM = 64  # 2048 values per program: enough work per program, many programs per matrix


def available(device: torch.device) -> bool:
    """Whether the fused kernel can run for tensors on `device` (a CUDA device with Triton installed)."""
    return triton is not None and device.type == "cuda"


if triton is not None:

    @triton.jit(do_not_specialize=["fixed_row"])  # a slot number: one compiled kernel for all of them
    def _q8_0_rows(raw_ptr, raw_stride, out0_ptr, out1_ptr, out2_ptr, out_stride, rows_ptr, fixed_row, n_blocks,
                   USE_ROWS: tl.constexpr, TO_BF16: tl.constexpr, BLOCKS: tl.constexpr):
        """Program (chunk, m, i): blocks [chunk*BLOCKS, +BLOCKS) of matrix m of raw row i → row rows[i] of out m."""
        chunk, m, i = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        block = chunk * BLOCKS + tl.arange(0, BLOCKS)
        live = block < n_blocks
        src = raw_ptr + i.to(tl.int64) * raw_stride + m * (n_blocks * 34) + block * 34
        lo = tl.load(src, mask=live, other=0).to(tl.uint16)
        hi = tl.load(src + 1, mask=live, other=0).to(tl.uint16)
        scale = (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)
        lane = tl.arange(0, 32)
        q = tl.load(src[:, None] + 2 + lane[None, :], mask=live[:, None], other=0)
        values = scale[:, None] * q.to(tl.int8, bitcast=True).to(tl.float32)
        if USE_ROWS:
            row = tl.load(rows_ptr + i).to(tl.int64)
        else:
            row = fixed_row.to(tl.int64)
        if m == 0:
            out = out0_ptr
        elif m == 1:
            out = out1_ptr
        else:
            out = out2_ptr
        if TO_BF16:  # round to nearest even by hand: Triton's interpreter (the CPU tests) truncates in `.to`
            bits = values.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            values = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        dest = out + row * out_stride + block[:, None] * 32 + lane[None, :]
        tl.store(dest, values.to(out.dtype.element_ty), mask=live[:, None])


def dequantize_into(raw: torch.Tensor, type_name: str, outs: list[torch.Tensor] | tuple[torch.Tensor, ...],
                    rows: torch.Tensor | int) -> None:
    """outs[m][rows[i]] = dequantize(matrix m of raw[i]) for every i and m, in one launch on the current stream.

    raw: [N, M * B] uint8, each row holding an expert's M matrices back to back (or [M * B] for one expert);
    outs: M contiguous tensors [S, ...] of one float dtype whose rows hold B's values each; rows: an int64 tensor
    [N] on raw's device, or one int when N is 1 (no index tensor to copy to the device).
    """
    if type_name not in SUPPORTED:
        raise ValueError(f"no fused kernel for {type_name!r} (fused: {', '.join(sorted(SUPPORTED))})")
    if triton is None:
        raise RuntimeError("the fused dequantiser needs triton")
    raw2 = raw.view(1, -1) if raw.dim() == 1 else raw
    n, m = raw2.shape[0], len(outs)
    if not 1 <= m <= 3 or raw2.dtype != torch.uint8 or raw2.stride(1) != 1:
        raise ValueError("raw must be [N, M * B] uint8 with contiguous rows, and 1 to 3 outputs")
    per_row = math.prod(outs[0].shape[1:])  # shape arithmetic: this runs per decode step, indexing costs µs
    n_blocks = per_row // _Q8_0_VALUES
    if raw2.shape[1] != m * n_blocks * _Q8_0_BYTES or per_row % _Q8_0_VALUES:
        raise ValueError(f"raw rows of {raw2.shape[1]} bytes do not hold {m} Q8_0 matrices of {per_row} values")
    if any(o.dtype != outs[0].dtype or not o.is_contiguous() or math.prod(o.shape[1:]) != per_row for o in outs):
        raise ValueError("outputs must be contiguous, of one dtype and one row size")
    use_rows = isinstance(rows, torch.Tensor)
    if not use_rows and n != 1:
        raise ValueError("one destination row given for several raw rows")
    padded = (*outs, *(outs[0],) * (3 - m))  # unused pointer arguments: never dereferenced
    grid = (triton.cdiv(n_blocks, _BLOCKS_PER_PROGRAM), m, n)
    _q8_0_rows[grid](raw2, raw2.stride(0), *padded, per_row, rows if use_rows else raw2, 0 if use_rows else rows,
                     n_blocks, USE_ROWS=use_rows, TO_BF16=outs[0].dtype == torch.bfloat16, BLOCKS=_BLOCKS_PER_PROGRAM)
