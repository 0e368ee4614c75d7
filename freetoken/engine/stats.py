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
    miss_path: str = ""  # "auto", "copy" or "cpu" (offloaded)
    # auto: the way the path guard uses ("split", "cpu", "copy") and its measured seconds per miss of each way
    guard_way: str = ""
    guard_seconds_per_miss: dict[str, float] = field(default_factory=dict)

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


@dataclass(slots=True, frozen=True)
class EngineStats:
    device: str
    dtype: str
    experts: ExpertStats
    kv: KVStats | None

    def as_dict(self) -> dict:
        d = asdict(self)
        d["experts"]["hit_rate"] = self.experts.hit_rate
        return d


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
                              c.layer_steps, c.gpu_wait_seconds, c.host_seconds, c.cpu_wait_seconds, ex.miss_path,
                              guard.best if guard is not None and ex.miss_path == "auto" else "",
                              dict(guard.seconds_per_miss) if guard is not None else {})
    else:
        total = spec.total_routed_experts
        experts = ExpertStats("resident", total, total, total, spec.bytes_per_expert(lm.dtype))
    kv = None
    if cache is not None:
        if prefix is not None:
            reuse = (len(prefix), prefix.lookups, prefix.hit_tokens, 0)
        elif snapshots is not None:
            reuse = (0, snapshots.lookups, snapshots.hit_tokens, len(snapshots))
        else:
            reuse = ()
        kv = KVStats(cache.page_size, cache.allocator.num_pages, cache.allocator.num_free, *reuse)
    return EngineStats(str(lm.device), str(lm.dtype).removeprefix("torch."), experts, kv)
