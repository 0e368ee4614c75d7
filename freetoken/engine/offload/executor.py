"""`OffloadedExpertExecutor`: every routed expert in host memory, the hot ones in a slot cache on the device.

Per layer and step: the experts the tokens route to are looked up; hits compute from their slot. Misses take one
of two paths, both reading host DRAM, run at the same time:
- copy: fetched into a cache slot (the policy picks the victim; experts of the current step are never evicted) on
  a side stream, each computed as soon as its own bytes land; when the cache cannot take one (budget 0, or a
  prefill touching every expert) it streams through double-buffered staging instead;
- cpu: computed on the host where it lives by the native kernel's threads, started before any GPU work of the
  layer is queued, so both run at once; only activations cross.
`miss_path` "copy" or "cpu" forces one path (the naive and CPU-only baselines); "auto" lets the `MissPlanner`
split each layer's misses from bandwidths it keeps measuring. Decode (small batches, on CUDA) gathers every
expert of the step from one slot tensor [cache | staging | zero slot] in a single batched matmul; larger batches
(prefill) compute expert by expert, each as soon as its copy lands. Next-layer prefetch starts copies of the
experts layer L+1's router would pick for layer L's input, into cache slots, or with no cache (budget 0) into
staging slots held for layer L+1: the link would otherwise idle while L+1's dense work runs and its routing
reaches the host. Results equal the resident executor's: the same weights and function, only where they are
computed differs.

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
        # Next-layer prefetch: layer L's MoE input through layer L+1's router predicts L+1's experts; their
        # copies start while L still computes. Needs the routers (attach_experts gives them) and cache slots.
        self.prefetch = True
        self._routers: dict[int, tuple[torch.Tensor, int]] = {}
        self._next_layer: dict[int, int] = {}
        self._prefetched: set[tuple[int, int]] = set()
        self._staged_ahead: dict[tuple[int, int], int] = {}  # prefetched into staging: (layer, expert) → ring index
        self._prefetch_done: list = []  # completion of the last prefetch's copies (the link's backlog)
        self._prefetch_seconds = 0.0  # their predicted copy time

    def set_routers(self, routers: dict[int, tuple[torch.Tensor, int]]) -> None:
        """layer → (router weight [E, H], top-k), for predicting the next layer's experts."""
        self._routers = routers
        layers = sorted(routers)
        self._next_layer = dict(zip(layers, layers[1:], strict=False))

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
        """Order matters: the CPU experts start first (on the kernel's own threads, asynchronously), then every GPU
        operation is queued (copies, the gathered matmul waiting on them, the next layer's prefetch), and only then
        does this thread wait for the CPU result: the CPU, the copy engine and the GPU work at the same time."""
        next_layer = self._next_layer.get(layer) if self.prefetch and self.miss_path != "cpu" else None
        predicted = None
        if next_layer is not None:
            weight, k = self._routers[next_layer]
            predicted = torch.topk(hidden @ weight.t(), k, dim=-1).indices  # softmax keeps the order
        ids, weights, x, predicted = self._to_host(topk_ids, topk_weights, hidden, predicted)
        tokens_of: dict[int, list[int]] = {}
        for t, row in enumerate(ids):
            for e in row:
                tokens_of.setdefault(e, []).append(t)
        self._count_prefetch_use(layer, tokens_of)
        ahead = self._take_staged_ahead(layer)
        self.cache.begin_step((layer, e) for e in tokens_of)
        slot_of, misses, staged = {}, [], []
        for e in tokens_of:
            slot = self.cache.lookup((layer, e))
            if slot is not None:
                slot_of[e] = slot
            elif e in ahead:  # a miss of the cache, already copied by the previous layer's prefetch
                slot_of[e] = self.staging_first + ahead[e]
                staged.append(ahead[e])
            else:
                misses.append(e)
        to_copy, to_cpu = self._plan(misses, lambda e: len(tokens_of[e]), self._copy_backlog())
        on_cpu = None
        if to_cpu:  # started first: the CPU computes while this thread queues the GPU work below
            pairs = [[(t, k) for t, row in enumerate(ids) for k, x_e in enumerate(row) if x_e == e] for e in to_cpu]
            on_cpu = self.cpu.start_pairs(layer, x, to_cpu, pairs, weights)
        copier = self.copier
        copier.begin()
        busy = set(staged)
        for e in to_copy:  # at most N*K ≤ staging_slots experts, so the staging ring never wraps here
            admitted = self.cache.admit((layer, e))
            if admitted is None:
                ring = copier.reserve_staging(busy)
                slot_of[e] = self.staging_first + ring
                staged.append(ring)
            else:
                slot_of[e] = admitted[0]
        copier.to_slots(layer, to_copy, self.slots, [slot_of[e] for e in to_copy])
        copier.end()
        self.counters.bytes_copied += len(to_copy) * self.expert_bytes
        out = None
        if slot_of:  # some experts compute on the GPU
            copier.wait_all()
            slot_map = torch.tensor([[slot_of.get(e, self.zero_slot) for e in row] for row in ids])
            out = gathered_expert_forward(self.slots, hidden, slot_map.to(hidden.device, non_blocking=True),
                                          topk_weights)
            copier.release(*staged)
        if predicted is not None:
            room = copier.staging_slots - len(ids) * len(ids[0])  # the next layer's own copies need the rest
            self._prefetch(next_layer, {e for row in predicted for e in row}, room)
        if on_cpu is not None:
            y, seconds = on_cpu.wait()
            self._count_cpu(len(to_cpu), seconds)
            y = y.to(hidden.device, hidden.dtype, non_blocking=True)
            out = y if out is None else out + y
        return out

    def _to_host(self, topk_ids: torch.Tensor, topk_weights: torch.Tensor, hidden: torch.Tensor,
                 predicted: torch.Tensor | None):
        """Routing, the prediction, and (when the CPU may compute) the activations on the host, behind one
        synchronisation. Returns (ids, weights, x fp32 or None, predicted ids or None) as lists / tensors."""
        need_x = self.miss_path != "copy"
        tensors = [topk_ids, topk_weights, hidden if need_x else None, predicted]
        if hidden.is_cuda:
            tensors = [None if t is None else t.to("cpu", non_blocking=True) for t in tensors]
            torch.cuda.current_stream(hidden.device).synchronize()
        ids, weights, x, pred = tensors
        return (ids.tolist(), weights.float().tolist(), None if x is None else x.float(),
                None if pred is None else pred.tolist())

    def _prefetch(self, layer: int, experts: set[int], room: int) -> None:
        """Starts copies of the predicted experts of `layer` that the cache lacks, behind this layer's copies and
        this layer's compute (a victim's slot may still be read by it). Only the share the planner would copy
        if they were misses: the rest would go to the CPU anyway, and extra copies would crowd the link.
        Without cache slots (budget 0) at most `room` go to staging slots, held until `layer` runs."""
        missing = sorted(e for e in experts if (layer, e) not in self.cache.slot_of)
        if self.miss_path == "auto":
            missing = self.planner.split(missing, self.expert_bytes, observe=False).copy
        copier = self.copier
        copier.begin()
        experts, slots = [], []
        for e in missing:
            if self.cache.capacity:
                admitted = self.cache.admit((layer, e))
                if admitted is None:
                    break  # every slot holds this step's experts
                slot = admitted[0]
            elif len(self._staged_ahead) < room:
                ring = copier.reserve_staging(set(self._staged_ahead.values()))
                self._staged_ahead[(layer, e)] = ring
                slot = self.staging_first + ring
            else:
                break
            experts.append(e)
            slots.append(slot)
        copier.to_slots(layer, experts, self.slots, slots)
        if experts and copier.stream is not None:
            self._prefetch_done = [copier.stream.record_event()]
            self._prefetch_seconds = self.planner.copy.predict(len(experts) * self.expert_bytes)
        copier.end()
        self._prefetched.update((layer, e) for e in experts)
        self.counters.prefetched += len(experts)
        self.counters.bytes_copied += len(experts) * self.expert_bytes

    def _take_staged_ahead(self, layer: int) -> dict[int, int]:
        """expert → ring index of the staging slots prefetched for `layer`. Those of any other layer (a step cut
        short, a prefill in between) are dropped: nothing will read them, so their slots are free again."""
        ahead = {e: ring for (at, e), ring in self._staged_ahead.items() if at == layer}
        self._staged_ahead = {}
        return ahead

    def _copy_backlog(self) -> float:
        """Seconds the link still owes the last prefetch (its predicted time while its copies have not all
        landed): this step's copies queue behind them."""
        if not self._prefetch_done or self._prefetch_done[0].query():
            self._prefetch_done = []
            return 0.0
        return self._prefetch_seconds

    def _count_prefetch_use(self, layer: int, routed: dict[int, list[int]]) -> None:
        if self._prefetched:
            self.counters.prefetch_used += sum((layer, e) in self._prefetched for e in routed)
            self._prefetched = {key for key in self._prefetched if key[0] != layer}

    def _count_cpu(self, count: int, seconds: float) -> None:
        self.planner.observe_cpu(count * self.expert_bytes, seconds)
        self.counters.cpu_experts += count
        self.counters.cpu_seconds += seconds

    def _add_cpu(self, out: torch.Tensor, on_cpu, count: int) -> torch.Tensor:
        if on_cpu is None:
            return out
        y, seconds = on_cpu.result()
        self._count_cpu(count, seconds)
        return out + y.to(out.device, out.dtype, non_blocking=True)

    # -- any batch (prefill): experts one by one, copies pipelined against compute --

    def _forward_grouped(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
                         topk_weights: torch.Tensor) -> torch.Tensor:
        groups = group_by_expert(topk_ids, topk_weights, self.num_experts, hidden.dtype)
        self._take_staged_ahead(layer)
        self.cache.begin_step((layer, g.expert) for g in groups)
        hits, misses = [], []
        for g in groups:
            slot = self.cache.lookup((layer, g.expert))
            (misses if slot is None else hits).append((g, slot))
        to_copy, to_cpu = self._plan([g for g, _ in misses], lambda g: len(g.tokens))
        on_cpu = self.cpu.submit(layer, hidden, to_cpu) if to_cpu else None
        out = self._copy_and_compute(layer, hidden, hits, to_copy)
        return self._add_cpu(out, on_cpu, len(to_cpu))

    def _plan(self, misses: list, tokens_of, copy_busy_s: float = 0.0) -> tuple[list, list]:
        if not misses or self.miss_path == "copy":
            return misses, []
        if self.miss_path == "cpu":
            return [], misses
        split = self.planner.split(misses, self.expert_bytes, tokens_of=tokens_of,
                                   min_copy=len(self.cache.free_slots), copy_busy_s=copy_busy_s)
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
