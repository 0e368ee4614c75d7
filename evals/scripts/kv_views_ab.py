"""Decode attention at long contexts, three ways of reading a sequence's cached keys (attention.KeyReading), modes
interleaved:
- views: a sequence on consecutive pages reads them as views of the KV pools;
- runs: a fork of it (its first write copies the shared last page elsewhere: two runs of slots, the layout of a
  request answered from the prefix cache) reads them run by run, without gathering (`run_attention`);
- gathered: the same fork with reading by runs turned off (`KeyReading.MAX_RUNS = 0`), as before it existed.
1. one layer's KV write and attention in SmolLM2-135M's shape (9 query heads, 3 KV heads, head dim 64, fp32);
2. whole decode steps of the default model on the CPU (noisier: its weights' matmuls dominate a step).

    python evals/scripts/kv_views_ab.py [--contexts 1000 3000 5000 7000] [--rounds 4] [--no-model]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from freetoken.engine.attention import KeyReading
from freetoken.engine.kv_cache import PagedKVCache

MODES = ("views", "runs", "gathered")


def _reading(mode: str, cache: PagedKVCache, seq, n_new: int = 1) -> KeyReading:
    """The forward's key reading in `mode` (gathered: reading by runs off)."""
    runs = KeyReading.MAX_RUNS
    KeyReading.MAX_RUNS = 0 if mode == "gathered" else runs
    try:
        reading = KeyReading(cache, seq, n_new)
    finally:
        KeyReading.MAX_RUNS = runs
    assert (reading.base is not None, reading.runs is not None) == (mode == "views", mode == "runs"), mode
    return reading


def one_layer(context: int, rounds: int, calls: int = 50) -> dict[str, float]:
    """Median µs of one layer's write + attention for one new token, per mode."""
    gen = torch.Generator().manual_seed(context)
    cache = PagedKVCache(n_layers=1, n_kv_heads=3, head_dim=64, page_size=16, initial_pages=context // 8 + 8)
    seq = cache.new_sequence()
    k = torch.randn(context, 3, 64, generator=gen)
    cache.reserve(seq, context)
    cache.update(0, seq, k, k)
    cache.commit(seq, context)
    child = cache.fork(seq)
    q, new = torch.randn(1, 9, 64, generator=gen), torch.randn(1, 3, 64, generator=gen)
    for s in (child, seq):  # the fork's write copies the shared last page: the parent's stays where it was
        cache.reserve(s, 1)
    readings = {mode: _reading(mode, cache, seq if mode == "views" else child) for mode in MODES}
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(rounds):
        for mode, reading in readings.items():
            for _ in range(calls):
                t0 = time.perf_counter()
                reading.attend(0, q, new, new, None, None, None, first_row=0)
                times[mode].append(time.perf_counter() - t0)
    return {mode: statistics.median(t) * 1e6 for mode, t in times.items()}


def decode_steps(lm, context: int, rounds: int, steps: int = 8) -> dict[str, float]:
    """Median ms of the default model's decode step, per mode (views: its own cache; runs and gathered: a fork)."""
    prompt = torch.randint(100, 40000, (context,), generator=torch.Generator().manual_seed(context))
    sequences = {}
    with torch.inference_mode():
        for name in ("views", "forked"):
            cache = lm.new_cache(initial_tokens=2 * context + 4 * steps * rounds + 64, max_tokens=8192)
            seq = cache.new_sequence()
            for start in range(0, context, 1024):
                lm.forward(prompt[start:start + 1024], cache, seq, "last")
            sequences[name] = cache, seq if name == "views" else cache.fork(seq)
    plain = KeyReading.MAX_RUNS
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    try:
        with torch.inference_mode():
            for _ in range(rounds):
                for mode in MODES:
                    cache, seq = sequences["views" if mode == "views" else "forked"]
                    KeyReading.MAX_RUNS = 0 if mode == "gathered" else plain
                    for step in range(steps):
                        t0 = time.perf_counter()
                        lm.forward(torch.tensor([5 + step]), cache, seq, "last")
                        times[mode].append(time.perf_counter() - t0)
    finally:
        KeyReading.MAX_RUNS = plain
    return {mode: statistics.median(t) * 1e3 for mode, t in times.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", nargs="+", type=int, default=[1000, 3000, 5000, 7000])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--no-model", action="store_true", help="only the one-layer part")
    a = p.parse_args()
    head = "| ---: | ---: | ---: | ---: | ---: |"
    print(f"threads {torch.get_num_threads()}\n")
    print(f"| context | one layer µs, views | runs | gathered | gathered / runs |\n{head}")
    for context in a.contexts:
        t = one_layer(context, a.rounds)
        print(f"| {context:,} | {t['views']:.0f} | {t['runs']:.0f} | {t['gathered']:.0f} | "
              f"{t['gathered'] / t['runs']:.2f}× |", flush=True)
    if a.no_model:
        return 0
    from freetoken.engine.loader import load_model

    lm = load_model(None, device="cpu", progress=False)
    print(f"\n| context | decode step ms, views | runs | gathered | gathered / runs |\n{head}")
    for context in a.contexts:
        t = decode_steps(lm, context, a.rounds)
        print(f"| {context:,} | {t['views']:.1f} | {t['runs']:.1f} | {t['gathered']:.1f} | "
              f"{t['gathered'] / t['runs']:.2f}× |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
