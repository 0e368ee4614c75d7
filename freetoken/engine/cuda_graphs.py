"""CUDA-graph decode: one captured decode step per window size, replayed for every token.

Eager decode of a small model is bound by launching a thousand-odd kernels per token from Python; a replayed
graph launches them all at once. A step is captured per window W and slots past the sequence are masked. Where
its attention reads the keys in place (the paged kernel: plain attention on CUDA), a longer window costs nothing,
so the one window is the cache's whole capacity: a sequence never waits for a capture as it grows (a 48-layer
offloaded capture takes ~0.5 s: a 17-token reply after a 26k-token prompt decoded at 13 instead of 22 tok/s,
evals/results/a1-qwen3-30b-a3b-16gib-h200.md). Where it gathers them (sinks, sliding windows, MLA, DSA), windows
are powers of two from 256 up to the capacity, the smallest covering the sequence replayed.
Capture needs fixed tensor addresses, so the KV pools must not grow: the cache is allocated at full size.

An executor that must look routing up on the host (offloaded experts) cannot be captured; then the step is
captured in segments, cut at every routed-expert call: segment i runs everything from the previous MoE's output
up to layer i's router, the executor runs eagerly on the segment's output tensors, and its result is copied into
the static input of segment i+1. The dense work still replays from graphs; only the expert work is eager.
An executor that offers the graph-boundary calls (`prepare_graph_io`, `capture_route`, `capture_experts`,
`capture_combine`, `run_boundary`: the offloading executor) gets more captured: the segment also copies the
routing to the host, its expert matmul is a graph of its own, and only planning and copies stay on the host.

A continuous-batching step of B sequences decoding one token each (`step_batch`) is captured the same way, per
batch size (powers of two from 2: a step of 5 sequences replays the graph of 8 with three padding rows) and window
(the longest sequence's). Eager, that step is bound by the host launching ~100 kernels per layer (~20 ms for 8
layers at 4 and at 16 sequences, evals/results/serve-q3-8l-h200.md). Padding rows write their keys to a scratch
page borrowed for the step and are left out of every expert call the host makes, so they never cost a copy.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass

import torch

from freetoken.engine import gpu_paths
from freetoken.engine.attention import BatchAttention, StaticBatchAttention, StaticDecodeAttention
from freetoken.engine.kv_cache import PagedKVCache, SequenceKV
from freetoken.engine.offload import cudart

log = logging.getLogger(__name__)

MIN_WINDOW = 256
BATCH_ROWS = BatchAttention.BATCHED_DECODE_ROWS  # batch × window of a captured batched step: its gathered keys


def batch_size_for(n: int) -> int:
    """The captured batch size a step of `n` sequences replays: the next power of two."""
    return 1 << max(0, n - 1).bit_length()


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
    ctx: StaticDecodeAttention | StaticBatchAttention
    tokens: torch.Tensor  # [B] input buffer
    logits: torch.Tensor  # [B, V] output buffer
    slots_version: int = 0  # the executor's slot tensors these graphs read (recaptured when they change)
    kv_version: int = 0  # the KV pool tensors they read (a resized pool is reallocated)
    launches: list | None = None  # per graph: its runtime handle, or None (replayed through torch); see replay

    def replay(self, experts, rows: int) -> None:
        """Replays the step; the host's expert calls see only the first `rows` rows (the rest are padding).
        A segmented step launches its graphs through the runtime: torch's `replay` costs the host ~20 µs a graph
        (the RNG offsets it advances; decode draws no random numbers), two graphs a layer on the critical path
        of an offloaded step."""
        batch = self.tokens.shape[0]
        if self.launches is None:
            self.launches = self._launches()
        stream = torch.cuda.current_stream().cuda_stream if any(self.launches) else None
        for i, graph in enumerate(self.graphs):
            self._launch(graph, self.launches[i], stream)
            if i < len(self.boundaries):
                b = self.boundaries[i]
                if b.route is not None:
                    handle = self.launches[len(self.graphs) + i]
                    experts.run_boundary(b.route, functools.partial(self._launch, b.experts_graph, handle, stream),
                                         rows)
                elif rows == batch:
                    b.out.copy_(experts.forward(b.layer, b.hidden, b.topk_ids, b.topk_weights))
                else:  # padding rows keep what their buffer held (zeros, or an earlier step's rows): finite
                    b.out[:rows].copy_(experts.forward(b.layer, b.hidden[:rows], b.topk_ids[:rows],
                                                       b.topk_weights[:rows]))

    def _launches(self) -> list:
        """Runtime handles of the segment graphs, then of each boundary's experts graph (None where torch gives
        none, or for a single graph: one replay a step is not worth it)."""
        graphs = self.graphs + [b.experts_graph for b in self.boundaries]
        if len(self.graphs) == 1 or not cudart.available():
            return [None] * len(graphs)
        return [None if g is None else cudart.graph_exec(g) for g in graphs]

    @staticmethod
    def _launch(graph: torch.cuda.CUDAGraph, handle: int | None, stream: int | None) -> None:
        if handle is None:
            graph.replay()
        else:
            cudart.launch_graph(handle, stream)


class _SegmentingExecutor:
    """Stands in for the executor during a segmented capture: ends the running segment's capture at each call,
    notes the call's tensors, and starts capturing the next segment, which reads a static output buffer."""

    capturable = True

    def __init__(self, pool, executor, tokens: int):
        self.pool, self.executor = pool, executor
        self.two_phase = hasattr(executor, "graph_boundaries") and executor.graph_boundaries(tokens)
        self.graphs = [torch.cuda.CUDAGraph()]
        self.boundaries: list[_Boundary] = []

    def forward(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        ex = self.executor
        route = ex.capture_route(layer, hidden, topk_ids, topk_weights) if self.two_phase else None
        self.graphs[-1].capture_end()
        if route is None:
            out = torch.zeros_like(hidden)
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
        self.captured: dict[tuple[int, int], _Captured] = {}  # (batch, window) → its step
        # whether a single sequence's captured attention reads the keys in place; None until the first capture
        self.in_place: bool | None = None

    @property
    def capacity(self) -> int:
        """Tokens the pool holds (it can be resized while serving)."""
        return self.cache.max_pages * self.cache.page_size

    def window_for(self, n_tokens: int, batch: int = 1) -> int:
        """The window a step of `batch` sequences up to `n_tokens` replays: the capacity where its attention reads
        the keys in place (a single sequence's first capture tries it; a batch's kernel is "batch-paged-decode"),
        else the smallest power of two from MIN_WINDOW covering them."""
        if self._in_place(batch):
            return self.capacity
        w = MIN_WINDOW
        while w < n_tokens:
            w *= 2
        return min(w, self.capacity)

    def _in_place(self, batch: int) -> bool:
        """Whether a step of `batch` sequences attends through the paged kernel: for one sequence, assumed until its
        first capture shows otherwise; a batch's kernel (GPU path "batch-paged-decode") has the same conditions."""
        if batch == 1:
            return self.in_place is not False
        return bool(self.in_place) and gpu_paths.enabled("batch-paged-decode")

    def step(self, seq: SequenceKV, token: int) -> torch.Tensor:
        """Appends `token` to `seq` and returns the next-token logits [V]."""
        self.cache.reserve(seq, 1)
        entry = self._entry(1, self.window_for(seq.length + 1), lambda ctx: ctx.prepare(seq))
        if self.in_place is None:  # (a gathering attention's capacity window serves only the longest sequences)
            self.in_place = entry.ctx.reads_in_place
        entry.ctx.prepare(seq)
        entry.tokens.fill_(token)
        entry.replay(self.lm.experts, 1)
        self.cache.commit(seq, 1)
        entry.ctx.commit_state(seq)
        return entry.logits[0]

    def step_batch(self, seqs: list[SequenceKV], tokens: list[int]) -> torch.Tensor | None:
        """Appends tokens[i] to seqs[i] (two or more sequences) and returns their next-token logits [N, V]; None,
        with nothing appended, where the step does not fit a captured one (its padded batch × window past
        BATCH_ROWS, or no free page to lend the padding rows): the caller runs it eagerly."""
        n, cache = len(seqs), self.cache
        batch = batch_size_for(n)
        window = self.window_for(max(s.length for s in seqs) + 1, batch)
        if batch * window > BATCH_ROWS and not self._in_place(batch):  # the gathered keys' bound
            return None
        for seq in seqs:  # (reserved either way: the eager step would reserve the same slots)
            cache.reserve(seq, 1)
        if batch > n and cache.allocator.num_free == 0:
            return None
        scratch = cache.allocator.allocate(1) if batch > n else []  # the padding rows' keys go here
        try:
            slot = scratch[0] * cache.page_size if scratch else 0
            entry = self._entry(batch, window, lambda ctx: ctx.prepare(seqs, slot))
            entry.ctx.prepare(seqs, slot)
            entry.tokens.copy_(torch.tensor(tokens + [0] * (batch - n)).pin_memory(), non_blocking=True)
            entry.replay(self.lm.experts, n)
        finally:
            cache.allocator.free(scratch)  # (later work that reuses the page is queued after this step's)
        for seq in seqs:
            cache.commit(seq, 1)
        return entry.logits[:n]

    def _entry(self, batch: int, window: int, prepare) -> _Captured:
        """The captured step of this size, captured now on first use or when the executor's slots or the KV pool
        moved; `prepare(ctx)` points a new context at the step's sequences (warm-up and capture write the step's
        K/V to its own slots; the replay rewrites them)."""
        entry = self.captured.get((batch, window))
        if entry is None or entry.slots_version != getattr(self.lm.experts, "slots_version", 0) \
                or entry.kv_version != self.cache.version:
            ctx = StaticDecodeAttention(self.cache, window) if batch == 1 else \
                StaticBatchAttention(self.cache, batch, window)
            prepare(ctx)
            t0 = time.perf_counter()
            entry = self._capture(ctx, batch)
            self.captured[(batch, window)] = entry
            log.debug("captured the decode step of %d sequence(s) over %d slots in %.0f ms (%d graphs)", batch, window,
                      1e3 * (time.perf_counter() - t0), len(entry.graphs))
        return entry

    def _capture(self, ctx: StaticDecodeAttention | StaticBatchAttention, batch: int) -> _Captured:
        tokens = torch.zeros(batch, dtype=torch.long, device=self.cache.device)
        logits_for = "last" if batch == 1 else "all"
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture stream, as CUDA graphs require
            for _ in range(2):
                self.lm.model(tokens, ctx, logits_for)
        torch.cuda.current_stream().wait_stream(side)
        if getattr(self.lm.experts, "capturable", True):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                logits = self.lm.model(tokens, ctx, logits_for)
            entry = _Captured([graph], [], ctx, tokens, logits)
        else:
            entry = self._capture_segments(ctx, tokens, logits_for)
        entry.kv_version = self.cache.version
        return entry

    def _capture_segments(self, ctx: StaticDecodeAttention | StaticBatchAttention, tokens: torch.Tensor,
                          logits_for: str) -> _Captured:
        from freetoken.engine.loader import attach_experts

        experts = self.lm.experts
        segmenter = _SegmentingExecutor(self.pool, experts, int(tokens.numel()))
        if segmenter.two_phase:
            experts.prepare_graph_io(int(tokens.numel()))
        attach_experts(self.lm.model, segmenter)
        torch.cuda.synchronize()
        try:
            with torch.cuda.stream(torch.cuda.Stream()):  # capture needs a side stream, as torch.cuda.graph uses
                segmenter.graphs[0].capture_begin(pool=self.pool)
                logits = self.lm.model(tokens, ctx, logits_for)
                segmenter.graphs[-1].capture_end()
        finally:
            attach_experts(self.lm.model, experts)
        torch.cuda.synchronize()
        return _Captured(segmenter.graphs, segmenter.boundaries, ctx, tokens, logits,
                         getattr(experts, "slots_version", 0))
