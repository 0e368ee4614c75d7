"""CUDA-graph decode: one captured decode step per window size, replayed for every token.

Eager decode of a small model is bound by launching a thousand-odd kernels per token from Python; a replayed
graph launches them all at once. A step is captured per window W (powers of two from 256 up to the cache's
capacity), the smallest window covering the sequence is replayed, and slots past the sequence are masked.
Capture needs fixed tensor addresses, so the KV pools must not grow: the cache is allocated at full size.

An executor that must look routing up on the host (offloaded experts) cannot be captured; then the step is
captured in segments, cut at every routed-expert call: segment i runs everything from the previous MoE's output
up to layer i's router, the executor runs eagerly on the segment's output tensors, and its result is copied into
the static input of segment i+1. The dense work still replays from graphs; only the expert work is eager.
An executor that offers the graph-boundary calls (`prepare_graph_io`, `capture_route`, `capture_experts`,
`capture_combine`, `run_boundary`: the offloading executor) gets more captured: the segment also copies the
routing to the host, its expert matmul is a graph of its own, and only planning and copies stay on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from freetoken.engine.attention import StaticDecodeAttention
from freetoken.engine.kv_cache import PagedKVCache, SequenceKV

MIN_WINDOW = 256


@dataclass(slots=True)
class _Boundary:
    """One routed-expert call between two segments, with the static tensors of both sides."""

    layer: int
    hidden: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    out: torch.Tensor  # the next segment reads the experts' output (or, two-phase, their GPU share) from here
    route: object = None  # the executor's handle for this call (graph-boundary executor)
    experts_graph: torch.cuda.CUDAGraph | None = None  # its captured expert matmul


@dataclass(slots=True)
class _Captured:
    graphs: list[torch.cuda.CUDAGraph]  # one, or one more than boundaries
    boundaries: list[_Boundary]
    ctx: StaticDecodeAttention
    token: torch.Tensor  # [1] input buffer
    logits: torch.Tensor  # [1, V] output buffer
    slots_version: int = 0  # the executor's slot tensors these graphs read (recaptured when they change)
    kv_version: int = 0  # the KV pool tensors they read (a resized pool is reallocated)

    def replay(self, experts) -> None:
        for i, graph in enumerate(self.graphs):
            graph.replay()
            if i < len(self.boundaries):
                b = self.boundaries[i]
                if b.route is not None:
                    experts.run_boundary(b.route, b.experts_graph.replay)
                else:
                    b.out.copy_(experts.forward(b.layer, b.hidden, b.topk_ids, b.topk_weights))


class _SegmentingExecutor:
    """Stands in for the executor during a segmented capture: ends the running segment's capture at each call,
    notes the call's tensors, and starts capturing the next segment, which reads a static output buffer."""

    capturable = True

    def __init__(self, pool, executor):
        self.pool, self.executor = pool, executor
        self.two_phase = hasattr(executor, "graph_boundaries") and executor.graph_boundaries(1)
        self.graphs = [torch.cuda.CUDAGraph()]
        self.boundaries: list[_Boundary] = []

    def forward(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        ex = self.executor
        route = ex.capture_route(layer, hidden, topk_ids, topk_weights) if self.two_phase else None
        self.graphs[-1].capture_end()
        if route is None:
            out = torch.empty_like(hidden)
            self.boundaries.append(_Boundary(layer, hidden, topk_ids, topk_weights, out))
        else:
            experts_graph = torch.cuda.CUDAGraph()
            experts_graph.capture_begin(pool=self.pool)
            gpu_out = ex.capture_experts(route)
            experts_graph.capture_end()
            # gpu_out stays referenced, so no later capture in the shared pool reuses its memory
            self.boundaries.append(_Boundary(layer, hidden, topk_ids, topk_weights, gpu_out, route, experts_graph))
        self.graphs.append(torch.cuda.CUDAGraph())
        self.graphs[-1].capture_begin(pool=self.pool)
        return out if route is None else ex.capture_combine(route, gpu_out)


class GraphedDecoder:
    def __init__(self, lm, cache: PagedKVCache):
        if cache.max_pages is None or cache.allocator.num_pages != cache.max_pages:
            raise ValueError("CUDA-graph decode needs a KV cache allocated at its full size")
        self.lm, self.cache = lm, cache
        self.pool = torch.cuda.graph_pool_handle()
        self.captured: dict[int, _Captured] = {}

    @property
    def capacity(self) -> int:
        """Tokens the pool holds (it can be resized while serving)."""
        return self.cache.max_pages * self.cache.page_size

    def window_for(self, n_tokens: int) -> int:
        w = MIN_WINDOW
        while w < n_tokens:
            w *= 2
        return min(w, self.capacity)

    def step(self, seq: SequenceKV, token: int) -> torch.Tensor:
        """Appends `token` to `seq` and returns the next-token logits [V]."""
        self.cache.reserve(seq, 1)
        window = self.window_for(seq.length + 1)
        entry = self.captured.get(window)
        if entry is None or entry.slots_version != getattr(self.lm.experts, "slots_version", 0) \
                or entry.kv_version != self.cache.version:
            entry = self._capture(window, seq)  # first use, or the executor's slots or the KV pool moved
        entry.ctx.prepare(seq)
        entry.token.fill_(token)
        entry.replay(self.lm.experts)
        self.cache.commit(seq, 1)
        entry.ctx.commit_state(seq)
        return entry.logits[0]

    def _capture(self, window: int, seq: SequenceKV) -> _Captured:
        ctx = StaticDecodeAttention(self.cache, window)
        ctx.prepare(seq)  # warm-up and capture write this step's K/V to its own slot; the replay rewrites them
        token = torch.zeros(1, dtype=torch.long, device=self.cache.device)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture stream, as CUDA graphs require
            for _ in range(2):
                self.lm.model(token, ctx, "last")
        torch.cuda.current_stream().wait_stream(side)
        if getattr(self.lm.experts, "capturable", True):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                logits = self.lm.model(token, ctx, "last")
            entry = _Captured([graph], [], ctx, token, logits)
        else:
            entry = self._capture_segments(ctx, token)
        entry.kv_version = self.cache.version
        self.captured[window] = entry
        return entry

    def _capture_segments(self, ctx: StaticDecodeAttention, token: torch.Tensor) -> _Captured:
        from freetoken.engine.loader import attach_experts

        experts = self.lm.experts
        segmenter = _SegmentingExecutor(self.pool, experts)
        if segmenter.two_phase:
            experts.prepare_graph_io(int(token.numel()))
        attach_experts(self.lm.model, segmenter)
        torch.cuda.synchronize()
        try:
            with torch.cuda.stream(torch.cuda.Stream()):  # capture needs a side stream, as torch.cuda.graph uses
                segmenter.graphs[0].capture_begin(pool=self.pool)
                logits = self.lm.model(token, ctx, "last")
                segmenter.graphs[-1].capture_end()
        finally:
            attach_experts(self.lm.model, experts)
        torch.cuda.synchronize()
        return _Captured(segmenter.graphs, segmenter.boundaries, ctx, token, logits,
                         getattr(experts, "slots_version", 0))
