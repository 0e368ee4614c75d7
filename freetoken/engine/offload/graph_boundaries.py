"""The graph-boundary calls of `OffloadedExpertExecutor`: offloaded decode replayed from CUDA graphs
(cuda_graphs.py), the same step as `_forward_gathered` with its tensor work captured.

At layer L's expert call the graph segment ending there also captures the copies of the routing, the activations
and the next layer's predicted experts into pinned host buffers (`capture_route`); the gathered matmul over a
static slot map is captured as a graph of its own (`capture_experts`); the next segment starts by adding the CPU
share from a static buffer (`capture_combine`). Between them `run_boundary` does only host work: plan, queue the
copies, start the CPU, write the slot map, replay the experts' graph, collect the CPU share, prefetch. The host
thread is the step's critical path; this cuts its ~40 tensor operations per layer to ~6.

A mixin over the executor's state (cache, copier, slots, planner, routers, CPU runner); executor.py owns the
step itself (`_dispatch`), this file the buffers and the order of the captured step's host work.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from freetoken.engine import gpu_paths
from freetoken.engine.experts import gathered_expert_forward
from freetoken.engine.offload import cudart


@dataclass(slots=True)
class GraphIO:
    """The buffers between captured decode graphs and the host; one set, shared by every layer."""

    ids: torch.Tensor  # [N, K] int64, pinned: routing, written by the captured segment
    weights: torch.Tensor  # [N, K] fp32, pinned
    x: torch.Tensor  # [N, H] fp32, pinned: the layer's input, for the CPU share
    x_bf16: torch.Tensor | None  # [N, H] bf16, pinned: the same values (bf16 models), for the CPU's bf16 paths
    predicted: torch.Tensor  # [N, K] int64, pinned: the next layer's router on this input
    slot_map_host: torch.Tensor  # [N, K] int64, pinned: written by the host
    slot_map: torch.Tensor  # [N, K] int64, device: read by the captured gathered matmul
    y_host: torch.Tensor  # [N, H] fp32, pinned: the CPU share, written by the kernel
    y: torch.Tensor  # [N, H] fp32, device: read by the next segment


@dataclass(slots=True)
class GraphBoundary:
    """One layer's expert call inside a captured decode step (its segment's static tensors)."""

    layer: int
    hidden: torch.Tensor
    topk_weights: torch.Tensor
    predicts: bool  # the segment also captured the next layer's predicted experts
    io: GraphIO  # the buffers of steps of this many tokens
    topk_ids: torch.Tensor | None = None  # the experts routed to (for families with expert biases)


class GraphBoundaries:
    """What cuda_graphs.py calls instead of `forward` at each expert call of a captured decode step."""

    _runtime_io: bool | None = None  # small copies through the runtime (`_to_device`); known on first use

    @property
    def _top_k(self) -> int:
        """Experts per token (the routers' largest top-k; every expert when no router is known)."""
        return max((k for _, k in self._routers.values()), default=self.num_experts)

    def graph_boundaries(self, tokens: int) -> bool:
        """Whether steps of `tokens` tokens take the gathered path, so their expert calls can be two-phase."""
        return self.gather_small_batches and tokens * self._top_k <= self.gather_pairs

    def prepare_graph_io(self, tokens: int) -> None:
        """Allocates the buffers graphs of `tokens`-token steps read and write (before any capture: pinned
        allocations are not allowed while capturing). Shared by every layer (layers run one after another) and by
        every step of that size (steps run one after another)."""
        k, hidden = self._top_k, self.copier.shapes["gate_proj"][1]
        io = self._graph_io.get(tokens)
        if io is not None and io.ids.shape == (tokens, k):
            return
        pinned = {"pin_memory": self.device.type == "cuda"}  # (the CPU runs these calls eagerly in tests)
        self._graph_io[tokens] = GraphIO(
            ids=torch.empty(tokens, k, dtype=torch.int64, **pinned),
            weights=torch.empty(tokens, k, dtype=torch.float32, **pinned),
            x=torch.empty(tokens, hidden, dtype=torch.float32, **pinned),
            x_bf16=torch.empty(tokens, hidden, dtype=torch.bfloat16, **pinned) if self.dtype == torch.bfloat16
            else None,
            predicted=torch.empty(tokens, k, dtype=torch.int64, **pinned),
            slot_map_host=torch.empty(tokens, k, dtype=torch.int64, **pinned),
            slot_map=torch.full((tokens, k), self.zero_slot, dtype=torch.int64, device=self.device),
            y_host=torch.zeros(tokens, hidden, dtype=torch.float32, **pinned),
            y=torch.zeros(tokens, hidden, dtype=torch.float32, device=self.device))

    def capture_route(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
                      topk_weights: torch.Tensor) -> GraphBoundary:
        """While a segment is being captured: its last operations copy what the host needs to the host."""
        io = self._graph_io.get(topk_ids.shape[0])
        if io is None or io.ids.shape != topk_ids.shape:
            raise RuntimeError("prepare_graph_io(tokens) must come before capturing a step of that size")
        io.ids.copy_(topk_ids, non_blocking=True)
        io.weights.copy_(topk_weights.float(), non_blocking=True)
        io.x.copy_(hidden.float(), non_blocking=True)
        if io.x_bf16 is not None:
            io.x_bf16.copy_(hidden.to(torch.bfloat16), non_blocking=True)
        next_layer = self._next_layer.get(layer)
        if next_layer is not None:
            weight, k = self._routers[next_layer]
            io.predicted[:, :k].copy_(torch.topk(hidden @ weight.t(), k, dim=-1).indices, non_blocking=True)
        return GraphBoundary(layer, hidden, topk_weights, next_layer is not None, io, topk_ids)

    def capture_experts(self, boundary: GraphBoundary) -> torch.Tensor:
        """Captured as its own graph: every pair of the step from the slot the host wrote into the slot map."""
        slot_map, form = boundary.io.slot_map, self.form_of(boundary.layer)
        return gathered_expert_forward(self.slots, boundary.hidden, slot_map, boundary.topk_weights, form,
                                       self._bias_owners(form, slot_map, boundary.topk_ids))

    def capture_combine(self, boundary: GraphBoundary, gpu_out: torch.Tensor) -> torch.Tensor:
        """Captured at the head of the next segment: adds the CPU share, as `_forward_gathered` does."""
        return gpu_out + boundary.io.y.to(gpu_out.dtype)

    def run_boundary(self, boundary: GraphBoundary, replay_experts, rows: int | None = None) -> None:
        """The host work between two segments: the previous segment has been replayed, the next one reads the
        GPU share from `replay_experts()` and the CPU share from the static buffer. `rows`: the step's first rows
        are real tokens, the rest padding (a batched step replaying a larger captured one): padding pairs point at
        the zero slot and are never looked up, copied or computed on the CPU."""
        t0 = time.perf_counter()
        if self.device.type != "cuda":
            self._run_boundary(boundary, replay_experts, rows, t0)
            return
        self.copier.compute = torch.cuda.current_stream(self.device)  # once, not at each use (see ExpertCopier)
        try:
            self._run_boundary(boundary, replay_experts, rows, t0)
        finally:
            self.copier.compute = None

    def _run_boundary(self, boundary: GraphBoundary, replay_experts, rows: int | None, t0: float) -> None:
        io, layer = boundary.io, boundary.layer
        rows = io.ids.shape[0] if rows is None else rows
        self._prewake_cpu()  # the workers' wake-up overlaps the wait for the routing below
        self._issue_deferred_prefetch(layer)
        self._collect_copy_timings()
        if self.copier.compute is not None:
            self.copier.compute.synchronize()  # the segment's copies to the host have landed
        t_routed = time.perf_counter()
        ids, weights = io.ids[:rows].tolist(), io.weights[:rows].tolist()
        step = self._dispatch(layer, ids, weights, io.x, io.x_bf16, io.y_host)
        slot_map = io.slot_map_host.numpy()
        slot_map[:rows] = step.slot_map
        slot_map[rows:] = self.zero_slot
        self._to_device(io.slot_map, io.slot_map_host)
        replay_experts()
        if step.staged:
            self.copier.release(*step.staged)
        pending = self._plan_prefetch(boundary, layer, ids, rows)  # while the CPU share still runs
        if pending is not None and gpu_paths.enabled("prefetch-with-cpu"):
            self._prefetch(*pending)  # the link starts on the next layer while this layer's CPU share runs
            pending = None
        cpu_wait = 0.0
        if step.on_cpu is None:
            io.y.zero_()
        else:
            t_wait = time.perf_counter()
            y = self._wait_cpu(step)
            cpu_wait = time.perf_counter() - t_wait
            if y.data_ptr() != io.y_host.data_ptr():  # the torch fallback returns its own tensor
                io.y_host.copy_(y)
            self._to_device(io.y, io.y_host)
        # The prefetch comes after the CPU share: host DRAM feeds both miss paths and is their shared limit, so
        # copies queued while the CPU share still reads it would only slow that down. Its copies are queued at
        # the start of the next boundary, once the next segment (that layer's dense work) has been launched:
        # queueing them costs the host ~15 µs each, which would otherwise delay that launch. GPU path
        # "prefetch-early" (experimental) queues them here instead: with large experts (gpt-oss: 50 MB) the link
        # then works through the next segment too, for a launch delayed by the queueing.
        if pending is not None:
            if gpu_paths.enabled("prefetch-early"):
                self._prefetch(*pending)
            else:
                self._deferred_prefetch = pending
        self._count_step_time(t0, t_routed, cpu_wait)

    def _plan_prefetch(self, boundary: GraphBoundary, layer: int, ids: list[list[int]], rows: int) -> tuple | None:
        """What the prefetch after this step will copy: (next layer, its predicted experts, staging room, an event
        past this step's expert work, which may still read a slot a prefetch overwrites). Planned before the
        wait for the CPU share, whose end the next segment's launch waits for."""
        next_layer = self._prefetch_target(layer)
        if next_layer is None or not boundary.predicts:
            return None
        k = self._routers[next_layer][1]
        after = self.copier.mark_compute()
        return next_layer, set(boundary.io.predicted[:rows, :k].flatten().tolist()), self._prefetch_room(ids), after

    def _issue_deferred_prefetch(self, layer: int) -> None:
        """Queues the prefetch the previous boundary planned for `layer` (dropped if this is another layer: a
        step cut short)."""
        pending, self._deferred_prefetch = self._deferred_prefetch, None
        if pending is not None and pending[0] == layer:
            self._prefetch(*pending)

    def _to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Small pinned → device copy on the compute stream, through the runtime directly where possible."""
        if self._runtime_io is None:
            self._runtime_io = self.device.type == "cuda" and cudart.available()
        if self._runtime_io:
            cudart.copy_to_device(dst.data_ptr(), src.data_ptr(), src.nbytes, self.copier.compute_stream().cuda_stream)
        else:
            dst.copy_(src, non_blocking=True)
