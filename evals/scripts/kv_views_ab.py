"""Decode attention at long contexts with the keys read as views of the KV pools (a sequence on consecutive pages)
against gathered (`base=None` / `PagedKVCache.contiguous_base` forced to None), modes interleaved:
1. one layer's KV update and attention in SmolLM2-135M's shape (9 query heads, 3 KV heads, head dim 64, fp32);
2. whole decode steps of the default model on the CPU (noisier: its weights' matmuls dominate a step).

    python evals/scripts/kv_views_ab.py [--contexts 1000 3000 5000 7000] [--rounds 4] [--no-model]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from freetoken.engine.attention import causal_attention
from freetoken.engine.kv_cache import PagedKVCache


def one_layer(context: int, rounds: int, calls: int = 50) -> tuple[float, float]:
    """Median µs of one layer's update + attention for one new token, (views, gathered)."""
    gen = torch.Generator().manual_seed(context)
    cache = PagedKVCache(n_layers=1, n_kv_heads=3, head_dim=64, page_size=16, initial_pages=context // 16 + 8)
    seq = cache.new_sequence()
    k = torch.randn(context, 3, 64, generator=gen)
    cache.reserve(seq, context)
    cache.update(0, seq, k, k)
    cache.commit(seq, context)
    q, new = torch.randn(1, 9, 64, generator=gen), torch.randn(1, 3, 64, generator=gen)
    cache.reserve(seq, 1)
    base = cache.contiguous_base(seq, context + 1)
    times: dict[str, list[float]] = {"views": [], "gathered": []}
    for _ in range(rounds):
        for mode in times:
            for _ in range(calls):
                t0 = time.perf_counter()
                keys, values = cache.update(0, seq, new, new, base=base if mode == "views" else None)
                causal_attention(q, keys, values, past=context)
                times[mode].append(time.perf_counter() - t0)
    return statistics.median(times["views"]) * 1e6, statistics.median(times["gathered"]) * 1e6


def decode_steps(lm, context: int, rounds: int, steps: int = 8) -> tuple[float, float]:
    """Median ms of the default model's decode step, (views, gathered)."""
    cache = lm.new_cache(initial_tokens=context + steps * rounds * 2 + 16, max_tokens=8192)
    seq = cache.new_sequence()
    prompt = torch.randint(100, 40000, (context,), generator=torch.Generator().manual_seed(context))
    views = PagedKVCache.contiguous_base
    times: dict[str, list[float]] = {"views": [], "gathered": []}
    try:
        with torch.inference_mode():
            for start in range(0, context, 1024):
                lm.forward(prompt[start:start + 1024], cache, seq, "last")
            for _ in range(rounds):
                for mode in times:
                    PagedKVCache.contiguous_base = views if mode == "views" else (lambda self, seq, end: None)
                    for step in range(steps):
                        t0 = time.perf_counter()
                        lm.forward(torch.tensor([5 + step]), cache, seq, "last")
                        times[mode].append(time.perf_counter() - t0)
    finally:
        PagedKVCache.contiguous_base = views
    return statistics.median(times["views"]) * 1e3, statistics.median(times["gathered"]) * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", nargs="+", type=int, default=[1000, 3000, 5000, 7000])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--no-model", action="store_true", help="only the one-layer part")
    a = p.parse_args()
    print(f"threads {torch.get_num_threads()}\n\n| context | one layer µs, views | gathered | gathered / views |\n"
          "| ---: | ---: | ---: | ---: |")
    for context in a.contexts:
        v, g = one_layer(context, a.rounds)
        print(f"| {context:,} | {v:.0f} | {g:.0f} | {g / v:.2f}× |", flush=True)
    if a.no_model:
        return 0
    from freetoken.engine.loader import load_model

    lm = load_model(None, device="cpu", progress=False)
    print("\n| context | decode step ms, views | gathered | gathered / views |\n| ---: | ---: | ---: | ---: |")
    for context in a.contexts:
        v, g = decode_steps(lm, context, a.rounds)
        print(f"| {context:,} | {v:.1f} | {g:.1f} | {g / v:.2f}× |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
