"""Fused GPU dequantisation (Triton): block-format bytes on the device → floats, written straight into the rows
of a destination tensor (expert slots), in one launch for several matrices.

Quantized experts cross PCIe in their block format (Q8_0 is 1.06 bytes per weight, MXFP4 0.53, FP8_B32 1.13,
against bf16's 2). The plain-torch reference needs several kernels and temporaries per matrix; this is one launch
per batch of experts, so the copy stream stays busy with copies. Results are bit-identical to
`reference.dequantize` (fp32 products, one round-to-nearest-even cast to the destination dtype); tests run it
under Triton's interpreter on the CPU.

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

_BLOCKS_PER_PROGRAM = 64  # 2048 values per program: enough work per program, many programs per matrix


def available(device: torch.device) -> bool:
    """Whether the fused kernel can run for tensors on `device` (a CUDA device with Triton installed)."""
    return triton is not None and device.type == "cuda"


if triton is not None:

    @triton.jit
    def _out_row(out0_ptr, out1_ptr, out2_ptr, out_stride, rows_ptr, fixed_row, m, i, USE_ROWS: tl.constexpr):
        """Where matrix m of raw row i lands: the start of row rows[i] (or fixed_row) of output m."""
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
        return out + row * out_stride

    @triton.jit
    def _raw_row(raw_ptr, raw_stride, src_ptr, i, USE_SRC: tl.constexpr):
        """Where raw row i starts: row src[i] of raw (rows gathered from a store), else row i."""
        if USE_SRC:
            row = tl.load(src_ptr + i).to(tl.int64)
        else:
            row = i.to(tl.int64)
        return raw_ptr + row * raw_stride

    @triton.jit
    def _cast(values, TO_BF16: tl.constexpr):
        """fp32 → the destination's dtype. bf16 rounds to nearest even by hand: Triton's interpreter (the CPU
        tests) truncates in `.to`. A NaN stays NaN: the GPU's own NaN (0x7FFFFFFF) would round over into -0."""
        if TO_BF16:
            bits = values.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            bits = tl.where(values != values, 0x7FC0, bits)
            values = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return values

    @triton.jit(do_not_specialize=["fixed_row"])  # a slot number: one compiled kernel for all of them
    def _q8_0_rows(raw_ptr, raw_stride, out0_ptr, out1_ptr, out2_ptr, out_stride, rows_ptr, fixed_row, src_ptr,
                   n_blocks, USE_ROWS: tl.constexpr, USE_SRC: tl.constexpr, TO_BF16: tl.constexpr,
                   BLOCKS: tl.constexpr):
        """Program (chunk, m, i): blocks [chunk*BLOCKS, +BLOCKS) of matrix m of raw row i → row rows[i] of out m.
        A block: fp16 d, 32 int8 q; x = d * q."""
        chunk, m, i = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        block = chunk * BLOCKS + tl.arange(0, BLOCKS)
        live = block < n_blocks
        src = _raw_row(raw_ptr, raw_stride, src_ptr, i, USE_SRC) + m * (n_blocks * 34) + block * 34
        lo = tl.load(src, mask=live, other=0).to(tl.uint16)
        hi = tl.load(src + 1, mask=live, other=0).to(tl.uint16)
        scale = (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)
        lane = tl.arange(0, 32)
        q = tl.load(src[:, None] + 2 + lane[None, :], mask=live[:, None], other=0)
        values = _cast(scale[:, None] * q.to(tl.int8, bitcast=True).to(tl.float32), TO_BF16)
        out = _out_row(out0_ptr, out1_ptr, out2_ptr, out_stride, rows_ptr, fixed_row, m, i, USE_ROWS)
        tl.store(out + block[:, None] * 32 + lane[None, :], values.to(out.dtype.element_ty), mask=live[:, None])

    @triton.jit(do_not_specialize=["fixed_row"])
    def _mxfp4_rows(raw_ptr, raw_stride, out0_ptr, out1_ptr, out2_ptr, out_stride, rows_ptr, fixed_row, src_ptr,
                    n_blocks, USE_ROWS: tl.constexpr, USE_SRC: tl.constexpr, TO_BF16: tl.constexpr,
                    BLOCKS: tl.constexpr):
        """As `_q8_0_rows` for ggml's MXFP4: an E8M0 byte e, 16 bytes of 4-bit codes (value j in the low nibble of
        byte j, value j + 16 in its high nibble); x = 2^(e-128) * KVALUES[code], KVALUES = ±{0,1,2,3,4,6,8,12}
        (e2m1 doubled): computed, not looked up, and exact."""
        chunk, m, i = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        block = chunk * BLOCKS + tl.arange(0, BLOCKS)
        live = block < n_blocks
        src = _raw_row(raw_ptr, raw_stride, src_ptr, i, USE_SRC) + m * (n_blocks * 17) + block * 17
        e = tl.load(src, mask=live, other=0).to(tl.int32)
        # 2^(e-128) as fp32 bits: a normal number from e = 2 on, below that the subnormals 2^-127 and 2^-128
        scale = tl.where(e >= 2, (e - 1) << 23, 0x00200000 << e).to(tl.float32, bitcast=True)
        lane = tl.arange(0, 16)
        qs = tl.load(src[:, None] + 1 + lane[None, :], mask=live[:, None], other=0).to(tl.int32)
        out = _out_row(out0_ptr, out1_ptr, out2_ptr, out_stride, rows_ptr, fixed_row, m, i, USE_ROWS)
        for half in tl.static_range(2):
            code = (qs >> (4 * half)) & 0xF
            magnitude = code & 7  # 0, 1, 2, 3, then 4, 6, 8, 12 = (2 or 3) << 1 or 2
            value = tl.where(magnitude < 4, magnitude, (2 + (magnitude & 1)) << ((magnitude >> 1) - 1))
            value = tl.where(code >= 8, -value, value)  # integer negation: code 8 is +0, as in ggml's table
            values = _cast(scale[:, None] * value.to(tl.float32), TO_BF16)
            dest = out + block[:, None] * 32 + 16 * half + lane[None, :]
            tl.store(dest, values.to(out.dtype.element_ty), mask=live[:, None])

    @triton.jit(do_not_specialize=["fixed_row"])
    def _fp8_b32_rows(raw_ptr, raw_stride, out0_ptr, out1_ptr, out2_ptr, out_stride, rows_ptr, fixed_row, src_ptr,
                      n_blocks, USE_ROWS: tl.constexpr, USE_SRC: tl.constexpr, TO_BF16: tl.constexpr,
                    BLOCKS: tl.constexpr):
        """As `_q8_0_rows` for FP8_B32: an fp32 scale s, 32 e4m3 bytes; x = s * q. e4m3 (bias 7, no infinities,
        0x7F and 0xFF NaN) is decoded by hand, exactly: Triton's interpreter has no fp8."""
        chunk, m, i = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        block = chunk * BLOCKS + tl.arange(0, BLOCKS)
        live = block < n_blocks
        src = _raw_row(raw_ptr, raw_stride, src_ptr, i, USE_SRC) + m * (n_blocks * 36) + block * 36
        byte = tl.arange(0, 4)
        s = tl.load(src[:, None] + byte[None, :], mask=live[:, None], other=0).to(tl.uint32)
        scale = tl.sum(s << (8 * byte[None, :]).to(tl.uint32), axis=1).to(tl.float32, bitcast=True)
        lane = tl.arange(0, 32)
        q = tl.load(src[:, None] + 4 + lane[None, :], mask=live[:, None], other=0).to(tl.int32)
        exponent, mantissa = (q >> 3) & 0xF, q & 7
        # 2^-9 for the subnormals (exponent 0), else 2^(exponent - 10), as fp32 bits
        power = tl.where(exponent == 0, 118 << 23, (exponent + 117) << 23).to(tl.float32, bitcast=True)
        value = tl.where(exponent == 0, mantissa, 8 + mantissa).to(tl.float32) * power
        value = tl.where((q & 0x80) != 0, -value, value)
        value = tl.where((q & 0x7F) == 0x7F, float("nan"), value)
        values = _cast(scale[:, None] * value, TO_BF16)
        out = _out_row(out0_ptr, out1_ptr, out2_ptr, out_stride, rows_ptr, fixed_row, m, i, USE_ROWS)
        tl.store(out + block[:, None] * 32 + lane[None, :], values.to(out.dtype.element_ty), mask=live[:, None])

    _KERNELS = {"Q8_0": (_q8_0_rows, 34), "MXFP4": (_mxfp4_rows, 17), "FP8_B32": (_fp8_b32_rows, 36)}

SUPPORTED = frozenset({"Q8_0", "MXFP4", "FP8_B32"})
_VALUES = 32  # per block, in every supported format


def dequantize_into(raw: torch.Tensor, type_name: str, outs: list[torch.Tensor] | tuple[torch.Tensor, ...],
                    rows: torch.Tensor | int, sources: torch.Tensor | None = None) -> None:
    """outs[m][rows[i]] = dequantize(matrix m of raw[i]) for every i and m, in one launch on the current stream.

    raw: [N, M * B] uint8, each row holding an expert's M matrices back to back (or [M * B] for one expert);
    outs: M contiguous tensors [S, ...] of one float dtype whose rows hold B's values each; rows: an int64 tensor
    [N] on raw's device, or one int when N is 1 (no index tensor to copy to the device). `sources`: an int64
    tensor [n] on raw's device: then the launch converts n rows, row i from raw[sources[i]] (experts kept in
    their block format on the device, any of raw's rows), and `rows` must be a tensor of n too.
    """
    if type_name not in SUPPORTED:
        raise ValueError(f"no fused kernel for {type_name!r} (fused: {', '.join(sorted(SUPPORTED))})")
    if triton is None:
        raise RuntimeError("the fused dequantiser needs triton")
    raw2 = raw.view(1, -1) if raw.dim() == 1 else raw
    n, m = raw2.shape[0], len(outs)
    if not 1 <= m <= 3 or raw2.dtype != torch.uint8 or raw2.stride(1) != 1:
        raise ValueError("raw must be [N, M * B] uint8 with contiguous rows, and 1 to 3 outputs")
    kernel, block_bytes = _KERNELS[type_name]
    per_row = math.prod(outs[0].shape[1:])  # shape arithmetic: this runs per decode step, indexing costs µs
    n_blocks = per_row // _VALUES
    if raw2.shape[1] != m * n_blocks * block_bytes or per_row % _VALUES:
        raise ValueError(f"raw rows of {raw2.shape[1]} bytes do not hold {m} {type_name} matrices of {per_row} "
                         "values")
    if any(o.dtype != outs[0].dtype or not o.is_contiguous() or math.prod(o.shape[1:]) != per_row for o in outs):
        raise ValueError("outputs must be contiguous, of one dtype and one row size")
    use_rows = isinstance(rows, torch.Tensor)
    if sources is not None:
        if not use_rows or rows.shape != sources.shape:
            raise ValueError("sources need a destination row tensor of the same length")
        n = sources.shape[0]
    elif not use_rows and n != 1:
        raise ValueError("one destination row given for several raw rows")
    padded = (*outs, *(outs[0],) * (3 - m))  # unused pointer arguments: never dereferenced
    grid = (triton.cdiv(n_blocks, _BLOCKS_PER_PROGRAM), m, n)
    kernel[grid](raw2, raw2.stride(0), *padded, per_row, rows if use_rows else raw2, 0 if use_rows else rows,
                 raw2 if sources is None else sources, n_blocks, USE_ROWS=use_rows, USE_SRC=sources is not None,
                 TO_BF16=outs[0].dtype == torch.bfloat16, BLOCKS=_BLOCKS_PER_PROGRAM)
