"""Launch geometry of the paged decode kernel (kernels/paged_decode) on one GPU: split programs per SM, keys per
inner step, warps and pipeline stages, one decode token of Qwen3-30B-A3B's attention (32 query heads over 4 KV
heads of 128) over W keys on pages of 16 slots in random order; median times of triton's do_bench, the default
geometry first, then the fastest.

    python evals/scripts/paged_decode_sweep.py [--windows 4096 32768] [--top 8]
"""

import argparse
import itertools

import torch
from triton.testing import do_bench

from freetoken.kernels.paged_decode.kernel import PagedDecodeAttention
from freetoken.kernels.paged_decode.reference import paged_decode_attention

p = argparse.ArgumentParser()
p.add_argument("--windows", type=int, nargs="+", default=[4096, 32768])
p.add_argument("--top", type=int, default=8)
a = p.parse_args()
dev, dt, heads, kv_heads, dim, page = torch.device("cuda"), torch.bfloat16, 32, 4, 128, 16
sms = torch.cuda.get_device_properties(dev).multi_processor_count
print(f"{torch.cuda.get_device_name(dev)}, {sms} SMs")
for w in a.windows:
    pages = torch.randperm(2 * w // page, device=dev)[:w // page]
    slots = (pages[:, None] * page + torch.arange(page, device=dev)).flatten()
    k = torch.randn(2 * w, kv_heads, dim, device=dev, dtype=dt)
    v = torch.randn_like(k)
    q = torch.randn(1, heads, dim, device=dev, dtype=dt)
    pos = torch.tensor([w - 1], device=dev)
    want = paged_decode_attention(q, k, v, slots, pos).float()
    rows = []
    for per_sm, block_n, warps, stages in itertools.product((2, 4, 8), (32, 64, 128), (4, 8), (None, 1, 2, 3)):
        launch = {"num_warps": warps} | ({} if stages is None else {"num_stages": stages})
        attn = PagedDecodeAttention(w, heads, kv_heads, dim, dev, dt, programs=per_sm * sms, block_n=block_n,
                                    launch=launch)
        try:
            err = ((attn(q, k, v, slots, pos).float() - want).norm() / want.norm()).item()
        except Exception as e:  # a geometry past the SM's shared memory or registers: Triton refuses it
            print(f"programs/SM {per_sm}, {block_n} keys/step, {warps} warps, stages {stages}: {type(e).__name__}")
            continue
        args = (q, k, v, slots, pos)
        ms = do_bench(lambda attn=attn, args=args: attn(*args), return_mode="median")
        rows.append((ms, per_sm, block_n, warps, stages, err))
    kv_bytes = 2 * w * kv_heads * dim * 2
    default = next(r for r in rows if r[1:5] == (2, 64, 4, None))
    print(f"\nwindow {w} ({kv_bytes / 1e6:.0f} MB of K/V)\n| programs/SM | keys/step | warps | stages | ms | GB/s | "
          "vs default | rel. error |\n| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for ms, per_sm, block_n, warps, stages, err in [default] + sorted(rows, key=lambda r: r[0])[:a.top]:
        print(f"| {per_sm} | {block_n} | {warps} | {stages or 'default'} | {ms:.4f} | {kv_bytes / ms / 1e6:.0f} | "
              f"{default[0] / ms:.2f}× | {err:.1e} |")
