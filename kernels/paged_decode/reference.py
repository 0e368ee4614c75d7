"""Plain-torch reference of `kernel.paged_decode_attention`: the same signature and result, one token attending
over the key slots of a window (each of B tokens over its own), read from the KV pools through slot tables.

Shapes: B rows, H query heads, Hkv KV heads, D head dim, W window of slots, S pool slots.
"""

from __future__ import annotations

import math

import torch


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
                           position: torch.Tensor) -> torch.Tensor:
    """q [B, H, D]; k_pool, v_pool [S, Hkv, D]; slots [B, W] int64 (each row's key slots in position order; [W]
    for one row); position [B] int64: each row's own position p, so its keys 0..p are valid. → [B, H, D] in q's
    dtype. Query head h reads KV head h // (H / Hkv) (grouped-query attention); softmax scale 1 / sqrt(D)."""
    b, h, d = q.shape
    hkv = k_pool.shape[1]
    slots = slots.view(b, -1)
    rows = []
    for i in range(b):
        n = int(position[i]) + 1
        keys = k_pool[slots[i, :n]].float()  # [n, Hkv, D]
        values = v_pool[slots[i, :n]].float()
        qg = q[i].float().view(hkv, h // hkv, d)  # [Hkv, G, D]
        scores = torch.einsum("kgd,nkd->kgn", qg, keys) / math.sqrt(d)
        rows.append(torch.einsum("kgn,nkd->kgd", scores.softmax(dim=-1), values).reshape(h, d))
    return torch.stack(rows).to(q.dtype)
