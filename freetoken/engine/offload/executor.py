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

from freetoken.engine.experts import (
    ExpertGroup,
    LayerExperts,
    gathered_expert_forward,
    group_by_expert,
    run_groups,
)
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
                 planner: MissPlanner | None = None, staging_slots: int = 16):
        if miss_path not in self.MISS_PATHS:
            raise ValueError(f"miss_path must be one of {self.MISS_PATHS}, got {miss_path!r}")
        first = next(iter(host.values()))
        self.host, self.device, self.miss_path = host, torch.device(device), miss_path
        self.num_experts = first.num_experts
        self.dtype = dtype or first.gate_proj.dtype
        self.copier = ExpertCopier(host, self.device, self.dtype, max(2, staging_slots))
        self.expert_bytes = self.copier.expert_bytes
        self.cache = ExpertCache(num_slots, make_policy(policy))
        self.slots = self._allocate_slots(num_slots)
        self.planner = planner or MissPlanner(DEFAULT_COPY_GB_S, DEFAULT_CPU_GB_S)
        # Small batches (decode) gather their experts' slots into one batched matmul: a few launches per layer
        # instead of several per expert. On the CPU the gather would copy weights for nothing.
        self.gather_small_batches = self.device.type == "cuda"
        self._cpu: CpuExpertRunner | None = None  # started on first use: a thread pool and maybe a compile

    def _allocate_slots(self, capacity: int) -> LayerExperts:
        """[cache slots | staging slots | one zero slot]. The zero slot stands in for pairs computed elsewhere
        (on the CPU): a zero expert contributes exactly nothing, where uninitialised memory could hold NaNs."""
        slots = self.copier.allocate(capacity + self.copier.staging_slots + 1)
        for t in slots.weights_of(-1):
            t.zero_()
        return slots

    @property
    def staging_first(self) -> int:
        return self.cache.capacity

    @property
    def zero_slot(self) -> int:
        return self.cache.capacity + self.copier.staging_slots

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
            self.counters.copy_seconds += seconds
        if self.gather_small_batches and topk_ids.numel() <= self.copier.staging_slots:
            return self._forward_gathered(layer, hidden, topk_ids, topk_weights)
        return self._forward_grouped(layer, hidden, topk_ids, topk_weights)

    # -- small batches: one host sync, the copies, one gathered matmul --

    def _forward_gathered(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
                          topk_weights: torch.Tensor) -> torch.Tensor:
        ids = topk_ids.tolist()
        tokens_of: dict[int, list[int]] = {}
        for t, row in enumerate(ids):
            for e in row:
                tokens_of.setdefault(e, []).append(t)
        self.cache.begin_step((layer, e) for e in tokens_of)
        slot_of, misses = {}, []
        for e in tokens_of:
            slot = self.cache.lookup((layer, e))
            if slot is None:
                misses.append(e)
            else:
                slot_of[e] = slot
        to_copy, to_cpu = self._plan(misses, lambda e: len(tokens_of[e]))
        on_cpu = self._submit_cpu(layer, hidden, to_cpu, ids, topk_weights)
        copier = self.copier
        copier.begin()
        staged = []
        for e in to_copy:  # at most N*K ≤ staging_slots experts, so the staging ring never wraps here
            admitted = self.cache.admit((layer, e))
            if admitted is None:
                ring, _ = copier.to_staging(layer, e, self.slots, self.staging_first)
                slot_of[e] = self.staging_first + ring
                staged.append(ring)
            else:
                slot_of[e] = admitted[0]
                copier.to_slot(layer, e, self.slots, admitted[0])
        copier.end()
        copier.wait_all()
        slot_map = torch.tensor([[slot_of.get(e, self.zero_slot) for e in row] for row in ids])
        out = gathered_expert_forward(self.slots, hidden, slot_map.to(hidden.device, non_blocking=True),
                                      topk_weights)
        copier.release(*staged)
        self.counters.bytes_copied += len(to_copy) * self.expert_bytes
        return self._add_cpu(out, on_cpu, len(to_cpu))

    def _submit_cpu(self, layer: int, hidden: torch.Tensor, experts: list[int], ids: list[list[int]],
                    topk_weights: torch.Tensor):
        if not experts:
            return None
        weights = topk_weights.float().cpu()
        groups = []
        for e in experts:
            pairs = [(t, k) for t, row in enumerate(ids) for k, x in enumerate(row) if x == e]
            groups.append(ExpertGroup(e, torch.tensor([t for t, _ in pairs]),
                                      torch.stack([weights[t, k] for t, k in pairs])))
        return self.cpu.submit(layer, hidden, groups)

    def _add_cpu(self, out: torch.Tensor, on_cpu, count: int) -> torch.Tensor:
        if on_cpu is None:
            return out
        y, seconds = on_cpu.result()
        self.planner.observe_cpu(count * self.expert_bytes, seconds)
        self.counters.cpu_experts += count
        self.counters.cpu_seconds += seconds
        return out + y.to(out.device, out.dtype, non_blocking=True)

    # -- any batch (prefill): experts one by one, copies pipelined against compute --

    def _forward_grouped(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
                         topk_weights: torch.Tensor) -> torch.Tensor:
        groups = group_by_expert(topk_ids, topk_weights, self.num_experts, hidden.dtype)
        self.cache.begin_step((layer, g.expert) for g in groups)
        hits, misses = [], []
        for g in groups:
            slot = self.cache.lookup((layer, g.expert))
            (misses if slot is None else hits).append((g, slot))
        to_copy, to_cpu = self._plan([g for g, _ in misses], lambda g: len(g.tokens))
        on_cpu = self.cpu.submit(layer, hidden, to_cpu) if to_cpu else None
        out = self._copy_and_compute(layer, hidden, hits, to_copy)
        return self._add_cpu(out, on_cpu, len(to_cpu))

    def _plan(self, misses: list, tokens_of) -> tuple[list, list]:
        if not misses or self.miss_path == "copy":
            return misses, []
        if self.miss_path == "cpu":
            return [], misses
        split = self.planner.split(misses, self.expert_bytes, tokens_of=tokens_of,
                                   min_copy=len(self.cache.free_slots))
        return split.copy, split.cpu

    def _copy_and_compute(self, layer: int, hidden: torch.Tensor, hits: list, to_copy: list[ExpertGroup]):
        """Issues the copies first (side stream), computes the hits meanwhile, then each copied expert once its
        bytes have landed. Staged experts are interleaved so the ring of staging slots never overruns."""
        copier = self.copier
        copier.begin()
        cached, staged = [], []
        for g in to_copy:
            admitted = self.cache.admit((layer, g.expert))
            if admitted is None:
                staged.append(g)
            else:
                cached.append((g, admitted[0], copier.to_slot(layer, g.expert, self.slots, admitted[0])))
        ring = copier.staging_slots
        in_flight = [copier.to_staging(layer, g.expert, self.slots, self.staging_first) for g in staged[:ring]]
        slot_of = {g.expert: slot for g, slot in hits}
        out = run_groups(hidden, [g for g, _ in hits], lambda e: self.slots.weights_of(slot_of[e]))
        for g, slot, done in cached:
            copier.wait(done)
            out += run_groups(hidden, [g], lambda e, s=slot: self.slots.weights_of(s))
        for i, g in enumerate(staged):
            index, done = in_flight[i]
            copier.wait(done)
            out += run_groups(hidden, [g], lambda e, s=self.staging_first + index: self.slots.weights_of(s))
            copier.release(index)
            if i + ring < len(staged):
                in_flight.append(copier.to_staging(layer, staged[i + ring].expert, self.slots, self.staging_first))
        copier.end()  # the copy stream holds only copies, so this marks the last one's completion
        self.counters.bytes_copied += len(to_copy) * self.expert_bytes
        return out

    def resize(self, num_slots: int) -> None:
        """Changes the number of device slots while serving: shrinking evicts the coldest experts, growing keeps
        every cached one. Weights are never reloaded: survivors are moved between slots on the device."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # no copy may still be writing into the old slots
        moves = self.cache.resize(num_slots)
        new = self._allocate_slots(num_slots)
        moved_from = {new_slot: old for _, old, new_slot in moves}
        for new_slot in self.cache.slot_of.values():
            old = moved_from.get(new_slot, new_slot)
            for d, s in zip(new.weights_of(new_slot), self.slots.weights_of(old), strict=True):
                d.copy_(s)
        self.slots = new
