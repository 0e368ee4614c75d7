"""`ft bench reuse`: what reusing a conversation's K/V saves an agent — time to first token of the next turn of a
long conversation with reuse against from scratch, and the cost of an edit by its distance from the end.

    ft bench reuse [--shape qwen3-30b-a3b] [--history 20000] [--turn 500] [--edits 1000,4000,16000]
                   [--expert-cache SIZE] [--repeats 3] [--calibrated]

The history (random token ids standing in for a real agent transcript: reuse does not depend on the text) is
prefilled once into a sequence of the generator's cache; every measurement works on a fork of it, so each
starts from the same state and nothing leaks between rows. Rows:
- `cold`: the whole history and the new turn from an empty cache (what a server without reuse pays per turn);
- `reuse`: the new turn after the cached history (an agent's follow-up);
- `edit at -d`: the history cut `d` tokens before its end (an edit there), those `d` tokens recomputed, then the
  new turn;
- `reuse, copy only` / `reuse, cpu only` (`--turn-paths`, offloaded experts): the follow-up turn with every miss
  copied to the GPU, or computed on the CPU, beside the planner's split (`reuse`).
TTFT is from the first new token handed to the model to the first sampled token on the host; medians. With
offloaded experts each row also shows, per run, the expert cache's hit rate, the GB copied over PCIe and the
experts computed on the CPU (a turn's cost there is mostly expert traffic, not its tokens).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from freetoken.bench.decode import (
    _routing,
    _sync,
    add_model_args,
    add_run_args,
    emit,
    measure_ceilings,
    result_header,
)
from freetoken.bench.synthetic import build_synthetic
from freetoken.engine.generator import Generator
from freetoken.engine.sampling import SamplingParams
from freetoken.units import parse_bytes

FIRST_TOKEN = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def _ttft(gen: Generator, seq, new_ids: list[int]) -> float:
    _sync(gen.lm.device)
    t0 = time.perf_counter()
    for _ in gen.extend(seq, new_ids, FIRST_TOKEN, decode_text=False):
        break  # the event exists once the first token is on the host
    return time.perf_counter() - t0


def _traffic(lm):
    """A snapshot of the offloaded executor's counters (hits, misses, bytes copied, CPU experts), or None. A miss
    of the slots that the block store served counts as a hit: the device held it, no byte crossed the link."""
    c = getattr(lm.experts, "counters", None)
    return None if c is None else (c.hits + c.store_hits, c.misses - c.store_hits, c.bytes_copied, c.cpu_experts)


def bench(a: argparse.Namespace) -> list[tuple]:
    """(case, distance from the end, tokens computed, median TTFT s, traffic per run or None) rows; traffic is
    (hit rate, GB copied, CPU experts)."""
    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    budget = None if a.expert_cache == "all" else parse_bytes(a.expert_cache)
    lm = build_synthetic(a.shape, device=device, dtype=dtype, expert_cache=budget, layers=a.layers, seed=a.seed,
                         skew=a.skew, expert_format=a.expert_format)
    a.seeded = None
    if a.calibrated and hasattr(lm.experts, "planner"):
        ceilings = measure_ceilings(device, a.expert_format, dtype)
        if (seeded := ceilings.planner()) is not None:
            lm.experts.planner, a.seeded = seeded, (ceilings.h2d, ceilings.cpu_experts)
    total = a.history + a.turn + 8
    gen = Generator(lm, max_seq_len=total, pool_tokens=3 * total)  # the history, a fork's new pages, a cold copy
    cache = gen.cache(3 * total)  # allocated up front: a pool growing mid-measurement would be timed too
    rng = torch.Generator().manual_seed(a.seed)
    ids = torch.randint(0, lm.args.decoder.vocab_size, (a.history + a.turn,), generator=rng).tolist()
    history, turn = ids[:a.history], ids[a.history:]
    base = cache.new_sequence()
    gen.prefill(base, history)
    rows = []

    def measure(case: str, distance: int, run) -> None:
        times = []
        run()  # warms up (kernels, allocator blocks)
        before = _traffic(lm)
        for _ in range(a.repeats):
            times.append(run())
        after, traffic = _traffic(lm), None
        if before is not None:
            hits, misses, copied, cpu = (y - x for x, y in zip(before, after, strict=True))
            traffic = (hits / max(1, hits + misses), copied / a.repeats / 1e9, cpu / a.repeats)
        rows.append((case, distance, len(turn) + (a.history if case == "cold" else distance),
                     statistics.median(times), traffic))
        print(_format(rows[-1], rows[0][3]), file=sys.stderr, flush=True)
        if hasattr(lm.experts, "prefill_planner"):  # how the offloaded executor weighed the paths by then
            print(f"prefill planner after {case}: {lm.experts.prefill_planner().describe()}", file=sys.stderr,
                  flush=True)

    def cold() -> float:
        seq = cache.new_sequence()
        try:
            return _ttft(gen, seq, history + turn)
        finally:
            cache.release(seq)

    def from_history(distance: int):
        def run() -> float:
            seq = cache.fork(base)
            try:
                cache.truncate(seq, a.history - distance)
                return _ttft(gen, seq, history[a.history - distance:] + turn)
            finally:
                cache.release(seq)
        return run

    measure("cold", a.history, cold)
    measure("reuse", 0, from_history(0))
    executor = lm.experts
    for path in a.turn_paths if hasattr(executor, "miss_path") else ():
        chosen, executor.miss_path = executor.miss_path, path  # the turn with its misses on one path only
        try:
            measure(f"reuse, {path} only", 0, from_history(0))
        finally:
            executor.miss_path = chosen
    for d in a.edits:
        if 0 < d < a.history:
            measure(f"edit at -{d}", d, from_history(d))
    cache.release(base)
    return rows


def _format(row: tuple, cold_s: float) -> str:
    case, distance, computed, ttft, traffic = row
    line = f"| {case} | {distance} | {computed} | {ttft:.3f} | {cold_s / ttft:.1f}× |"
    if traffic is not None:
        line += f" {traffic[0]:.0%} | {traffic[1]:.2f} | {traffic[2]:.0f} |"
    return line


def render(rows, a: argparse.Namespace) -> str:
    lines = [
        *result_header("Conversation reuse (TTFT of the next turn)", "reuse", a),
        f"- history {a.history} tokens (random ids), new turn {a.turn} tokens, expert cache {a.expert_cache}, "
        f"median of {a.repeats} runs after one warm-up; every run on a fork of the prefilled history; "
        f"{_routing(a.skew)}; hit rate: experts the device held (dequantized or in the block store)",
        *([f"- miss planner seeded from this run's measurements (`--calibrated`): link {a.seeded[0]:.1f} GB/s, "
           f"CPU expert kernel {a.seeded[1]:.1f} GB/s (batch 1)"] if getattr(a, "seeded", None) else []),
        "",
        "| case | distance from the end (tokens) | tokens computed | TTFT s | faster than cold |"
        + (" expert hit rate | GB copied | CPU experts |" if rows[0][4] is not None else ""),
        "| --- | ---: | ---: | ---: | ---: |" + (" ---: | ---: | ---: |" if rows[0][4] is not None else ""),
        *(_format(r, rows[0][3]) for r in rows),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="ft bench reuse", description=__doc__.splitlines()[0])
    add_model_args(p)
    p.add_argument("--history", type=int, default=20000, help="tokens of conversation before the new turn")
    p.add_argument("--turn", type=int, default=500, help="tokens of the new turn")
    p.add_argument("--edits", default="1000,4000,16000", help="comma-separated distances of an edit from the end")
    p.add_argument("--expert-cache", default="all", help="expert cache size, or 'all' for every expert resident")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--turn-paths", default="copy,cpu",
                   help="miss paths to time the follow-up turn on alone, beside auto (offloaded experts; '' for none)")
    p.add_argument("--skew", type=float, default=0.0,
                   help="Zipf exponent of expert popularity (0: near-uniform routing, the pessimistic case)")
    p.add_argument("--calibrated", action="store_true",
                   help="seed the miss planner from this run's measured link and CPU kernel rates, as `ft "
                        "calibrate` would (default: the uncalibrated defaults, which the planner then learns)")
    add_run_args(p)
    a = p.parse_args(argv)
    a.argv, a.edits = argv, [int(x) for x in a.edits.split(",") if x]
    a.turn_paths = [x for x in a.turn_paths.split(",") if x]
    if set(a.turn_paths) - {"copy", "cpu", "auto"}:
        p.error(f"--turn-paths takes copy, cpu or auto, got {a.turn_paths}")
    return emit(render(bench(a), a), a.out)
