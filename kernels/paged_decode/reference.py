"""Plain-torch reference of `kernel.paged_decode_attention`: the same signature and result, one token attending
over the key slots of a window, read from the KV pools through a slot table.

Shapes: H query heads, Hkv KV heads, D head dim, W window of slots, S pool slots.
"""

from __future__ import annotations

import math

import torch


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
                           position: torch.Tensor) -> torch.Tensor:
    """q [1, H, D]; k_pool, v_pool [S, Hkv, D]; slots [W] int64 (the window's key slots in position order);
    position [1] int64: the token's own position p, so keys 0..p are valid. → [1, H, D] in q's dtype.
    Query head h reads KV head h // (H / Hkv) (grouped-query attention); softmax scale 1 / sqrt(D)."""
    _, h, d = q.shape
    hkv = k_pool.shape[1]
    n = int(position[0]) + 1
    keys = k_pool[slots[:n]].float()  # [n, Hkv, D]
    values = v_pool[slots[:n]].float()
    qg = q[0].float().view(hkv, h // hkv, d)  # [Hkv, G, D]
    scores = torch.einsum("kgd,nkd->kgn", qg, keys) / math.sqrt(d)
    out = torch.einsum("kgn,nkd->kgd", scores.softmax(dim=-1), values)
    return out.reshape(1, h, d).to(q.dtype)
