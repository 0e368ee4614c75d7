"""`OffloadedExpertExecutor`: every routed expert in host memory, the hot ones in a slot cache on the device.

Per layer and step: the experts the tokens route to are looked up; hits compute from their slot. Misses take one
of two paths, both reading host DRAM, run at the same time:
- copy: fetched into a cache slot (the policy picks the victim; experts of the current step are never evicted) on
  a side stream, each computed as soon as its own bytes land; when the cache cannot take one (budget 0, or a
  prefill touching every expert) it streams through double-buffered staging instead;
- cpu: computed on the host where it lives by a worker thread, while the GPU works; only activations cross.
`miss_path` "copy" or "cpu" forces one path (the naive and CPU-only baselines); "auto" lets the `MissPlanner`
split each layer's misses from bandwidths it keeps measuring. Results equal the resident executor's: the same
weights and function, only where they are computed differs.

Shapes: S slots, E experts, N tokens, H hidden.
"""

from __future__ import annotations

import logging

import torch

from freetoken.engine.experts import ExpertGroup, LayerExperts, group_by_expert, run_groups
from freetoken.engine.offload.cpu_experts import CpuExpertRunner
from freetoken.engine.offload.expert_cache import ExpertCache
from freetoken.engine.offload.planner import MissPlanner
from freetoken.engine.offload.policy import make_policy
from freetoken.engine.offload.quantized import QuantizedExperts
from freetoken.engine.offload.transfer import ExpertCopier

log = logging.getLogger(__name__)

# Seeds for the planner when this machine has no calibration profile; the online fit replaces them in a few steps.
DEFAULT_COPY_GB_S, DEFAULT_CPU_GB_S = 20.0, 10.0


class OffloadedExpertExecutor:
    capturable = False  # looks routing up on the host every layer

    MISS_PATHS = ("auto", "copy", "cpu")

    def __init__(self, host: dict[int, LayerExperts | QuantizedExperts], device: torch.device, num_slots: int,
                 policy: str = "freq", miss_path: str = "auto", dtype: torch.dtype | None = None,
                 planner: MissPlanner | None = None):
        if miss_path not in self.MISS_PATHS:
            raise ValueError(f"miss_path must be one of {self.MISS_PATHS}, got {miss_path!r}")
        first = next(iter(host.values()))
        self.host, self.device, self.miss_path = host, torch.device(device), miss_path
        self.num_experts = first.num_experts
        self.dtype = dtype or first.gate_proj.dtype
        self.copier = ExpertCopier(host, self.device, self.dtype)
        self.expert_bytes = self.copier.expert_bytes
        self.cache = ExpertCache(num_slots, make_policy(policy))
        self.slots = self.copier.allocate(num_slots)
        self.planner = planner or MissPlanner(DEFAULT_COPY_GB_S, DEFAULT_CPU_GB_S)
        self._cpu: CpuExpertRunner | None = None  # started on first use: a thread pool and maybe a compile

    @property
    def counters(self):
        return self.cache.counters

    @property
    def cpu(self) -> CpuExpertRunner:
        if self._cpu is None:
            self._cpu = CpuExpertRunner(self.host, self.dtype, share_cores=self.device.type == "cuda")
        return self._cpu

    def forward(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        for nbytes, seconds in self.copier.finished_timings():
            self.planner.observe_copy(nbytes, seconds)
        groups = group_by_expert(topk_ids, topk_weights, self.num_experts, hidden.dtype)
        self.cache.begin_step((layer, g.expert) for g in groups)
        hits, misses = [], []
        for g in groups:
            slot = self.cache.lookup((layer, g.expert))
            (misses if slot is None else hits).append((g, slot))
        to_copy, to_cpu = self._plan([g for g, _ in misses])
        on_cpu = self.cpu.submit(layer, hidden, to_cpu) if to_cpu else None
        out = self._copy_and_compute(layer, hidden, hits, to_copy)
        if on_cpu is not None:
            y, seconds = on_cpu.result()
            self.planner.observe_cpu(len(to_cpu) * self.expert_bytes, seconds)
            self.counters.cpu_experts += len(to_cpu)
            out += y.to(hidden.device, hidden.dtype, non_blocking=True)
        return out

    def _plan(self, misses: list[ExpertGroup]) -> tuple[list[ExpertGroup], list[ExpertGroup]]:
        if not misses or self.miss_path == "copy":
            return misses, []
        if self.miss_path == "cpu":
            return [], misses
        split = self.planner.split(misses, self.expert_bytes, tokens_of=lambda g: len(g.tokens),
                                   min_copy=len(self.cache.free_slots))
        return split.copy, split.cpu

    def _copy_and_compute(self, layer: int, hidden: torch.Tensor, hits: list, to_copy: list[ExpertGroup]):
        """Issues the copies first (side stream), computes the hits meanwhile, then each copied expert once its
        bytes have landed. Staged experts are interleaved so at most two staging buffers are in flight."""
        copier = self.copier
        copier.begin()
        cached, staged = [], []
        for g in to_copy:
            admitted = self.cache.admit((layer, g.expert))
            if admitted is None:
                staged.append(g)
            else:
                cached.append((g, admitted[0], copier.to_slot(layer, g.expert, self.slots, admitted[0])))
        ring = copier.staging_buffers
        in_flight = [(g, *copier.to_staging(layer, g.expert)) for g in staged[:ring]]
        slot_of = {g.expert: slot for g, slot in hits}
        out = run_groups(hidden, [g for g, _ in hits], lambda e: self.slots.weights_of(slot_of[e]))
        for g, slot, done in cached:
            copier.wait(done)
            out += run_groups(hidden, [g], lambda e, s=slot: self.slots.weights_of(s))
        for i, g in enumerate(staged):
            _, buffer, done = in_flight[i]
            copier.wait(done)
            out += run_groups(hidden, [g], lambda e, b=buffer: copier.staging.weights_of(b))
            copier.release(buffer)
            if i + ring < len(staged):
                nxt = staged[i + ring]
                in_flight.append((nxt, *copier.to_staging(layer, nxt.expert)))
        copier.end()  # the copy stream holds only copies, so this marks the last one's completion
        self.counters.bytes_copied += len(to_copy) * self.expert_bytes
        return out

    def resize(self, num_slots: int) -> None:
        """Changes the number of device slots while serving: shrinking evicts the coldest experts, growing keeps
        every cached one. Weights are never reloaded: survivors are moved between slots on the device."""
        moves = self.cache.resize(num_slots)
        new = self.copier.allocate(num_slots)
        moved_from = {new_slot: old for _, old, new_slot in moves}
        for new_slot in self.cache.slot_of.values():
            old = moved_from.get(new_slot, new_slot)
            for d, s in zip(new.weights_of(new_slot), self.slots.weights_of(old), strict=True):
                d.copy_(s)
        self.slots = new
