"""One read-only snapshot of what the engine is doing: expert cache and KV pages. The dashboard, `/v1/stats`
and the benchmarks read this rather than reaching into executors and caches themselves."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from freetoken.engine.kv_cache import PagedKVCache
from freetoken.engine.offload.executor import OffloadedExpertExecutor


@dataclass(slots=True, frozen=True)
class ExpertStats:
    mode: str  # "resident", "offloaded" or "none" (dense model)
    slots: int = 0
    cached: int = 0
    total_experts: int = 0
    slot_bytes: int = 0  # device bytes one slot takes
    host_bytes_per_expert: int = 0  # bytes one miss moves
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    rejected: int = 0
    cpu_experts: int = 0
    bytes_copied: int = 0
    copy_seconds: float = 0.0
    cpu_seconds: float = 0.0
    prefetched: int = 0
    prefetch_used: int = 0
    layer_steps: int = 0  # decode layer-steps of the host thread, and where their time went:
    gpu_wait_seconds: float = 0.0  # waiting for the routing
    host_seconds: float = 0.0  # planning and queueing
    cpu_wait_seconds: float = 0.0  # waiting for the CPU share
    cpu_starts: int = 0  # layer-steps that started a CPU share, and the routing-to-start delay summed over them
    cpu_start_delay_seconds: float = 0.0
    step_cpu_experts: int = 0  # the CPU kernel within decode layer-steps: experts and its time on them
    step_cpu_seconds: float = 0.0
    miss_path: str = ""  # "auto", "copy" or "cpu" (offloaded)
    # auto: the way the path guard uses ("split", "cpu", "copy") and its measured seconds per miss of each way
    guard_way: str = ""
    guard_seconds_per_miss: dict[str, float] = field(default_factory=dict)
    # the dashboard's grid: one string per MoE layer, a character per expert: "#" on the device, "+" not on it but
    # routed to in the last HOT_TOKENS tokens, "." neither; and each layer's hit rate so far
    grid: list[str] = field(default_factory=list)
    layer_hit_rate: list[float] = field(default_factory=list)
    pinned_layers: list[int] = field(default_factory=list)  # layers whose experts are kept on the device
    grid_layers: list[int] = field(default_factory=list)  # the model layer of each grid row
    guard_bias: int = 0  # experts a step the guard's search moves to the CPU beyond the planner's split (auto)
    # the guard's windows closed so far, and its latest ones: [way, bias, µs per miss (None: hits only), steps,
    # misses, median step µs] (what a turn's decode measured; `ft eval` records a turn's own)
    guard_windows_closed: int = 0
    guard_windows: list = field(default_factory=list)
    # the block store (quantized experts kept in their block format on the device): rows, experts held, and the
    # slot misses it served (counted in `misses` too: no link bytes, a dequantizing launch)
    block_rows: int = 0
    block_cached: int = 0
    store_hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / (self.hits + self.misses) if self.hits + self.misses else 0.0


@dataclass(slots=True, frozen=True)
class KVStats:
    page_size: int
    pages_total: int
    pages_free: int
    pages_cached: int = 0  # kept by the prefix cache for later prompts (given back when the pool needs them)
    prefix_lookups: int = 0  # prompts looked up in the prefix cache
    prefix_hit_tokens: int = 0  # prompt tokens whose K/V were reused
    snapshots: int = 0  # recurrent models: whole sequences kept for later prompts (state_snapshots.py)
    prefix_tree: list = field(default_factory=list)  # PrefixCache.tree(): the cached prefixes and their forks


@dataclass(slots=True)
class MemoryStats:
    """Where the device's memory goes (bytes). On CUDA: `other` is what other processes hold (NVML's process list,
    else the device's used memory beyond what torch holds), `activations` what torch holds beyond weights, experts
    and KV (activations, graph pools, its allocator's slack). On the CPU the same split of the host's RAM."""

    device: str
    total: int
    free: int
    weights: int
    experts: int
    kv: int
    activations: int
    other: int
    # where `other` comes from: "nvml" (the driver's process list), "estimate" (used beyond what torch holds: also
    # counts this process's CUDA context), "host" (the rest of the system's RAM)
    other_from: str = "estimate"


@dataclass(slots=True, frozen=True)
class EngineStats:
    device: str
    dtype: str
    experts: ExpertStats
    kv: KVStats | None
    memory: MemoryStats | None = None

    def as_dict(self) -> dict:
        d = asdict(self)
        d["experts"]["hit_rate"] = self.experts.hit_rate
        return d


def _block_store(ex: OffloadedExpertExecutor) -> dict[str, int]:
    store = ex.copier.store
    if store is None:
        return {}
    return {"block_rows": store.capacity, "block_cached": len(store.cache.slot_of),
            "store_hits": ex.counters.store_hits}


def _guard_windows(guard) -> dict:
    if guard is None:
        return {}
    windows = [[way, bias, None if per_miss is None else round(per_miss * 1e6, 1), steps, misses,
                round(median * 1e6, 1)] for way, bias, per_miss, steps, misses, median in guard.history]
    return {"guard_windows_closed": guard.windows_closed, "guard_windows": windows}


def snapshot(lm, cache: PagedKVCache | None = None, prefix=None, snapshots=None) -> EngineStats:
    """`prefix`: the prefix cache, or `snapshots` (recurrent models' StateSnapshots) where there is none."""
    spec, ex = lm.moe_spec, lm.experts
    if spec is None:
        experts = ExpertStats("none")
    elif isinstance(ex, OffloadedExpertExecutor):
        c, guard = ex.counters, ex.planner.guard
        slot_bytes = spec.bytes_per_expert(ex.dtype)
        experts = ExpertStats("offloaded", ex.cache.capacity, len(ex.cache.slot_of), spec.total_routed_experts,
                              slot_bytes, ex.expert_bytes, c.hits, c.misses, c.evictions, c.rejected, c.cpu_experts,
                              c.bytes_copied, c.copy_seconds, c.cpu_seconds, c.prefetched, c.prefetch_used,
                              c.layer_steps, c.gpu_wait_seconds, c.host_seconds, c.cpu_wait_seconds,
                              c.cpu_starts, c.cpu_start_delay_seconds, c.step_cpu_experts, c.step_cpu_seconds,
                              ex.miss_path,
                              guard.best if guard is not None and ex.miss_path == "auto" else "",
                              dict(guard.seconds_per_miss) if guard is not None else {},
                              *_grid(spec, ex.cache, ex.copier.store),
                              sorted({key[0] for key in tuple(ex.cache.pinned)}), list(spec.moe_layers),
                              guard_bias=guard.best_bias if guard is not None and ex.miss_path == "auto" else 0,
                              **_guard_windows(guard if ex.miss_path == "auto" else None),
                              **_block_store(ex))
    else:
        total = spec.total_routed_experts
        experts = ExpertStats("resident", total, total, total, spec.bytes_per_expert(lm.dtype),
                              grid=["#" * spec.num_experts for _ in spec.moe_layers], grid_layers=list(spec.moe_layers))
    kv = None
    if cache is not None:
        if prefix is not None:
            reuse = (len(prefix), prefix.lookups, prefix.hit_tokens, 0)
        elif snapshots is not None:
            reuse = (0, snapshots.lookups, snapshots.hit_tokens, len(snapshots))
        else:
            reuse = ()
        kv = KVStats(cache.page_size, cache.allocator.num_pages, cache.allocator.num_free, *reuse,
                     prefix_tree=prefix.tree() if prefix is not None else [])
    return EngineStats(str(lm.device), str(lm.dtype).removeprefix("torch."), experts, kv,
                       memory_stats(lm, experts, cache))


HOT_TOKENS = 16


def _grid(spec, cache, store=None) -> tuple[list[str], list[float]]:
    """`store`: the block store, whose experts are on the device too."""
    hot_after = cache.steps - HOT_TOKENS * len(spec.moe_layers)
    stored = store.cache.slot_of if store is not None else {}
    grid, rates = [], []
    for layer in spec.moe_layers:
        row = []
        for e in range(spec.num_experts):
            key = (layer, e)
            on_device = key in cache.slot_of or key in stored
            row.append("#" if on_device else "+" if cache.last_used.get(key, -1) > hot_after else ".")
        grid.append("".join(row))
        hits, misses = cache.layer_counts.get(layer, (0, 0))
        rates.append(hits / (hits + misses) if hits + misses else 0.0)
    return grid, rates


def memory_stats(lm, experts: ExpertStats, cache: PagedKVCache | None) -> MemoryStats:
    import torch

    from freetoken.engine.offload.budget import kv_bytes_per_token

    weights = sum(p.numel() * p.element_size() for p in lm.model.parameters())
    expert_bytes = experts.slots * experts.slot_bytes + experts.block_rows * experts.host_bytes_per_expert \
        if experts.mode != "none" else 0
    kv = cache.allocator.num_pages * cache.page_size * kv_bytes_per_token(lm.args, lm.dtype) if cache else 0
    ours = weights + expert_bytes + kv
    if lm.device.type == "cuda":
        from freetoken.engine import nvml

        free, total = torch.cuda.mem_get_info(lm.device)
        reserved = torch.cuda.memory_reserved(lm.device)
        bus = nvml.bus_id_of(lm.device)
        other = nvml.other_processes_bytes(bus) if bus else None  # NVML's process list where it has one
        return MemoryStats(str(lm.device), total, free, weights, expert_bytes, kv, max(0, reserved - ours),
                           max(0, total - free - reserved) if other is None else other,
                           "estimate" if other is None else "nvml")
    total, free = _host_memory()
    return MemoryStats("host", total, free, weights, expert_bytes, kv, 0, max(0, total - free - ours), "host")


def _host_memory() -> tuple[int, int]:
    """(total, available) bytes of host RAM, from /proc/meminfo where there is one."""
    try:
        fields = dict(line.split(":", 1) for line in open("/proc/meminfo"))
        return int(fields["MemTotal"].split()[0]) * 1024, int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return 0, 0
