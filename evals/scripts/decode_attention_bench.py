"""Times the captured decode step's attention (one token over a masked window of W key slots) in two forms:
`enable_gqa` on 3-D tensors (the form before 2026-12-01) and `static_decode_attention` (4-D, the query heads of a
KV head as its query rows), with the gather from the KV pool included, and checks they agree.

    python evals/scripts/decode_attention_bench.py [--windows 1024 4096 16384 32768]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from freetoken.engine.attention import static_decode_attention


def old_form(q, keys, values, valid):
    out = F.scaled_dot_product_attention(q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                                         attn_mask=valid[None, :], enable_gqa=True)
    return out.transpose(0, 1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--windows", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    a = p.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    print("| window | valid | old ms | new ms | speed-up | KV bytes read / new time | max abs diff |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for w in a.windows:
        pool_k = torch.randn(w * 2, a.kv_heads, a.head_dim, device=dev, dtype=dt)
        pool_v = torch.randn_like(pool_k)
        slots = torch.randperm(w * 2, device=dev)[:w]
        q = torch.randn(1, a.heads, a.head_dim, device=dev, dtype=dt)
        n = w * 3 // 4 + 1  # sequence shorter than the window, as after a window change
        valid = torch.arange(w, device=dev) < n

        def run(form, q=q, pool_k=pool_k, pool_v=pool_v, slots=slots, valid=valid):
            return form(q, pool_k.index_select(0, slots), pool_v.index_select(0, slots), valid)

        diff = (run(old_form).float() - run(static_decode_attention).float()).abs().max().item()
        t_old = do_bench(lambda: run(old_form), return_mode="median")
        t_new = do_bench(lambda: run(static_decode_attention), return_mode="median")
        kv_bytes = 2 * w * a.kv_heads * a.head_dim * 2
        print(f"| {w} | {n} | {t_old:.3f} | {t_new:.3f} | {t_old / t_new:.1f}× | {kv_bytes / t_new / 1e6:.0f} GB/s "
              f"| {diff:.2e} |")


if __name__ == "__main__":
    main()
