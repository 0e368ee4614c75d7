"""`ft bench decode`: decode speed of a synthetic real-shape MoE model under each expert strategy, same run.

Strategies: `resident` (every expert on the device: the upper bound), `resident-graphs` (the same, decode steps
replayed as CUDA graphs), `copy` (fetch-on-demand into the expert cache of each --budgets size; at budget 0 the
naive baseline), `cpu` (every miss computed on the host: the CPU-only baseline), `auto` (the product: the miss
planner splits misses between copies and the CPU, overlapped, with next-layer prefetch), `auto-noprefetch`,
`auto-noguard` (the planner's split at every step, never a pure path: checks the path guard's choice),
`hf-accelerate` (transformers + accelerate offload of the very same weights, see `hf_baseline.py`).
The prompt is prefilled with the copy path for every strategy; only decode is timed. Each row reports tok/s,
the decode hit rate, the bytes each path moved per token, the achieved bandwidths and the physical floor: miss
bytes over min(PCIe + CPU-kernel bandwidth, DRAM read bandwidth), all three measured at the start of the run
(both miss paths read host DRAM; DESIGN.md §1), plus the resident work (a `resident-graphs` row's time per token,
when the run has one).
"""

from __future__ import annotations

import argparse
import datetime as dt
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from freetoken import host_load
from freetoken.bench.synthetic import SHAPES, build_synthetic, synthetic_config
from freetoken.engine import gpu_paths
from freetoken.engine.experts import LayerExperts, ResidentExpertExecutor
from freetoken.engine.loader import attach_experts, build_executor
from freetoken.engine.models import family_for
from freetoken.engine.offload.executor import OffloadedExpertExecutor
from freetoken.engine.offload.planner import MissPlanner
from freetoken.engine.offload.quantized import PROJECTIONS, QuantizedExperts
from freetoken.units import parse_bytes


@dataclass(slots=True)
class Row:
    strategy: str
    budget: str
    tok_s: float
    hit_rate: float | None = None
    hit_rate_cached: float | None = None  # the hits on experts cached before the step (not admitted by its prefetch)
    copied_gb_per_token: float = 0.0
    cpu_gb_per_token: float = 0.0  # expert bytes the CPU read per token
    pcie_gb_s: float | None = None  # achieved while copying (copy bytes / copy-stream busy time)
    cpu_gb_s: float | None = None  # achieved while the CPU kernel ran
    floor_tok_s: float | None = None
    miss_gb_per_token: float = 0.0
    prefetch: str = "—"  # used / prefetched
    same_tokens: bool | None = None  # greedy tokens equal the first strategy's (lossless check)
    divergence: str | None = None  # where they first differ, and how close a tie it was
    layer_step_us: str = "—"  # per decode layer-step, µs: "GPU wait / host work / CPU wait" (host thread)


@dataclass(slots=True, frozen=True)
class Ceilings:
    """Bandwidths measured at the start of the run, in GB/s."""

    h2d: float | None  # pinned host → device
    dram_read: float  # host DRAM, all cores
    cpu_experts: float  # the CPU expert kernel at batch 1, weight bytes

    def miss_gb_s(self) -> float:
        return min((self.h2d or 0.0) + self.cpu_experts, self.dram_read)

    def planner(self, guard: bool = True) -> MissPlanner | None:
        """A miss planner seeded from these rates, as a calibration profile seeds one; None where the run measured
        no link or no CPU kernel rate (the executor's defaults then stand)."""
        return MissPlanner(self.h2d, self.cpu_experts, guard=guard) if self.h2d and self.cpu_experts > 0 else None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def h2d_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float | None:
    """Pinned host → device GB/s (median of 5 copies); None off CUDA."""
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(6):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times[1:]) / 1e9


def measure_ceilings(device: torch.device, expert_format: str, dtype: torch.dtype, mib: int = 1024) -> Ceilings:
    """`mib`: bytes read by each probe; must be well past the last-level cache to measure DRAM."""
    from freetoken.engine.offload.cpu_experts import gpu_host_kernel
    from freetoken.kernels.cpu_experts import bench as kernel_bench
    from freetoken.kernels.cpu_experts.kernel import CpuExpertKernel

    kernel = gpu_host_kernel() if device.type == "cuda" else CpuExpertKernel.get()  # sized as the executor sizes it
    fmt = expert_format if expert_format in ("Q8_0", "MXFP4") else \
        {torch.bfloat16: "BF16", torch.float32: "F32"}.get(dtype, "BF16")
    if kernel is None:
        return Ceilings(h2d_bandwidth(device), float("nan"), float("nan"))
    gen = torch.Generator().manual_seed(0)
    pool = max(8, mib * 2**20 // (3 * kernel_bench.HIDDEN * kernel_bench.INTER * 2) // 8 * 8)
    return Ceilings(h2d_bandwidth(device), kernel_bench.dram_read_gb_s(kernel, mib * 2**20),
                    kernel_bench.expert_gb_s(kernel, fmt, 1, pool, "kernel", gen))


def run_decode(lm, context: int, tokens: int, miss_path: str, graphs: bool = False,
               warmup: int = 0) -> tuple[float, object, object, list[int], list[float]]:
    """Prefills `context` random tokens (copy path), decodes `warmup` untimed steps (the planner and its path
    guard learn this machine, as a running server has), then times `tokens` decode steps from the context's end.

    Decode is teacher-forced with random tokens: a random model's own greedy output quickly repeats one token,
    which would route every step to the same experts and flatter the cache. The argmax of each step is still
    recorded, as the lossless check across strategies."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, lm.args.decoder.vocab_size, (context + tokens,), generator=gen)
    prompt, feed = ids[:context].to(lm.device), ids[context:].tolist()
    warm = torch.randint(0, lm.args.decoder.vocab_size, (warmup,), generator=torch.Generator().manual_seed(1))
    capacity = context + tokens + warmup + 32  # the warm-up's fork copies the context's last page
    cache = lm.new_cache(initial_tokens=capacity, max_tokens=capacity)
    seq = cache.new_sequence()
    executor = lm.experts
    with torch.inference_mode():
        if isinstance(executor, OffloadedExpertExecutor):
            executor.miss_path = "copy"
        for start in range(0, context, 2048):
            lm.forward(prompt[start:start + 2048], cache, seq, "last")
        if isinstance(executor, OffloadedExpertExecutor):
            executor.miss_path = miss_path
        step = _graph_step(lm, cache) if graphs else _eager_step(lm, cache)
        if graphs or warmup:  # on a fork: a sequence with recurrent state cannot be rolled back
            branch = cache.fork(seq)
            for token in ([feed[0]] if graphs else []) + warm.tolist():  # captures the graph outside the timing
                step(branch, token)
            cache.release(branch)
        before = replace(executor.counters) if hasattr(executor, "counters") else None
        kernel_before = _kernel_timing(executor)
        _sync(lm.device)
        cpu_times = host_load.read()
        t0 = time.perf_counter()
        # the host needs each token, as a server does: .tolist() syncs every step; the gap to the runner-up says
        # whether a differing token is a near tie (rounding) or a fault
        top2 = [_top2(step(seq, token)) for token in feed]
        elapsed = time.perf_counter() - t0
        cpu_shares = host_load.shares(cpu_times, host_load.read())
    produced, margins = [t for t, _ in top2], [m for _, m in top2]
    after = replace(executor.counters) if hasattr(executor, "counters") else None
    _print_kernel_timing(kernel_before, _kernel_timing(executor))
    if cpu_shares is not None:  # a row slower than its neighbours on a shared (virtual) host shows steal here
        print(f"  host CPUs over the timed tokens: busy {cpu_shares['busy']:.0%}, idle {cpu_shares['idle']:.0%}, "
              f"steal {cpu_shares['steal']:.1%}", file=sys.stderr, flush=True)
    cache.release(seq)
    return tokens / elapsed, before, after, produced, margins


def _kernel_timing(executor) -> tuple | None:
    """The CPU expert kernel's job timing sums, when this offloaded executor has started it (the resident
    executor keeps its own CPU matrices and never times them)."""
    runner = executor._cpu if isinstance(executor, OffloadedExpertExecutor) else None
    return runner.kernel.timing() if runner is not None and runner.kernel is not None else None


def _print_kernel_timing(before: tuple | None, after: tuple | None) -> None:
    """Where the CPU kernel's jobs of the timed steps spent their time: the workers' wake-up, gate/up, down."""
    if before is None or after is None or not (jobs := after[0] - before[0]):
        return
    first, phase1, total = ((a - b) / jobs * 1e6 for a, b in zip(after[1:], before[1:], strict=True))
    print(f"  CPU kernel, mean of {jobs} jobs: first task {first:.0f} µs after posting, gate/up done at {phase1:.0f}, "
          f"job done at {total:.0f} µs", file=sys.stderr, flush=True)


def _divergence(produced: list[int], margins: list[float], reference: list[int],
                reference_margins: list[float]) -> str | None:
    """The first step whose token differs from the reference's, with both leads over the runner-up (a near tie
    flips on rounding; a wide lead lost points at a fault). Later steps are teacher-forced, so each is judged
    on its own: how many differ is reported too."""
    differ = [i for i, (x, y) in enumerate(zip(produced, reference, strict=True)) if x != y]
    if not differ:
        return None
    i = differ[0]
    return (f"{len(differ)} of {len(produced)} steps differ; first at step {i}: lead over the runner-up "
            f"{margins[i]:.4f} here, {reference_margins[i]:.4f} in the reference row")


def _top2(logits: torch.Tensor) -> tuple[int, float]:
    """(argmax, its lead over the runner-up), one host sync."""
    values, indices = torch.topk(logits.float(), 2)
    (v0, v1), (i0, _) = values.tolist(), indices.tolist()
    return i0, v0 - v1


def _eager_step(lm, cache):
    def step(seq, token: int) -> torch.Tensor:
        return lm.forward(torch.tensor([token], device=lm.device), cache, seq, "last")[0]

    return step


def _graph_step(lm, cache):
    from freetoken.engine.cuda_graphs import GraphedDecoder

    return GraphedDecoder(lm, cache).step


def bench(a: argparse.Namespace) -> tuple[list[Row], Ceilings]:
    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    if device.type == "cuda" and (refusal := resident_rows_refusal(a, dtype, torch.cuda.mem_get_info(device)[0])):
        raise SystemExit(refusal)
    ceilings = measure_ceilings(device, a.expert_format, dtype, a.probe_mib)
    print(f"ceilings: {ceilings}", file=sys.stderr, flush=True)
    lm = build_synthetic(a.shape, device=device, dtype=dtype, expert_cache=0, layers=a.layers, seed=a.seed,
                         skew=a.skew, expert_format=a.expert_format, prefill_ahead=False)  # rows build their own
    host, spec = lm.experts.host, lm.moe_spec
    if a.warmup is None:  # (CPU runs are functional checks of tiny shapes: 32 tokens)
        a.warmup = default_warmup(len(spec.moe_layers)) if device.type == "cuda" else 32
    # recurrent layers are captured with GPU path recurrent-graphs (on unless disabled): else every row is eager;
    # so is every row of a model some layer of which cannot be captured at all
    a.eager_only = lm.decodes_eagerly or (lm.has_recurrent_state and not gpu_paths.enabled("recurrent-graphs"))
    if a.eager_only and "resident-graphs" in a.strategies:
        why = "layers that cannot be captured" if lm.decodes_eagerly else \
            "recurrent layers, which decode without CUDA graphs while FREETOKEN_DISABLE names recurrent-graphs"
        raise SystemExit(f"ft bench decode: {a.shape} has {why}; use the resident strategy as the upper bound "
                         "instead of resident-graphs")
    rows, reference, reference_margins = [], None, []
    for strategy in a.strategies:
        # The cpu path never admits into the cache, so only its budget-0 form (CPU-only) is meaningful.
        budgets = {"resident": ["all"], "resident-graphs": ["all"], "cpu": ["0"]}.get(strategy, a.budgets)
        policies = a.policies if strategy in ("copy", "auto") else a.policies[:1]
        shares = getattr(a, "block_shares", [None]) if strategy in ("copy", "auto") else [None]
        miss_path = strategy.removesuffix("-noprefetch").removesuffix("-noguard")
        for budget, policy, share in ((b, p, s) for b in budgets for p in policies for s in shares):
            if strategy == "hf-accelerate":
                from freetoken.bench.hf_baseline import hf_decode

                tok_s, produced = hf_decode(lm, host, a.context, a.tokens, parse_bytes(budget))
                rows.append(Row(strategy, budget, tok_s, same_tokens=produced == reference if reference else None))
                if reference is None:
                    reference, reference_margins = produced, [float("nan")] * len(produced)
                print(_format_row(rows[-1]), file=sys.stderr, flush=True)
                continue
            if strategy.startswith("resident"):
                executor = ResidentExpertExecutor({layer: _on_device(le, device, dtype) for layer, le in host.items()})
            else:
                executor = build_executor(host, spec, dtype, device, parse_bytes(budget), policy, miss_path,
                                          block_share=share)
                executor.prefetch = strategy in ("auto", "auto-noguard")
                if (seeded := ceilings.planner(guard=strategy != "auto-noguard")) is not None:
                    executor.planner = seeded  # seeded with this run's measurements
            attach_experts(lm.model, executor)
            lm.experts = executor
            # every strategy but the eager `resident` reference decodes through CUDA graphs (segmented when the
            # executor routes on the host), as the engine does
            graphs = device.type == "cuda" and strategy != "resident" and not a.eager_only
            tok_s, before, after, produced, margins = run_decode(lm, a.context, a.tokens, miss_path, graphs=graphs,
                                                                 warmup=a.warmup)
            if reference is None:
                reference, reference_margins = produced, margins
            label = f"{strategy} ({policy})" if strategy in ("copy", "auto") and len(policies) > 1 else strategy
            if len(shares) > 1:
                label += f" (blocks {getattr(executor, 'block_share', 0.0):g})"
            rows.append(_row(label, budget, tok_s, before, after, a.tokens, ceilings, executor))
            rows[-1].same_tokens = produced == reference
            rows[-1].divergence = _divergence(produced, margins, reference, reference_margins)
            print(_format_row(rows[-1]), file=sys.stderr, flush=True)
            if miss_path == "auto":
                print(f"  planner after the run: {executor.planner.describe()}", file=sys.stderr, flush=True)
                if executor.planner.guard is not None:
                    print(f"  path guard's latest windows: {executor.planner.guard.describe_history()}",
                          file=sys.stderr, flush=True)
            if before is not None and (starts := after.cpu_starts - before.cpu_starts):
                delay = (after.cpu_start_delay_seconds - before.cpu_start_delay_seconds) / starts
                print(f"  CPU share started {delay * 1e6:.0f} µs after the routing reached the host (mean of "
                      f"{starts} layer-steps)", file=sys.stderr, flush=True)
            del executor
            lm.experts = None
            attach_experts(lm.model, None)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    _add_resident_work(rows, ceilings, _upper_bound(a))
    return rows, ceilings


WARMUP_LAYER_STEPS = 1536  # the path guard's windows and its searches take ~1,000 layer-steps to settle


def default_warmup(moe_layers: int) -> int:
    """Untimed tokens before a row's timed ones: 32, or enough for WARMUP_LAYER_STEPS on a model truncated to a
    few MoE layers (8-layer runs with 32 had the guard still exploring: V4's auto measured 0.69x copy, 1.12x
    once warmed for 160 tokens)."""
    return max(32, -(-WARMUP_LAYER_STEPS // max(1, moe_layers)))


def resident_rows_refusal(a: argparse.Namespace, dtype: torch.dtype, free_bytes: int) -> str | None:
    """Why the resident rows cannot run, or None: they hold every routed expert dense on the device (block formats
    dequantized), so a shape whose experts outgrow the device's free memory is refused before it is built."""
    if not any(s.startswith("resident") for s in a.strategies):
        return None
    cfg = synthetic_config(a.shape, a.layers, None)
    spec = family_for(cfg["model_type"]).ModelArgs.from_config(cfg).moe_spec()
    need = spec.total_routed_experts * spec.bytes_per_expert(dtype)
    if need <= 0.85 * free_bytes:  # the dense weights, the KV cache and the graphs take the rest
        return None
    return (f"ft bench decode: the resident rows need {need / 1e9:.0f} GB of {str(dtype).removeprefix('torch.')} "
            f"experts on the device, which has {free_bytes / 1e9:.0f} GB free; leave resident and resident-graphs "
            "out of --strategies (the floor then leaves out the work every token needs besides its misses) or "
            "bench fewer --layers")


def _upper_bound(a: argparse.Namespace) -> str:
    """The row whose time per token the floor adds: the resident run decoding as the offloaded rows do."""
    return "resident" if getattr(a, "eager_only", False) else "resident-graphs"


def _add_resident_work(rows: list[Row], ceilings: Ceilings, upper: str = "resident-graphs") -> None:
    """The floor is miss time plus the work every token needs anyway (the resident run's time per token)."""
    resident = next((r for r in rows if r.strategy == upper), None)
    if resident is None or ceilings.miss_gb_s() <= 0:
        return
    for r in rows:
        if r.floor_tok_s is not None:
            r.floor_tok_s = 1 / (1 / resident.tok_s + r.miss_gb_per_token / ceilings.miss_gb_s())


def _on_device(le: LayerExperts | QuantizedExperts, device: torch.device, dtype: torch.dtype) -> LayerExperts:
    """Every expert of a layer, dense on the device (quantized ones dequantized there), with its form (biases,
    activation) on the device too."""
    form = None if le.form is None else le.form.to(device)
    if isinstance(le, LayerExperts):
        return LayerExperts(le.gate_proj.to(device), le.up_proj.to(device), le.down_proj.to(device), form)
    stacks = []
    for p in PROJECTIONS:
        raw = le.raw[p].to(device)
        stacks.append(torch.stack([le.dequantized(e, p, dtype, raw[e]) for e in range(le.num_experts)]))
    return LayerExperts(*stacks, form)


def _row(strategy, budget, tok_s, before, after, tokens, ceilings: Ceilings, executor) -> Row:
    if before is None:
        return Row(strategy, budget, tok_s)
    hits, misses = after.hits - before.hits, after.misses - before.misses
    # a hit on an expert that a prefetch admitted for that very step cost this token its bytes: the floor counts it
    # as the miss it was (without cache slots a used prefetch is counted a miss already)
    prefetch_hits = after.prefetch_hits - before.prefetch_hits
    # slot misses (and prefetches) the block store served cost no host bytes: on the device, like hits
    stored = after.store_hits - before.store_hits
    hits, misses = hits + stored, misses - stored
    copied = (after.bytes_copied - before.bytes_copied) / tokens
    cpu = (after.cpu_experts - before.cpu_experts) * executor.expert_bytes / tokens
    miss_bytes = max(misses + prefetch_hits, 0) * executor.expert_bytes / tokens
    floor = ceilings.miss_gb_s() * 1e9 / miss_bytes if miss_bytes and ceilings.miss_gb_s() > 0 else None
    copy_s, cpu_s = after.copy_seconds - before.copy_seconds, after.cpu_seconds - before.cpu_seconds
    prefetched, used = after.prefetched - before.prefetched, after.prefetch_used - before.prefetch_used
    prefetch = f"{used / prefetched:.0%} of {prefetched / tokens:.1f}" if prefetched else "—"
    if warmed := after.cpu_warmed - before.cpu_warmed:  # GPU path cpu-warm: the CPU's predicted share read ahead
        prefetch += f"; CPU warmed {(after.cpu_warm_used - before.cpu_warm_used) / warmed:.0%} of {warmed / tokens:.1f}"
    return Row(strategy, budget, tok_s, hits / max(hits + misses, 1), (hits - prefetch_hits) / max(hits + misses, 1),
               copied / 1e9, cpu / 1e9,
               copied * tokens / copy_s / 1e9 if copy_s > 0 else None,
               cpu * tokens / cpu_s / 1e9 if cpu_s > 0 else None, floor, miss_bytes / 1e9, prefetch,
               layer_step_us=_layer_step_us(before, after))


def _layer_step_us(before, after) -> str:
    """Mean µs per decode layer-step the host thread spent waiting for the GPU (the routing), working, and
    waiting for the CPU share: where the step's critical path runs."""
    steps = after.layer_steps - before.layer_steps
    if not steps:
        return "—"
    parts = (after.gpu_wait_seconds - before.gpu_wait_seconds, after.host_seconds - before.host_seconds,
             after.cpu_wait_seconds - before.cpu_wait_seconds)
    return " / ".join(f"{v / steps * 1e6:.0f}" for v in parts)


def _format_row(r: Row) -> str:
    hit = "—" if r.hit_rate is None else f"{r.hit_rate:.1%}"
    if r.hit_rate_cached is not None and r.hit_rate_cached != r.hit_rate:
        hit += f" ({r.hit_rate_cached:.1%})"
    floor = "—" if r.floor_tok_s is None else f"{r.floor_tok_s:.2f}"
    of_floor = "—" if r.floor_tok_s is None else f"{r.tok_s / r.floor_tok_s:.0%}"
    same = {True: "yes", False: "no", None: "—"}[r.same_tokens]
    pcie, cpu = ("—" if v is None else f"{v:.1f}" for v in (r.pcie_gb_s, r.cpu_gb_s))
    return (f"| {r.strategy} | {r.budget} | {r.tok_s:.2f} | {hit} | {r.copied_gb_per_token:.3f} | "
            f"{r.cpu_gb_per_token:.3f} | {pcie} | {cpu} | {r.prefetch} | {floor} | {of_floor} | {same} | "
            f"{r.layer_step_us} |")


def _routing(skew: float) -> str:
    return f"router skewed to Zipf-like popularity (s={skew})" if skew else "near-uniform routing"


def result_header(title: str, verb: str, a: argparse.Namespace) -> list[str]:
    """The first lines of every `ft bench` result: what ran where, when, at which commit, by which command."""
    device = torch.cuda.get_device_name(a.device) if a.device.startswith("cuda") else "CPU"
    layers = a.layers or SHAPES[a.shape]["num_hidden_layers"]
    return [
        f"# {title}, synthetic {a.shape} ({layers} layers), {a.dtype}"
        f"{f', {a.expert_format} experts in host memory' if a.expert_format != 'dense' else ''}, {device}",
        "",
        f"- date: {dt.date.today().isoformat()}; torch {torch.__version__}; commit: {a.commit}",
        f"- command: `{shlex.join(['ft', 'bench', verb, *a.argv])}`",
    ]


_NO_RESIDENT_FLOOR = (" (no resident-graphs row in this run: the work every token needs besides its misses is left "
                      "out, so this floor is optimistic)")


def render(rows: list[Row], a: argparse.Namespace, ceilings: Ceilings) -> str:
    upper = _upper_bound(a)
    has_resident = any(r.strategy == upper for r in rows)
    how = ("every row decodes eagerly (layers with recurrent state are not captured in CUDA graphs)"
           if getattr(a, "eager_only", False) else
           "on CUDA every row but `resident` decodes through CUDA graphs (cut at each expert call when experts are "
           "offloaded)")
    lines = [
        *result_header("Decode", "decode", a),
        f"- context {a.context} tokens (random ids), {a.tokens} decode tokens timed after {a.warmup} untimed, "
        f"greedy; random weights, "
        f"{_routing(a.skew)}; decode teacher-forced with random tokens; {how}",
        f"- measured in this run: pinned host→device {_gb(ceilings.h2d)}, host DRAM read {_gb(ceilings.dram_read)}, "
        f"CPU expert kernel {_gb(ceilings.cpu_experts)} (batch 1); floor = "
        f"{upper + ' time + ' if has_resident else ''}miss bytes (misses and hits on experts a prefetch admitted "
        f"for that step: the hit rate in brackets leaves those out) / min(PCIe + CPU, DRAM) = "
        f"{_gb(ceilings.miss_gb_s())}"
        f"{'' if has_resident else _NO_RESIDENT_FLOOR}",
        "",
        "| strategy | expert budget | decode tok/s | hit rate | GB copied / token | GB read by CPU / token | "
        "PCIe GB/s while copying | CPU GB/s while computing | prefetches used (per token) | floor tok/s | "
        "of floor | same tokens as first row | µs per layer-step: GPU wait / host / CPU wait |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |",
        *(_format_row(r) for r in rows),
    ]
    diverged = [f"- {r.strategy}, budget {r.budget}: {r.divergence}" for r in rows if r.divergence]
    if diverged:
        lines += ["", "Rows whose greedy tokens differ from the first row's:", *diverged]
    return "\n".join(lines) + "\n"


def _gb(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f} GB/s"


def add_run_args(p: argparse.ArgumentParser) -> None:
    """The options of every synthetic-model `ft bench` run besides the model: seed, expert format, result."""
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--expert-format", default="dense", choices=["dense", "Q8_0", "MXFP4"],
                   help="host-memory format of the experts (dense = --dtype)")
    p.add_argument("--commit", default="unknown", help="commit hash to record in the result")
    p.add_argument("--out", type=Path, default=None, help="write the Markdown table here")


def emit(table: str, out: Path | None) -> int:
    """Prints the result table and writes it to `out` if given."""
    print(table)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(table)
    return 0


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The options every `ft bench` shares: which synthetic model, how many layers, where, in which dtype."""
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    p.add_argument("--layers", type=int, default=None, help="truncate the model to this many layers")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="ft bench decode", description=__doc__.splitlines()[0])
    add_model_args(p)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed decode tokens first (the planner's online fit settles, and the path guard measures "
                        "the pure ways and searches the split's bias: ~1,000 layer-steps, about 20 tokens of a "
                        "48-layer model); default: 32, on CUDA as many as give 1,536 layer-steps where there are "
                        "fewer MoE layers")
    p.add_argument("--budgets", default="0,8GiB,16GiB", help="comma-separated expert-cache sizes")
    p.add_argument("--strategies", default="resident,copy,cpu,auto",
                   help="comma-separated: resident, resident-graphs (CUDA only), copy, cpu, auto, auto-noprefetch, "
                        "auto-noguard (the planner's split always, no path guard), "
                        "hf-accelerate (transformers + accelerate offload of the same weights; writes them to disk)")
    p.add_argument("--policies", default="freq", help="comma-separated expert-cache policies: freq, lru")
    p.add_argument("--block-shares", default="default",
                   help="comma-separated shares of the budget that keep quantized experts in their block format on "
                        "the device (0 to 1; 'default': the engine's), one row each for copy and auto")
    add_run_args(p)
    p.add_argument("--skew", type=float, default=0.0,
                   help="Zipf exponent of expert popularity (0: near-uniform routing, the pessimistic case)")
    p.add_argument("--probe-mib", type=int, default=1024,
                   help="MiB each bandwidth probe reads (far past the last-level cache)")
    a = p.parse_args(argv)
    a.argv, a.budgets, a.strategies = argv, a.budgets.split(","), a.strategies.split(",")
    a.policies = a.policies.split(",")
    a.block_shares = [None if v == "default" else float(v) for v in a.block_shares.split(",")]
    rows, ceilings = bench(a)
    return emit(render(rows, a, ceilings), a.out)
