"""`OffloadedExpertExecutor`: every routed expert in host memory, the hot ones in a slot cache on the device.

Per layer and step: the experts the tokens route to are looked up; hits compute from their slot, misses are
copied into a slot (the policy picks the victim; experts of the current step are never evicted) and computed
there. When the cache has fewer free-able slots than the step needs (budget 0, or a prefill touching every
expert), the remaining experts stream through one staging buffer. Results equal the resident executor's: the
same weights, the same arithmetic, only their location differs.

Misses take one of two paths (`miss_path`): "copy" fetches the expert into the cache, "cpu" computes it on the
host where it lives, sending only activations (the CPU-only strategy when the cache has no slots). Choosing
between them per miss from measured bandwidths is the planner's job, built on these two paths. Copies are issued
on the compute stream, so they do not yet overlap compute.

Shapes: S slots, E experts, H hidden, I expert intermediate.
"""

from __future__ import annotations

import logging

import torch

from freetoken.engine.experts import ExpertGroup, LayerExperts, group_by_expert, run_groups
from freetoken.engine.offload.expert_cache import ExpertCache
from freetoken.engine.offload.policy import make_policy
from freetoken.engine.offload.quantized import PROJECTIONS, QuantizedExperts

log = logging.getLogger(__name__)


def _expert_shapes(layer: LayerExperts | QuantizedExperts) -> dict[str, tuple[int, int]]:
    if isinstance(layer, QuantizedExperts):
        return dict(layer.shapes)
    return {p: tuple(getattr(layer, p).shape[1:]) for p in PROJECTIONS}


class OffloadedExpertExecutor:
    capturable = False  # looks routing up on the host every layer

    MISS_PATHS = ("copy", "cpu")

    def __init__(self, host: dict[int, LayerExperts | QuantizedExperts], device: torch.device, num_slots: int,
                 policy: str = "freq", miss_path: str = "copy", dtype: torch.dtype | None = None):
        if miss_path not in self.MISS_PATHS:
            raise ValueError(f"miss_path must be one of {self.MISS_PATHS}, got {miss_path!r}")
        first = next(iter(host.values()))
        self.host, self.device, self.miss_path = host, torch.device(device), miss_path
        self.num_experts = first.num_experts
        self.dtype = dtype or first.gate_proj.dtype
        self.shapes = _expert_shapes(first)
        self.cache = ExpertCache(num_slots, make_policy(policy))
        self.slots = self._allocate(num_slots)
        self.staging = self._allocate(1)
        if isinstance(first, QuantizedExperts):  # raw bytes land here before being dequantized into a slot
            self.raw_staging = {p: torch.empty(first.raw[p].shape[1], dtype=torch.uint8, device=self.device)
                                for p in PROJECTIONS}
            self.expert_bytes = first.expert_nbytes()
        else:
            self.expert_bytes = sum(first.weights_of(0)[i].numel() for i in range(3)) * self.dtype.itemsize

    def _allocate(self, n: int) -> LayerExperts:
        return LayerExperts(*(torch.empty((n, *self.shapes[p]), dtype=self.dtype, device=self.device)
                              for p in PROJECTIONS))

    @property
    def counters(self):
        return self.cache.counters

    def forward(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        groups = group_by_expert(topk_ids, topk_weights, self.num_experts, hidden.dtype)
        self.cache.begin_step((layer, g.expert) for g in groups)
        cached: dict[int, int] = {}
        missed: list[ExpertGroup] = []
        for g in groups:
            slot = self._slot_for(layer, g.expert)
            if slot is None:
                missed.append(g)
            else:
                cached[g.expert] = slot
        out = run_groups(hidden, [g for g in groups if g.expert in cached],
                         lambda e: self.slots.weights_of(cached[e]))
        if missed and self.miss_path == "cpu":
            out += self._on_cpu(layer, hidden, missed)
        for g in missed if self.miss_path == "copy" else ():  # the cache could not hold this step's experts
            self._copy(layer, g.expert, self.staging, 0)
            out += run_groups(hidden, [g], lambda e: self.staging.weights_of(0))
        return out

    def _on_cpu(self, layer: int, hidden: torch.Tensor, groups: list[ExpertGroup]) -> torch.Tensor:
        """Computes missed experts where their weights live; only activations cross the link."""
        host = self.host[layer]
        cpu_groups = [ExpertGroup(g.expert, g.tokens.cpu(), g.weights.cpu()) for g in groups]
        self.cache.counters.cpu_experts += len(groups)
        weights_of = host.weights_of if isinstance(host, LayerExperts) else \
            (lambda e: host.weights_of(e, self.dtype))
        return run_groups(hidden.to("cpu"), cpu_groups, weights_of).to(hidden.device)

    def _slot_for(self, layer: int, expert: int) -> int | None:
        slot = self.cache.lookup((layer, expert))
        if slot is not None or self.miss_path == "cpu":
            return slot
        admitted = self.cache.admit((layer, expert))
        if admitted is None:
            return None
        slot, _ = admitted
        self._copy(layer, expert, self.slots, slot)
        return slot

    def _copy(self, layer: int, expert: int, dest: LayerExperts, slot: int) -> None:
        src = self.host[layer]
        if isinstance(src, QuantizedExperts):
            for p, d in zip(PROJECTIONS, dest.weights_of(slot), strict=True):
                raw = self.raw_staging[p]
                raw.copy_(src.raw[p][expert], non_blocking=True)  # only the block-format bytes cross the link
                d.copy_(src.dequantized(expert, p, self.dtype, raw))
        else:
            for d, s in zip(dest.weights_of(slot), src.weights_of(expert), strict=True):
                d.copy_(s, non_blocking=True)  # pinned host memory → asynchronous DMA on the compute stream
        self.cache.counters.bytes_copied += self.expert_bytes

    def resize(self, num_slots: int) -> None:
        """Changes the number of device slots while serving: shrinking evicts the coldest experts, growing keeps
        every cached one. Weights are never reloaded: survivors are moved between slots on the device."""
        moves = self.cache.resize(num_slots)
        new = self._allocate(num_slots)
        moved_from = {new_slot: old for _, old, new_slot in moves}
        for new_slot in self.cache.slot_of.values():
            old = moved_from.get(new_slot, new_slot)
            for d, s in zip(new.weights_of(new_slot), self.slots.weights_of(old), strict=True):
                d.copy_(s)
        self.slots = new
