"""CUDA-graph decode: one captured decode step per window size, replayed for every token.

Eager decode of a small model is bound by launching a thousand-odd kernels per token from Python; a replayed
graph launches them all at once. A step is captured per window W (powers of two from 256 up to the cache's
capacity), the smallest window covering the sequence is replayed, and slots past the sequence are masked.
Capture needs fixed tensor addresses, so the KV pools must not grow: the cache is allocated at full size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from freetoken.engine.attention import StaticDecodeAttention
from freetoken.engine.kv_cache import PagedKVCache, SequenceKV

MIN_WINDOW = 256


@dataclass(slots=True)
class _Captured:
    graph: torch.cuda.CUDAGraph
    ctx: StaticDecodeAttention
    token: torch.Tensor  # [1] input buffer
    logits: torch.Tensor  # [1, V] output buffer


class GraphedDecoder:
    def __init__(self, lm, cache: PagedKVCache):
        if cache.max_pages is None or cache.allocator.num_pages != cache.max_pages:
            raise ValueError("CUDA-graph decode needs a KV cache allocated at its full size")
        self.lm, self.cache = lm, cache
        self.capacity = cache.max_pages * cache.page_size
        self.pool = torch.cuda.graph_pool_handle()
        self.captured: dict[int, _Captured] = {}

    def window_for(self, n_tokens: int) -> int:
        w = MIN_WINDOW
        while w < n_tokens:
            w *= 2
        return min(w, self.capacity)

    def step(self, seq: SequenceKV, token: int) -> torch.Tensor:
        """Appends `token` to `seq` and returns the next-token logits [V]."""
        self.cache.reserve(seq, 1)
        window = self.window_for(seq.length + 1)
        entry = self.captured.get(window) or self._capture(window, seq)
        entry.ctx.prepare(seq)
        entry.token.fill_(token)
        entry.graph.replay()
        self.cache.commit(seq, 1)
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
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.lm.model(token, ctx, "last")
        entry = _Captured(graph, ctx, token, logits)
        self.captured[window] = entry
        return entry
