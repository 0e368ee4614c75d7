"""Where an agent's next turn spends its time under offloaded experts: the host thread's phases of a short prefill
chunk (issue 5's 500-token turn after a 20k-token history), per layer.

    python evals/scripts/profile_turn.py [--history 20000] [--turn 500] [--expert-cache 16GiB]
                                         [--expert-format Q8_0] [--ab short-chunks-cpu ...]

Builds a synthetic shape (`--shape`, default qwen3-30b-a3b; random weights) as `ft bench reuse` does, prefills
the history once, then times the turn on forks of it with each host-side phase of the prefill path marked by a
perf clock (inclusive wall time; ~0.3 µs a mark). A phase that ends in a host synchronisation (the layer's
routing reaching the host, the CPU share's result) counts the wait: a turn whose time goes to those waits is bound
by the GPU or the link, one whose time goes to queueing copies and launches is bound by the host. Also printed per
turn: the bytes copied, the copy stream's busy time (the link's share of the turn), the experts streamed ahead and
those the CPU took. `--ab PATHS`: rounds with no experimental GPU path, then with each FREETOKEN_EXPERIMENTAL value
of PATHS (run-time paths only: `block-store` changes the build, run it as a separate process), twice over.
FREETOKEN_EXPERIMENTAL set outside applies to every round. A diagnostic, not a benchmark.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gzip
import os
import shutil
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from freetoken.bench.synthetic import build_synthetic
from freetoken.engine import gpu_paths
from freetoken.engine.generator import Generator
from freetoken.engine.offload import cpu_experts, prefill
from freetoken.engine.offload.block_store import BlockStore
from freetoken.engine.offload.executor import OffloadedExpertExecutor
from freetoken.engine.offload.row_dequant import RowDequantizer
from freetoken.engine.offload.transfer import ExpertCopier
from freetoken.engine.sampling import SamplingParams
from freetoken.kernels.gguf_dequant import fused
from freetoken.units import parse_bytes

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_offload import _Clock, _mark  # noqa: E402  (a sibling script: the same clock and marks)

PHASES = {  # (object, attribute) → label; inclusive, so nested phases are also inside their callers
    "layer": (prefill.PrefillPath, "_forward_grouped"),  # a MoE layer of the chunk, routing wait to return
    "routing_wait": (prefill, "group_by_expert"),  # the layer's routing to the host (waits for the GPU)
    "stream_next": (prefill.PrefillPath, "_stream_next_layer"),  # queueing the next layer's copies
    "stream_layer": (prefill.PrefillPath, "_stream_layer"),  # the same, and a chunk's first layer itself (stream-early)
    "compute_sorted": (prefill.PrefillPath, "_compute_sorted"),  # one grouped pass over the layer's slots
    "copy_and_compute": (prefill.PrefillPath, "_copy_and_compute"),  # the per-expert path
    "sorted_launches": (prefill, "sorted_expert_forward"),
    "cpu_submit": (cpu_experts.CpuExpertRunner, "submit"),  # the layer's input to the host, the CPU job posted
    "cpu_result": (OffloadedExpertExecutor, "_add_cpu"),  # waiting for the CPU share, its result to the device
    "plan": (OffloadedExpertExecutor, "_plan"),
    "copies_marked": (ExpertCopier, "to_slots_marked"),  # a batch streamed ahead into free cache slots
    "staging_batch": (ExpertCopier, "to_staging_batch"),  # a batch streamed ahead into the staging ring
    "to_slot": (ExpertCopier, "to_slot"),  # one expert copied on a miss (the per-expert path)
    "to_staging": (ExpertCopier, "to_staging"),
    "reserve_staging": (ExpertCopier, "reserve_staging"),
    "reserve_batch": (ExpertCopier, "reserve_staging_batch"),  # inside reserve_staging too
    "queue_copies": (ExpertCopier, "_queue_copies"),  # the runtime calls of a batch's copies
    "store_copies": (ExpertCopier, "_store_copies"),
    "store_place": (BlockStore, "place"),
    "block_copies": (RowDequantizer, "block_copies"),
    "slot_index": (RowDequantizer, "_slot_index"),
    "dequant_rows": (ExpertCopier, "_dequantize_rows"),
    "wait_all": (ExpertCopier, "wait_all"),
}
FIRST_TOKEN = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=None, help="default: the shape's")
    p.add_argument("--history", type=int, default=20000)
    p.add_argument("--turn", type=int, default=500)
    p.add_argument("--expert-cache", default="16GiB")
    p.add_argument("--expert-format", default="Q8_0", choices=["dense", "Q8_0"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--prefill-ahead", action="store_true",
                   help="stream each next layer ahead on any device (default: as served, on CUDA only): a CPU check")
    p.add_argument("--ab", metavar="PATHS", nargs="+", help="FREETOKEN_EXPERIMENTAL values to alternate with none")
    p.add_argument("--trace", metavar="FILE", help="then one more turn (the last round's paths) under torch's "
                   "profiler, its Chrome trace written to FILE (.json.gz): evals/scripts/turn_timeline.py reads it")
    a = p.parse_args()
    device = torch.device(a.device)
    lm = build_synthetic(a.shape, device=device, dtype=torch.bfloat16, expert_cache=parse_bytes(a.expert_cache),
                         layers=a.layers, seed=0, expert_format=a.expert_format,
                         prefill_ahead=True if a.prefill_ahead else None)
    clock = _TracingClock()
    for label, (owner, name) in PHASES.items():
        _mark(owner, name, label, clock)
    _mark(fused, "dequantize_into", "dequant_launch", clock)
    total = a.history + a.turn + 8
    gen = Generator(lm, max_seq_len=total, pool_tokens=2 * total)
    cache = gen.cache(2 * total)
    ids = torch.randint(0, lm.args.decoder.vocab_size, (a.history + a.turn,),
                        generator=torch.Generator().manual_seed(0)).tolist()
    base = cache.new_sequence()
    gen.prefill(base, ids[:a.history])
    outside = os.environ.get("FREETOKEN_EXPERIMENTAL", "")
    rounds = [None] if a.ab is None else ["", *a.ab] * 2
    for paths in rounds:
        if paths is not None:
            os.environ["FREETOKEN_EXPERIMENTAL"] = ",".join(x for x in (outside, paths) if x)
            gpu_paths.enabled.cache_clear()
            gpu_paths._named.cache_clear()
        _turn(gen, cache, base, ids[a.history:], a.history, device, clock)  # warm-up
        clock.seconds.clear()
        clock.calls.clear()
        before = dataclasses.replace(lm.experts.counters)
        times = [_turn(gen, cache, base, ids[a.history:], a.history, device, clock) for _ in range(a.repeats)]
        _report(lm, before, times, paths, clock, a)
    if a.trace:
        clock.tracing = True
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            _turn(gen, cache, base, ids[a.history:], a.history, device, clock)
        raw = a.trace.removesuffix(".gz")
        prof.export_chrome_trace(raw)
        if a.trace.endswith(".gz"):
            with open(raw, "rb") as src, gzip.open(a.trace, "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.remove(raw)
        print(f"trace of one turn: {a.trace}")


class _TracingClock(_Clock):
    """The perf clock, whose marks also become profiler ranges ("ft.<label>") once `tracing` is set."""

    tracing = False

    @contextlib.contextmanager
    def __call__(self, label: str):
        with super().__call__(label), (record_function(f"ft.{label}") if self.tracing else contextlib.nullcontext()):
            yield


def _turn(gen: Generator, cache, base, turn: list[int], history: int, device, clock) -> float:
    """The turn's time to its first token on a fork of the prefilled history."""
    seq = cache.fork(base)
    try:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        with clock("turn"):
            for _ in gen.extend(seq, turn, FIRST_TOKEN, decode_text=False):
                break
        return time.perf_counter() - t0
    finally:
        cache.release(seq)


def _report(lm, before, times: list[float], paths: str | None, clock: _Clock, a) -> None:
    c, n = lm.experts.counters, len(times)
    moved = {f.name: getattr(c, f.name) - getattr(before, f.name) for f in dataclasses.fields(c)}
    layers = clock.calls["layer"] // n or 1
    label = os.environ.get("FREETOKEN_EXPERIMENTAL", "") if paths is not None else None
    print(f"== turn of {a.turn} tokens after {a.history}, {a.expert_format}, expert cache {a.expert_cache}"
          f"{'' if label is None else f' [FREETOKEN_EXPERIMENTAL={label!r}]'}: median {statistics.median(times):.3f} s"
          f" ({', '.join(f'{t:.3f}' for t in times)}), {layers} MoE layers")
    gb = moved["bytes_copied"] / n / 1e9
    copy_s = moved["copy_seconds"] / n
    print(f"per turn: {gb:.2f} GB copied, copy stream busy {copy_s:.3f} s "
          f"({gb / copy_s if copy_s else 0:.1f} GB/s while busy; {copy_s / statistics.median(times):.0%} of the turn),"
          f" {moved['prefetched'] / n:.0f} experts streamed ahead ({moved['prefetch_used'] / n:.0f} used), "
          f"{moved['cpu_experts'] / n:.0f} on the CPU in {moved['cpu_seconds'] / n:.3f} s, "
          f"{moved['store_hits'] / n:.0f} from the block store")
    print(f"mean µs per MoE layer of the turn ({n} turns; inclusive: a phase also counts the phases it calls):")
    for name, total in sorted(clock.seconds.items(), key=lambda kv: -kv[1]):
        if name == "turn":  # the whole turn, above
            continue
        calls = clock.calls[name]
        print(f"  {name:<18} {total / (n * layers) * 1e6:9.1f}   ({calls / (n * layers):6.2f} calls, "
              f"{total / calls * 1e6:8.1f} µs each)")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
