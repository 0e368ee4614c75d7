"""Paged split-KV decode attention (Triton): one token's query heads over a window of key slots, the K/V rows
read in place from the pools through the slot table, the window split across programs (flash-decoding). A batch
of B such tokens (a continuous-batching decode step, each row its own slot table and position) is one launch.

SDPA on a decode step gets one program per KV head (4 for Qwen3-30B-A3B: 4 of 132 SMs) and needs the keys
gathered into a contiguous tensor first; here each (KV head, split) program streams its share of the window
straight from the pools with an online softmax, and a second launch merges the splits. The valid length comes
from a device tensor and each split's share of it is computed in the kernel, so a captured CUDA graph replays it
for any position inside its window, its programs busy at any length (a short sequence's spare splits exit at
once): one graph can serve every length up to the cache's capacity. Checked against
`reference.py`; tests run it under Triton's interpreter on the CPU.

Shapes: B rows, H query heads, Hkv KV heads, G = H / Hkv, D head dim, W window, P splits.

Tried and dropped (one bf16 token of Qwen3-30B-A3B, H100, evals/results/decode-attention-h200.md): the next block's
slot ids loaded during this block (1.00x at 4k and 32k keys), and bf16 operands for both dots with the
probabilities rounded to bf16 (1.03-1.04x, twice the error against the reference): at batch 1 the loop waits on
neither the dependent slot load nor the widening to fp32.
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no triton on this platform: `available()` says so
    triton = None

BLOCK_N = 64  # keys per inner step
MIN_G = 16  # tl.dot wants at least 16 rows: a KV head's G query rows are padded up to this
MERGE_SPLITS = 32  # splits the merge loads at once (a [32, D] fp32 tile)


def available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


def supports(heads: int, kv_heads: int, head_dim: int) -> bool:
    """Grouped-query layouts with a power-of-two head dim of at least 16 (one tile row per head dim)."""
    return heads % kv_heads == 0 and head_dim >= 16 and head_dim & (head_dim - 1) == 0


def splits_for(window: int, kv_heads: int, programs: int, block_n: int = BLOCK_N) -> int:
    """Splits per KV head: about `programs` programs in all, none of them with less than `block_n` keys of a full
    window (the kernel divides a row's valid keys among them)."""
    return max(1, min(math.ceil(window / block_n), programs // max(kv_heads, 1)))


def split_keys(valid: int, splits: int, block_n: int = BLOCK_N) -> int:
    """Keys per split for a row of `valid` keys: whole blocks of `block_n`, as the kernel computes it."""
    return math.ceil(math.ceil(valid / block_n) / splits) * block_n


if triton is not None:

    @triton.jit
    def _split_kernel(q_ptr, k_ptr, v_ptr, slots_ptr, pos_ptr, part_ptr, lse_ptr, scale,
                      stride_ks, stride_kh, stride_vs, stride_vh, stride_qb, stride_sb,
                      G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                      IEEE: tl.constexpr):
        """Program (kv head, split, row): the split's share of the row's valid keys (whole blocks, as
        `split_keys`; a split past them writes an empty result). Writes the split's unnormalised output [GP, D]
        and its (max, sum) per query row."""
        kvh, split, row = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        n_kv, n_splits = tl.num_programs(0), tl.num_programs(1)
        q_ptr += row * stride_qb
        slots_ptr += row * stride_sb
        valid = tl.load(pos_ptr + row) + 1
        per_split = tl.cdiv(tl.cdiv(valid, BLOCK_N), n_splits) * BLOCK_N
        rows = tl.arange(0, GP)
        dims = tl.arange(0, D)
        q = tl.load(q_ptr + (kvh * G + rows)[:, None] * D + dims[None, :], mask=(rows < G)[:, None],
                    other=0.0).to(tl.float32)
        m = tl.full([GP], float("-inf"), tl.float32)
        s = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        start = split * per_split
        end = tl.minimum(start + per_split, valid)
        for block in range(start, end, BLOCK_N):
            keys = block + tl.arange(0, BLOCK_N)
            inside = keys < end
            slot = tl.load(slots_ptr + keys, mask=inside, other=0)
            k = tl.load(k_ptr + slot[:, None] * stride_ks + kvh * stride_kh + dims[None, :], mask=inside[:, None],
                        other=0.0)
            # fp32 operands: bf16 K/V widen exactly and tf32 keeps all their bits (and more of p's than bf16);
            # fp32 models take the ieee product, so replays match the eager path's fp32 attention
            if IEEE:
                scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="tf32")
            scores = scores * scale  # [GP, BLOCK_N]
            scores = tl.where(inside[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(scores - m_new[:, None])
            v = tl.load(v_ptr + slot[:, None] * stride_vs + kvh * stride_vh + dims[None, :], mask=inside[:, None],
                        other=0.0)
            if IEEE:
                pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p, v.to(tl.float32), input_precision="tf32")
            acc = acc * alpha[:, None] + pv
            s = s * alpha + tl.sum(p, axis=1)
            m = m_new
        at = ((row * n_kv + kvh) * n_splits + split) * GP + rows
        tl.store(part_ptr + at[:, None] * D + dims[None, :], acc)
        tl.store(lse_ptr + at * 2, m)
        tl.store(lse_ptr + at * 2 + 1, s)

    @triton.jit
    def _merge_kernel(part_ptr, lse_ptr, out_ptr, n_splits, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                      SPLITS: tl.constexpr):
        """Program (query head, row): the splits' outputs rescaled to a common max and normalised. SPLITS splits
        a load: a split at a time made this launch a chain of dependent loads (~66 a pass at 32k keys)."""
        head, row = tl.program_id(0), tl.program_id(1)
        kvh = row * (tl.num_programs(0) // G) + head // G  # the row's KV head, counted over all rows
        g = head % G
        dims = tl.arange(0, D)
        ids = tl.arange(0, SPLITS)
        m_all = float("-inf")
        for first in range(0, n_splits, SPLITS):
            at = (kvh * n_splits + first + ids) * GP + g
            m = tl.load(lse_ptr + at * 2, mask=first + ids < n_splits, other=float("-inf"))
            m_all = tl.maximum(m_all, tl.max(m, axis=0))
        total = 0.0
        acc = tl.zeros([D], tl.float32)
        for first in range(0, n_splits, SPLITS):
            inside = first + ids < n_splits
            at = (kvh * n_splits + first + ids) * GP + g
            m = tl.load(lse_ptr + at * 2, mask=inside, other=float("-inf"))
            w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_all))  # a split past the valid length adds nothing
            total += tl.sum(w * tl.load(lse_ptr + at * 2 + 1, mask=inside, other=0.0), axis=0)
            parts = tl.load(part_ptr + at[:, None] * D + dims[None, :], mask=inside[:, None], other=0.0)
            acc += tl.sum(w[:, None] * parts, axis=0)
        tl.store(out_ptr + (row * tl.num_programs(0) + head) * D + dims, (acc / total).to(out_ptr.dtype.element_ty))


class PagedDecodeAttention:
    """One window's launch geometry and scratch buffers, allocated up front (CUDA-graph capture allows no
    allocation outside the graph's pool, and a replay must find the same addresses)."""

    def __init__(self, window: int, heads: int, kv_heads: int, head_dim: int, device: torch.device,
                 dtype: torch.dtype, programs: int | None = None, batch: int = 1, block_n: int = BLOCK_N,
                 launch: dict | None = None):
        """`programs`: split programs over all rows (default 2 per SM); `block_n` keys per inner step; `launch`:
        Triton's num_warps / num_stages for the split kernel (its defaults when absent). The last three are for
        tuning (evals/scripts/paged_decode_sweep.py)."""
        if triton is None:
            raise RuntimeError("paged decode attention needs triton")
        if not supports(heads, kv_heads, head_dim):
            raise ValueError(f"unsupported attention shape: {heads} heads over {kv_heads}, head dim {head_dim}")
        if programs is None:
            programs = 2 * torch.cuda.get_device_properties(device).multi_processor_count \
                if device.type == "cuda" else 8
        self.group, self.head_dim, self.kv_heads, self.batch = heads // kv_heads, head_dim, kv_heads, batch
        self.padded = max(MIN_G, triton.next_power_of_2(self.group))
        self.block_n, self.launch = block_n, dict(launch or {})
        self.splits = splits_for(window, kv_heads * batch, programs, block_n)  # programs over all rows
        self.merge_splits = min(MERGE_SPLITS, triton.next_power_of_2(self.splits))
        rows = batch * kv_heads * self.splits * self.padded
        self.parts = torch.empty(rows, head_dim, dtype=torch.float32, device=device)
        self.lse = torch.empty(rows, 2, dtype=torch.float32, device=device)
        self.out = torch.empty(batch, heads, head_dim, dtype=dtype, device=device)

    def __call__(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
                 position: torch.Tensor) -> torch.Tensor:
        """As `reference.paged_decode_attention` (its docstring has the shapes); returns a buffer of this
        object's, overwritten by the next call."""
        q, slots = q.contiguous(), slots.view(self.batch, -1)
        if k_pool.stride(2) != 1 or v_pool.stride(2) != 1:
            raise ValueError("the KV pools' head dim must be contiguous")
        if slots.stride(1) != 1:
            raise ValueError("each row's slot table must be contiguous")
        _split_kernel[(self.kv_heads, self.splits, self.batch)](
            q, k_pool, v_pool, slots, position, self.parts, self.lse, 1.0 / math.sqrt(self.head_dim),
            k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1), q.stride(0), slots.stride(0),
            G=self.group, GP=self.padded, D=self.head_dim, BLOCK_N=self.block_n, IEEE=q.dtype == torch.float32,
            **self.launch)
        _merge_kernel[(self.kv_heads * self.group, self.batch)](self.parts, self.lse, self.out, self.splits,
                                                               G=self.group, GP=self.padded, D=self.head_dim,
                                                               SPLITS=self.merge_splits)
        return self.out
