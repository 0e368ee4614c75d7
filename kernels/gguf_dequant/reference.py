"""Plain-torch dequantisation of ggml tensor formats: the reference the fused GPU kernel is tested against.

Owns the byte layout of each supported ggml block type and `BLOCK_SIZES`, the single table of which types
freetoken can turn into floats. Every decoder is vectorised over blocks (no Python loop over blocks), runs on
whatever device `raw` lives on, computes in fp32 and casts to the requested dtype at the end, so results are
bit-identical to ggml's own fp32 dequantisation.

Shape legend:
    N   blocks in the tensor (n_elements // elements_per_block)
    B   bytes per block (BLOCK_SIZES[type][1])
    S   sub-blocks per 256-value super-block (8 of 32 values in Q4_K/Q5_K, 16 of 16 values in Q6_K)
    H   128-value halves of a Q6_K super-block (2)

Block layouts (little-endian, fp16 scales), as ggml's block structs:
    Q8_0  d, qs[32] int8                         x = d * q
    Q4_0  d, qs[16] nibbles (lo = 0..15, hi = 16..31)      x = d * (q - 8)
    Q4_1  d, m, qs[16] nibbles                     x = d * q + m
    Q4_K  d, dmin, scales[12] (6-bit sc/min pairs), qs[128]   x = d*sc[s] * q - dmin*min[s]
    Q5_K  Q4_K plus qh[32] holding each value's 5th bit (bit s of qh[l] for sub-block s)
    Q6_K  ql[128] low nibbles, qh[64] high 2 bits, scales[16] int8, d      x = d*sc[s] * (q - 32)
    MXFP4 e (E8M0 scale byte), qs[16] nibbles (lo = 0..15, hi = 16..31)   x = 2^(e-128) * KVALUES[q] (doubled
          e2m1: ±{0, 1, 2, 3, 4, 6, 8, 12}; gpt-oss's experts)
    FP8_B32  (freetoken's, not ggml's: block-FP8 checkpoints' experts as they ship) s (fp32), qs[32] e4m3
          x = s * q (s the checkpoint's scale of the 2-D block the 32 values lie in)
"""

from __future__ import annotations

import torch

# type_name -> (elements per block, bytes per block); matches ggml's ggml_type_traits.
BLOCK_SIZES: dict[str, tuple[int, int]] = {
    "F32": (1, 4),
    "F16": (1, 2),
    "BF16": (1, 2),
    "Q8_0": (32, 34),
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
    "MXFP4": (32, 17),
    "FP8_B32": (32, 36),
}

OWN_FORMATS = frozenset({"FP8_B32"})  # in BLOCK_SIZES but not ggml's (never in a GGUF file)

_FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def dequantize(
    raw: torch.Tensor, type_name: str, n_elements: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Decode `raw` (1-D uint8 holding n_elements of `type_name`) into a 1-D tensor of `dtype` on raw's device.

    For float types the result may alias `raw` when no conversion is needed; quantised types always allocate.
    """
    if type_name not in BLOCK_SIZES:
        raise ValueError(f"unsupported ggml type {type_name!r} (supported: {', '.join(BLOCK_SIZES)})")
    per_block, block_bytes = BLOCK_SIZES[type_name]
    if raw.dtype != torch.uint8 or raw.dim() != 1:
        raise ValueError(f"raw must be a 1-D uint8 tensor, got {raw.dtype} with shape {tuple(raw.shape)}")
    if n_elements % per_block:
        raise ValueError(f"{n_elements} elements is not a multiple of the {type_name} block size {per_block}")
    n_blocks = n_elements // per_block
    if raw.numel() != n_blocks * block_bytes:
        raise ValueError(f"{type_name} x {n_elements} needs {n_blocks * block_bytes} bytes, got {raw.numel()}")
    if type_name in _FLOAT_DTYPES:
        return _view_floats(raw, _FLOAT_DTYPES[type_name]).to(dtype)
    blocks = raw.view(n_blocks, block_bytes)
    return _DECODERS[type_name](blocks).reshape(-1).to(dtype)


def _view_floats(raw: torch.Tensor, src: torch.dtype) -> torch.Tensor:
    item = src.itemsize
    # A dtype view needs the byte offset to be a multiple of the item size; a stray offset costs one copy.
    if raw.storage_offset() % item or raw.data_ptr() % item or not raw.is_contiguous():
        raw = raw.clone()
    return raw.view(src)


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 field at byte `at` of every block, as fp32 [N, 1]."""
    return blocks[:, at : at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., L] packed bytes -> [..., 2, L]: low nibbles first, then high nibbles (ggml's order)."""
    return torch.stack((qs & 0x0F, qs >> 4), dim=-2)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return _f16(blocks, 0) * blocks[:, 2:].view(torch.int8).float()


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, 2:]).reshape(-1, 32).float()
    return (q - 8.0) * _f16(blocks, 0)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, 4:]).reshape(-1, 32).float()
    return _f16(blocks, 0) * q + _f16(blocks, 2)


def _k4_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack Q4_K/Q5_K's 12 scale bytes [N, 12] into 6-bit scales and mins, each [N, 8].

    Bytes 0-3 hold scales 0-3 (low 6 bits), bytes 4-7 mins 0-3; sub-blocks 4-7 keep their low 4 bits in
    bytes 8-11 (scale in the low nibble, min in the high one) and their top 2 bits in the spare bits 6-7
    of bytes 0-3 (scales) and 4-7 (mins).
    """
    lo, mid, hi = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat((lo & 0x3F, (hi & 0x0F) | ((lo >> 6) << 4)), dim=1)
    mn = torch.cat((mid & 0x3F, (hi >> 4) | ((mid >> 6) << 4)), dim=1)
    return sc.float(), mn.float()


def _k4_affine(blocks: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Apply Q4_K/Q5_K super-block scaling to q [N, S, 32]; (d*sc) and (dmin*min) are exact in fp32."""
    sc, mn = _k4_scales(blocks[:, 4:16])
    scale = (_f16(blocks, 0) * sc).unsqueeze(-1)
    offset = (_f16(blocks, 2) * mn).unsqueeze(-1)
    return scale * q.float() - offset


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    # qs [N, 4, 32]: each 32-byte group carries sub-block 2j in its low nibbles and 2j+1 in its high ones.
    q = _nibbles(blocks[:, 16:144].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    return _k4_affine(blocks, q)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    low = _nibbles(blocks[:, 48:176].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    shifts = torch.arange(8, dtype=torch.uint8, device=blocks.device).view(1, 8, 1)
    high = (blocks[:, 16:48].unsqueeze(1) >> shifts) & 1  # [N, S, 32]: bit s of qh[l]
    return _k4_affine(blocks, low | (high << 4))


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    # Per half: ql's 64 bytes -> low nibbles give values 0..63, high nibbles 64..127; qh bit pairs 0,2,4,6 give
    # the top two bits of values 0..31, 32..63, 64..95, 96..127.
    low = _nibbles(blocks[:, 0:128].reshape(-1, 2, 64)).reshape(-1, 2, 128)  # [N, H, 128]
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=blocks.device).view(1, 1, 4, 1)
    high = ((blocks[:, 128:192].reshape(-1, 2, 1, 32) >> shifts) & 3).reshape(-1, 2, 128)
    q = (low | (high << 4)).float() - 32.0
    scale = _f16(blocks, 208) * blocks[:, 192:208].view(torch.int8).float()  # [N, S]
    return scale.unsqueeze(-1) * q.reshape(-1, 16, 16)


# MXFP4's 4-bit codes: e2m1 (sign, 2 exponent bits, 1 mantissa bit) doubled, as ggml tabulates them
MXFP4_KVALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def _mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(MXFP4_KVALUES, dtype=torch.float32, device=blocks.device)
    q = table[_nibbles(blocks[:, 1:]).reshape(-1, 32).long()]
    return q * torch.ldexp(torch.ones_like(q[:, :1]), blocks[:, :1].float() - 128)


_DECODERS = {
    "Q8_0": _q8_0,
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
    "MXFP4": _mxfp4,
    "FP8_B32": lambda blocks: blocks[:, 4:].contiguous().view(torch.float8_e4m3fn).float()
    * blocks[:, :4].contiguous().view(torch.float32),
}
