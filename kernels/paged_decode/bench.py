"""Micro-benchmark of a captured decode step's attention at the window sizes it uses, keys gathered from a pool
of 2W slots: SDPA in the 3-D `enable_gqa` form (before 2026-12-01: the math fallback), `static_decode_attention`
(4-D, the default), and the paged split-KV kernel; KV read bandwidth against the device copy ceiling. With
`--batches`, a captured batched step's attention too: `decode_rows_attention` (B × W keys gathered, one SDPA call,
the default) against the paged kernel over all B rows (GPU path "batch-paged-decode").

    python -m freetoken.kernels.paged_decode.bench [--windows 1024 4096 16384 32768] [--batches 4 16]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from freetoken.engine.attention import decode_rows_attention, static_decode_attention
from freetoken.engine.kv_cache import PagedKVCache
from freetoken.kernels.paged_decode.kernel import PagedDecodeAttention
from freetoken.kernels.paged_decode.reference import paged_decode_attention


def enable_gqa_form(q, keys, values, valid):
    """The form `static_decode_attention` replaced (3-D tensors: SDPA's math fallback), for comparison."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                                         attn_mask=valid[None, :], enable_gqa=True)
    return out.transpose(0, 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--windows", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batches", type=int, nargs="*", default=[], help="also time batched steps of these sizes")
    a = p.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    big = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    copy_gb_s = 2 * big.numel() / do_bench(lambda big=big: big.clone(), return_mode="median") / 1e6
    del big
    print(f"device copy ceiling: {copy_gb_s:.0f} GB/s (read + write)")
    print("| window | 3-D enable_gqa ms | static_decode_attention ms | paged kernel ms | paged vs default | "
          "paged KV GB/s | paged rel. error |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for w in a.windows:
        k = torch.randn(2 * w, a.kv_heads, a.head_dim, device=dev, dtype=dt)
        v = torch.randn_like(k)
        slots = torch.randperm(2 * w, device=dev)[:w]
        q = torch.randn(1, a.heads, a.head_dim, device=dev, dtype=dt)
        pos = torch.tensor([w - 1], device=dev)
        valid = torch.ones(w, dtype=torch.bool, device=dev)
        paged = PagedDecodeAttention(w, a.heads, a.kv_heads, a.head_dim, dev, dt)
        want = paged_decode_attention(q, k, v, slots, pos).float()
        err = ((paged(q, k, v, slots, pos).float() - want).norm() / want.norm()).item()

        def gathered(form, q=q, k=k, v=v, slots=slots, valid=valid):
            return form(q, k.index_select(0, slots), v.index_select(0, slots), valid)

        t_old = do_bench(lambda: gathered(enable_gqa_form), return_mode="median")
        t_sdpa = do_bench(lambda: gathered(static_decode_attention), return_mode="median")
        t_paged = do_bench(lambda paged=paged, q=q, k=k, v=v, slots=slots, pos=pos: paged(q, k, v, slots, pos),
                           return_mode="median")
        kv_bytes = 2 * w * a.kv_heads * a.head_dim * 2
        print(f"| {w} | {t_old:.3f} | {t_sdpa:.3f} | {t_paged:.3f} | {t_sdpa / t_paged:.1f}× | "
              f"{kv_bytes / t_paged / 1e6:.0f} | {err:.1e} |")
    if a.batches:
        batched(a, dev, dt)


def batched(a, dev: torch.device, dt: torch.dtype) -> None:
    """Each row a sequence of W keys scattered over a pool of 2 × B × W slots."""
    print("\n| batch | window | decode_rows_attention ms | paged kernel ms | paged vs default | paged KV GB/s | "
          "paged rel. error |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for b in a.batches:
        for w in a.windows:
            pool = 2 * b * w
            cache = PagedKVCache(1, a.kv_heads, a.head_dim, page_size=16, dtype=dt, device=dev,
                                 initial_pages=pool // 16)
            cache.k[0].normal_()
            cache.v[0].normal_()
            read = torch.randperm(pool, device=dev)[:b * w].view(b, w)
            pos = torch.full((b,), w - 1, device=dev)
            write = read[:, -1].contiguous()
            q = torch.randn(b, a.heads, a.head_dim, device=dev, dtype=dt)
            k = cache.k[0][write].clone()
            v = cache.v[0][write].clone()
            paged = PagedDecodeAttention(w, a.heads, a.kv_heads, a.head_dim, dev, dt, batch=b)
            want = paged_decode_attention(q, cache.k[0], cache.v[0], read, pos).float()
            err = ((paged(q, cache.k[0], cache.v[0], read, pos).float() - want).norm() / want.norm()).item()
            t_rows = do_bench(lambda q=q, k=k, v=v, write=write, read=read, pos=pos, cache=cache: decode_rows_attention(
                cache, 0, q, k, v, write, read, pos, slice(None)), return_mode="median")
            t_paged = do_bench(lambda paged=paged, q=q, cache=cache, read=read, pos=pos: paged(
                q, cache.k[0], cache.v[0], read, pos), return_mode="median")
            kv_bytes = b * 2 * w * a.kv_heads * a.head_dim * 2
            print(f"| {b} | {w} | {t_rows:.3f} | {t_paged:.3f} | {t_rows / t_paged:.1f}× | "
                  f"{kv_bytes / t_paged / 1e6:.0f} | {err:.1e} |")


if __name__ == "__main__":
    main()
