"""`OffloadedExpertExecutor`: every routed expert in host memory, the hot ones in a slot cache on the device.

Per layer and step: the experts the tokens route to are looked up; hits compute from their slot. Misses take one
of two paths, both reading host DRAM, run at the same time:
- copy: fetched into a cache slot (the policy picks the victim; experts of the current step are never evicted) on
  a side stream, each computed as soon as its own bytes land; when the cache cannot take one (budget 0, or a
  prefill touching every expert) it streams through double-buffered staging instead;
- cpu: computed on the host where it lives by the native kernel's threads, started as soon as the layer's copies
  are queued, so both run at once; only activations cross.
`miss_path` "copy" or "cpu" forces one path (the naive and CPU-only baselines); "auto" lets the `MissPlanner`
split each layer's misses from bandwidths it keeps measuring. Quantized experts may also keep a block store on the
device (`store_rows`, block_store.py): a second tier in their block format, about twice the experts per byte for
Q8_0; a miss of the slots that the store holds is dequantized from it, never sent to the CPU or over the link.
Decode (small batches, on CUDA) gathers every
expert of the step from one slot tensor [cache | staging | zero slot] in a single batched matmul; larger batches
(prefill) compute expert by expert, each as soon as its copy lands (prefill.py). Next-layer prefetch (prefetch.py)
starts copies of the experts layer L+1's router would pick for layer L's input while L still computes. Results
equal the resident executor's: the same weights and function, only where they are computed differs.

Shapes: S slots, E experts, N tokens, H hidden.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

import torch

from freetoken.engine import gpu_paths
from freetoken.engine.experts import ExpertForm, LayerExperts, gathered_expert_forward
from freetoken.engine.offload.cpu_experts import HOST_OP_MAX_VALUES, CpuExpertRunner
from freetoken.engine.offload.expert_cache import ExpertCache
from freetoken.engine.offload.graph_boundaries import GraphBoundaries, GraphIO
from freetoken.engine.offload.planner import LinkQueue, MissPlanner
from freetoken.engine.offload.policy import make_policy
from freetoken.engine.offload.prefetch import DecodePrefetch
from freetoken.engine.offload.prefill import PrefillPath
from freetoken.engine.offload.quantized import QuantizedExperts
from freetoken.engine.offload.transfer import ExpertCopier

log = logging.getLogger(__name__)

# Seeds for the planner when this machine has no calibration profile; the online fit replaces them in a few steps.
DEFAULT_COPY_GB_S, DEFAULT_CPU_GB_S = 20.0, 10.0


@dataclass(slots=True)
class _Step:
    """One layer-step after `_dispatch`: where each (token, k) pair computes, and what is still running."""

    slot_map: list[list[int]]  # [N][K] slot of each pair's expert; the zero slot for pairs on the CPU
    staged: list[int]  # staging ring slots the GPU share reads (released after it is queued)
    on_gpu: bool  # some pair computes on the GPU
    on_cpu: object | None  # the started CPU share (`wait()` → (y, seconds)), or None
    cpu_count: int  # experts in it


def _has_biases(form: ExpertForm | None) -> bool:
    return form is not None and any(t is not None for t in (form.gate_bias, form.up_bias, form.down_bias))


class OffloadedExpertExecutor(PrefillPath, DecodePrefetch, GraphBoundaries):
    capturable = False  # looks routing up on the host every layer

    MISS_PATHS = ("auto", "copy", "cpu")
    GATHER_PAIRS = 16
    PREWAKE_SPIN_S = 1e-3  # GPU path "cpu-prewake": woken workers spin this long for the layer's CPU share

    def __init__(self, host: dict[int, LayerExperts | QuantizedExperts], device: torch.device, num_slots: int,
                 policy: str = "freq", miss_path: str = "auto", dtype: torch.dtype | None = None,
                 planner: MissPlanner | None = None, staging_slots: int = 16, store_rows: int = 0):
        if miss_path not in self.MISS_PATHS:
            raise ValueError(f"miss_path must be one of {self.MISS_PATHS}, got {miss_path!r}")
        first = next(iter(host.values()))
        self.host, self.device, self.miss_path = host, torch.device(device), miss_path
        self.num_experts = first.num_experts
        self.dtype = dtype or first.gate_proj.dtype
        self.cache = ExpertCache(num_slots, make_policy(policy))
        self.copier = ExpertCopier(host, self.device, self.dtype, max(2, staging_slots), self.cache.counters,
                                   store_rows, policy)
        self.expert_bytes = self.copier.expert_bytes
        self.block_share = 1.0 if store_rows else 0.0  # of the budget, in the store (build_executor sets it)
        self.slots = self._allocate_slots(num_slots)
        self.planner = planner or MissPlanner(DEFAULT_COPY_GB_S, DEFAULT_CPU_GB_S)
        self._link_known = planner is not None or self.device.type != "cuda"  # else timed on first use
        # Small batches (decode) gather their experts' slots into one batched matmul: a few launches per layer
        # instead of several per expert. On the CPU the gather would copy weights for nothing.
        self.gather_small_batches = self.device.type == "cuda"
        # up to this many (token, expert) pairs per step; the gather copies every pair's weights
        self.gather_pairs = min(self.copier.staging_slots, self.GATHER_PAIRS)
        self._cpu: CpuExpertRunner | None = None  # started on first use: a thread pool and maybe a compile
        # Next-layer prefetch: layer L's MoE input through layer L+1's router predicts L+1's experts; their
        # copies start while L still computes. Needs the routers (attach_experts gives them) and cache slots.
        self.prefetch = self.device.type == "cuda"  # on a CPU-only machine a copy overlaps nothing
        self._routers: dict[int, tuple[torch.Tensor, int]] = {}
        self._next_layer: dict[int, int] = {}
        self._prefetched: set[tuple[int, int]] = set()
        self._prefetched_near: set[tuple[int, int]] = set()  # of those, the ones the block store served (no link)
        self._staged_ahead: dict[tuple[int, int], int] = {}  # prefetched into staging: (layer, expert) → ring index
        self._prefetch_done: list = []  # completion of the last prefetch's copies
        self._warmed: tuple[int, set[int]] | None = None  # GPU path "cpu-warm": (layer, experts) read ahead
        self._link = LinkQueue()  # when the link will have worked through the decode copies queued so far
        self._deferred_prefetch: tuple | None = None  # (layer, experts, room, event): queued at the next boundary
        self._cpu_started_at: float | None = None  # when this layer-step's CPU share started (diagnostics)
        self._step_misses = 0  # experts this layer-step's cache lacked (prefetched ones too): the guard's unit
        # GPU path "prefetch-lead": (layer, when) of the last prefetch queued, and the mean seconds from queueing a
        # prefetch to its layer's routing on the host (the head start its copies have over that layer's CPU share)
        self._prefetch_queued: tuple[int, float] | None = None
        self.prefetch_lead_s: float | None = None
        self._forms: dict[int, ExpertForm | None] = {}  # per layer, on the device (form_of)
        # Prefill: while a long chunk's layer computes, the next layer's experts stream (prefill.py), so the link
        # works through that layer's attention. Off by default: within noise of plain streaming on the H200
        # (evals/results/p1-prefill-ahead-h200.md), and it wants a staging ring of two layers' experts.
        self.prefill_ahead = False
        self._chunk_ahead = None  # prefill's _ChunkAhead: what the previous layer of a chunk streamed
        self._left_to_cpu = None  # (layer, {expert}) that streaming left to the CPU (GPU path short-chunks-cpu)
        self._graph_io: dict[int, GraphIO] = {}  # tokens per step → its buffers (prepare_graph_io), captured decode
        self.slots_version = 0  # bumped when the slot tensors are reallocated (captured graphs read them)

    def form_of(self, layer: int) -> ExpertForm | None:
        """The layer's expert form on the compute device, None for plain SwiGLU. Its bias tables have one more
        row, zeros, for pairs the device does not compute (see `_bias_owners`)."""
        if layer not in self._forms:
            form = self.host[layer].form
            if _has_biases(form):
                form = form.to(self.device)
                form = replace(form, **{name: torch.cat((t, t.new_zeros(1, t.shape[1])))
                                        for name in ("gate_bias", "up_bias", "down_bias")
                                        if (t := getattr(form, name)) is not None})
            self._forms[layer] = form
        return self._forms[layer]

    def _bias_owners(self, form: ExpertForm | None, slot_map: torch.Tensor,
                     topk_ids: torch.Tensor | None) -> torch.Tensor | None:
        """Whose biases each pair of a gathered step adds: its expert, or the zero row for pairs pointing at the
        zero slot (computed on the CPU, which adds their biases itself). No host sync: capturable."""
        if not _has_biases(form) or topk_ids is None:
            return None
        return torch.where(slot_map == self.zero_slot, self.num_experts, topk_ids)

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
        if not self._link_known and not torch.cuda.is_current_stream_capturing():
            self._measure_link(layer)
        self._collect_copy_timings()
        if self.gather_small_batches and topk_ids.numel() <= self.gather_pairs:
            return self._forward_gathered(layer, hidden, topk_ids, topk_weights)
        guard = self.planner.guard
        if guard is not None and hidden.shape[0] >= self.PREFILL_TOKENS and gpu_paths.enabled("guard-rest"):
            guard.rest()
        return self._forward_grouped(layer, hidden, topk_ids, topk_weights)

    def _measure_link(self, layer: int) -> None:
        """Without a calibration profile the planner's link speed is a guess (DEFAULT_COPY_GB_S; PCIe 5 x16 moves
        ~54), and it seeds the prefill planner, whose first chunk would split by it. A few experts copied into
        the staging slots on first use replace it (the fastest of three rounds: the first may pay for lazy
        setup)."""
        self._link_known = True
        n = min(4, self.copier.staging_slots, self.num_experts)
        rounds, counted = [], self.counters.bytes_copied  # a measurement, not traffic of any step
        # past the block store: its rows would serve the second and third rounds without the link
        store, self.copier.store = self.copier.store, None
        for _ in range(3):
            torch.cuda.synchronize(self.device)
            t0 = time.perf_counter()
            self.copier.begin(sample=False)
            for e in range(n):
                self.copier.to_slot(layer, e, self.slots, self.staging_first + e)
            self.copier.end()
            torch.cuda.synchronize(self.device)
            rounds.append(time.perf_counter() - t0)
        self.counters.bytes_copied, self.copier.store = counted, store
        self.planner.copy.per_byte = min(rounds) / (n * self.expert_bytes)
        log.debug("expert link measured: %.1f GB/s", self.planner.copy.gb_s)

    def _collect_copy_timings(self) -> None:
        for nbytes, seconds, sample, prefill in self.copier.finished_timings():
            if sample and prefill:
                self.prefill_planner().observe_copy(nbytes, seconds)
            elif sample:
                self.planner.observe_copy(nbytes, seconds)
            self.counters.copy_seconds += seconds

    # -- small batches: one host sync, the copies, one gathered matmul --

    def _forward_gathered(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
                          topk_weights: torch.Tensor) -> torch.Tensor:
        """Order matters: the copies are queued, the CPU experts start (on the kernel's own threads,
        asynchronously), the gathered matmul is queued behind the copies, and only then does this thread wait for
        the CPU result: the CPU, the copy engine and the GPU work at the same time. The next layer's prefetch
        comes last (see run_boundary)."""
        t0 = time.perf_counter()
        self._prewake_cpu()
        next_layer = self._prefetch_target(layer)
        predicted = None
        if next_layer is not None:
            weight, k = self._routers[next_layer]
            predicted = torch.topk(hidden @ weight.t(), k, dim=-1).indices  # softmax keeps the order
        ids, weights, x, predicted = self._to_host(topk_ids, topk_weights, hidden, predicted)
        t_routed = time.perf_counter()
        step = self._dispatch(layer, ids, weights, x)
        out = None
        if step.on_gpu:
            slot_map = torch.tensor(step.slot_map).to(hidden.device, non_blocking=True)
            form = self.form_of(layer)
            out = gathered_expert_forward(self.slots, hidden, slot_map, topk_weights, form,
                                          self._bias_owners(form, slot_map, topk_ids))
            self.copier.release(*step.staged)
        cpu_wait = 0.0
        if step.on_cpu is not None:
            t_wait = time.perf_counter()
            y = self._wait_cpu(step)
            cpu_wait = time.perf_counter() - t_wait
            y = y.to(hidden.device, hidden.dtype, non_blocking=True)
            out = y if out is None else out + y
        if predicted is not None:  # after the CPU share: both miss paths read host DRAM, see run_boundary
            self._prefetch(next_layer, {e for row in predicted for e in row}, self._prefetch_room(ids))
        self._count_step_time(t0, t_routed, cpu_wait)
        return out

    def _dispatch(self, layer: int, ids: list[list[int]], weights: list[list[float]], x: torch.Tensor | None,
                  x_bf16: torch.Tensor | None = None, cpu_out: torch.Tensor | None = None) -> _Step:
        """One layer-step's routing, known on the host: looks the experts up, splits the misses, queues the
        copies, starts the CPU share (and makes the compute stream wait for the copies). The caller then computes
        the GPU share from `slot_map` (pairs on the CPU point at the zero slot) and collects the CPU share.
        The host thread is the step's critical path from the routing's arrival to the CPU share's start: only
        the lookups and the split come before it, then the cache's bookkeeping (`_record_step`) and the copies."""
        pairs_of: dict[int, list[tuple[int, int]]] = {}  # expert → its (token, k) pairs, one per token
        for t, row in enumerate(ids):
            for k, e in enumerate(row):
                if e in pairs_of:
                    pairs_of[e].append((t, k))
                else:
                    pairs_of[e] = [(t, k)]
        prefetched = self._prefetched
        ahead = self._take_staged_ahead(layer)
        self._observe_prefetch_lead(layer)
        cached = self.cache.slot_of
        slot_of, misses, near, staged, prefetched_hits = {}, [], [], [], 0
        for e in pairs_of:
            slot = cached.get((layer, e))
            if slot is not None:
                slot_of[e] = slot
                if prefetched:
                    prefetched_hits += (layer, e) in prefetched and (layer, e) not in self._prefetched_near
            elif e in ahead:  # a miss of the cache, already copied by the previous layer's prefetch
                slot_of[e] = self.staging_first + ahead[e]
                staged.append(ahead[e])
            elif self.copier.stored(layer, e):  # on the device in its block format: dequantized, never split
                near.append(e)
            else:
                misses.append(e)
        # The guard's unit: the experts the step found missing before any prefetch. A prefetched expert is a cache
        # hit by now, but its copy is this step's cost; left out, the ways that prefetch (split, copy) looked 8x
        # dearer per miss than the CPU way (H200, 16 GiB: 0.7 against 5.6 misses a step), and the guard kept the
        # CPU way at 0.86x the split's speed.
        self._step_misses = len(misses) + len(staged) + prefetched_hits
        self.counters.prefetch_hits += prefetched_hits
        to_copy, to_cpu = self._plan(misses, lambda e: len(pairs_of[e]), self._copy_backlog())
        to_copy = near + to_copy
        # GPU path "cpu-first" (on by default): the CPU share starts before the copies are queued (50-150 µs a
        # batch on the H200 host). Queued first, they delayed its start to 154-258 µs after the routing at 8-16 GiB
        # (68-80 with it), and auto ran 6-17% slower (d1-qwen3-30b-a3b-bf16-1k-h200.md). The planner charges
        # the queueing to whichever path waits for it. The bookkeeping must precede the copies' admissions.
        cpu_first = bool(to_cpu) and (not to_copy or gpu_paths.enabled("cpu-first"))
        on_cpu = self._start_cpu(layer, x, to_cpu, pairs_of, weights, x_bf16, cpu_out) if cpu_first else None
        self._record_step(layer, pairs_of)
        if to_copy:
            self._queue_copies(layer, to_copy, slot_of, staged)
        if to_cpu and not cpu_first:
            on_cpu = self._start_cpu(layer, x, to_cpu, pairs_of, weights, x_bf16, cpu_out)
        if slot_of:
            self.copier.wait_all()
        zero = self.zero_slot
        return _Step([[slot_of.get(e, zero) for e in row] for row in ids], staged, bool(slot_of), on_cpu,
                     len(to_cpu))

    def _record_step(self, layer: int, routed: dict[int, list]) -> None:
        """The cache's bookkeeping of a step's experts (`routed`: expert → its pairs, in lookup order): prefetch
        use, protection from this step's admissions, hit and miss counts, the policy's view."""
        self._count_prefetch_use(layer, routed)
        keys = [(layer, e) for e in routed]
        self.cache.begin_step(keys)
        self.cache.record_uses(layer, keys)

    def _queue_copies(self, layer: int, to_copy: list[int], slot_of: dict[int, int], staged: list[int]) -> None:
        """Queues the step's copies: into the slots the cache admits them to, else into staging slots."""
        copier, cache = self.copier, self.cache
        t_issue = time.perf_counter()
        copier.begin()
        busy = set(staged)
        for e in to_copy:  # at most N*K ≤ staging_slots experts, so the staging ring never wraps here
            admitted = cache.admit((layer, e))
            if admitted is None:
                ring = copier.reserve_staging(busy)
                slot_of[e] = self.staging_first + ring
                staged.append(ring)
            else:
                slot_of[e] = admitted[0]
        fetched = sum(not copier.stored(layer, e) for e in to_copy)
        copier.to_slots(layer, to_copy, self.slots, [slot_of[e] for e in to_copy])
        now = time.perf_counter()
        if copier.batch_is_sample:
            self.planner.observe_issue(len(to_copy), now - t_issue)
        copier.end()
        self._link.queued(now, self.planner.copy.predict(fetched * self.expert_bytes))

    def _start_cpu(self, layer: int, x, to_cpu: list[int], pairs_of: dict, weights, x_bf16, cpu_out):
        on_cpu = self.cpu.start_pairs(layer, x, to_cpu, [pairs_of[e] for e in to_cpu], weights, x_bf16=x_bf16,
                                      out=cpu_out)
        self._cpu_started_at = time.perf_counter()
        if self._warmed is not None:  # counted once the share runs: the start is the step's critical path
            warmed_layer, warmed = self._warmed
            self._warmed = None
            if warmed_layer == layer:
                self.counters.cpu_warm_used += sum(e in warmed for e in to_cpu)
        return on_cpu

    def _prewake_cpu(self) -> None:
        """GPU path "cpu-prewake": wakes the CPU kernel's workers ahead of a step that may give them misses."""
        guard = self.planner.guard
        if self.miss_path != "copy" and (guard is None or guard.way != "copy") and gpu_paths.enabled("cpu-prewake"):
            self.cpu.wake(self.PREWAKE_SPIN_S)

    def _wait_cpu(self, step: _Step) -> torch.Tensor:
        """A decode layer-step's CPU share (both decode paths come here; prefill chunks count theirs apart)."""
        y, seconds = step.on_cpu.wait()
        self._count_cpu(step.cpu_count, seconds)
        self.counters.step_cpu_experts += step.cpu_count
        self.counters.step_cpu_seconds += seconds
        return y

    def _to_host(self, topk_ids: torch.Tensor, topk_weights: torch.Tensor, hidden: torch.Tensor,
                 predicted: torch.Tensor | None):
        """Routing, the prediction, and (when the CPU may compute) the activations on the host, behind one
        synchronisation. Returns (ids, weights, x fp32 or None, predicted ids or None) as lists / tensors."""
        need_x = self.miss_path != "copy"
        if need_x and hidden.is_cuda and hidden.numel() > HOST_OP_MAX_VALUES:
            hidden = hidden.float()  # a large batch: to fp32 on the device, not by torch's host pool (below)
        tensors = [topk_ids, topk_weights, hidden if need_x else None, predicted]
        if hidden.is_cuda:
            tensors = [None if t is None else t.to("cpu", non_blocking=True) for t in tensors]
            torch.cuda.current_stream(hidden.device).synchronize()
        ids, weights, x, pred = tensors
        return (ids.tolist(), weights.float().tolist(), None if x is None else x.float(),
                None if pred is None else pred.tolist())

    def _count_step_time(self, start: float, routed: float, cpu_wait: float) -> None:
        c = self.counters
        c.layer_steps += 1
        if self._cpu_started_at is not None:
            c.cpu_starts += 1
            c.cpu_start_delay_seconds += self._cpu_started_at - routed
            self._cpu_started_at = None
        end = time.perf_counter()
        c.gpu_wait_seconds += routed - start
        c.cpu_wait_seconds += cpu_wait
        c.host_seconds += end - routed - cpu_wait
        self.planner.observe_step(end - start, self._step_misses)

    def _count_cpu(self, count: int, seconds: float, planner: MissPlanner | None = None,
                   weighed_bytes: float | None = None) -> None:
        """`weighed_bytes`: the work as the planner weighs it (default: `count` experts of one token)."""
        (planner or self.planner).observe_cpu(count * self.expert_bytes if weighed_bytes is None else weighed_bytes,
                                              seconds)
        self.counters.cpu_experts += count
        self.counters.cpu_seconds += seconds

    def _add_cpu(self, out: torch.Tensor, on_cpu, count: int, planner: MissPlanner | None = None,
                 weighed_bytes: float | None = None) -> torch.Tensor:
        if on_cpu is None:
            return out
        y, seconds = on_cpu.result()
        self._count_cpu(count, seconds, planner, weighed_bytes)
        # converted on the device: on the host, more than 32k values would wake torch's OpenMP pool, which then
        # spins on the cores the CPU expert kernel's next call needs
        return out + y.to(out.device, non_blocking=True).to(out.dtype)

    def _plan(self, misses: list, tokens_of, copy_busy_s: float = 0.0,
              planner: MissPlanner | None = None) -> tuple[list, list]:
        """(to copy, to compute on the CPU); at least as many copied as the cache has free slots (worth
        filling). `planner`: the prefill planner for a chunk (default: decode's)."""
        if not misses or self.miss_path == "copy":
            return misses, []
        if self.miss_path == "cpu":
            return [], misses
        split = (planner or self.planner).split(
            misses, self.expert_bytes, tokens_of=tokens_of, min_copy=len(self.cache.free_slots),
            copy_busy_s=copy_busy_s, cpu_first=planner is None and gpu_paths.enabled("cpu-first"))
        return split.copy, split.cpu

    def pin_layer(self, layer: int, experts: int, pinned: bool) -> int:
        """Keeps every expert of `layer` on the device (copied in now, never evicted), or lets them go again.
        Between steps only. Returns how many experts the cache holds pinned."""
        keys = [(layer, e) for e in range(experts)]
        if not pinned:
            self.cache.unpin(keys)
            return len(self.cache.pinned)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # queued compute may still read the slots it displaces
        admitted = self.cache.pin(keys)  # ValueError when they do not fit
        if admitted:
            self.copier.begin(sample=False)
            self.copier.to_slots(layer, [key[1] for _, key in admitted], self.slots, [slot for slot, _ in admitted])
            self.copier.end()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        return len(self.cache.pinned)

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
        self.slots_version += 1

    def resize_store(self, rows: int) -> None:
        """Changes the block store's rows while serving (see `resize`); experts it keeps are moved on the device."""
        if self.copier.store is None:
            raise ValueError("this executor keeps no block store (its experts are dense, or none was asked for)")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # no copy or launch may still touch the old rows
        self.copier.store.resize(rows)  # the dequantizing graphs see the new rows' address and recapture
