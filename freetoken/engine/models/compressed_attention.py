"""DeepSeek-V4's attention (`deepseek_v4`): shared-KV attention over a sliding window plus compressed history.

Attention (one KV head, read as both keys and values): queries from a query LoRA (each head RMS-normed without a
weight), one key per token (RMS-normed); RoPE on the last `rope_dim` dims of each, pairs interleaved. Every query
sees the last `sliding_window` raw keys and, in compressed layers, the history compressed every m tokens:
- "heavily_compressed_attention" (HCA, m = 128): one entry per closed window of m tokens, a softmax-gated sum of
  their projections (a learnt per-slot bias `ape` in the gate), RMS-normed, rotated at the window's first position.
- "compressed_sparse_attention" (CSA, m = 4): windows overlap by one (an entry mixes the previous window's
  first-half projections with its own second-half ones), and a lightning indexer (its own compressor at
  `index_head_dim`) scores the entries; each query attends to its `index_topk` best.
A query at position t sees entry w once its window closed: w < (t + 1) // m. Each head's softmax also counts a
learnt sink; the keys are the values, so the output's rotary dims are rotated back by the query's position before
the grouped output projection (`wo_a` per head group, then `wo_b`). Sliding layers use the "main" RoPE, compressed
ones the "compress" RoPE (its own theta, YaRN without attention scaling).

State: no layer needs more than the last `sliding_window - 1` raw keys, the compressed entries and, per
compressor, the projections of the tokens of the window still open (plus, overlapping, the last closed window's
first halves). That state is the sequence's recurrent state (`ctx.recurrent_state`), not paged K/V: the paged
cache holds nothing for this family; a sequence is restored from a snapshot (a fork), as the hybrid families'. In
a batched forward each sequence's rows attend through its own state (`attention.sequence_rows`).

Shapes: T tokens, H heads, D head dim, r rope dims, n compressed entries, m compress rate, Hi / Di indexer heads /
head dim, G output groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from freetoken.engine.attention import (
    SequenceAttention,
    SequenceRows,
    TrailingAttention,
    sequence_rows,
    sink_attention,
)
from freetoken.engine.models.decoder import RMSNorm
from freetoken.engine.rope import RopeConfig, inverse_frequencies
from freetoken.errors import UnsupportedArchitectureError

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


@dataclass(slots=True)
class AttentionArgs:
    n_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window: int
    kinds: tuple[str, ...]  # per layer
    rates: dict[str, int]  # CSA / HCA compress rate
    index_heads: int
    index_dim: int
    index_topk: int
    eps: float
    compress_rope: RopeConfig  # the compressed layers', their compressors' and the indexer's


def rope_tables(rc: RopeConfig, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, r/2]: one angle per interleaved pair."""
    inv_freq, scaling = inverse_frequencies(rc)
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
    return (freqs.cos() * scaling).to(dtype), (freqs.sin() * scaling).to(dtype)


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, ..., D] with its last 2·cos.shape[-1] dims rotated in interleaved pairs (2i, 2i+1) by angle i of its
    row's position; `-sin` rotates back. In fp32, as the reference."""
    r = 2 * cos.shape[-1]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (r // 2,)
    c, s = cos.float().view(shape), sin.float().view(shape)
    even, odd = x[..., -r::2].float(), x[..., -r + 1::2].float()
    rotated = torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2)
    return torch.cat((x[..., :-r], rotated.to(x.dtype)), dim=-1)


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm without a weight (the query heads', the hyper-connections' input)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class Compressor(nn.Module):
    """Every m tokens into one entry of width `dim`. With `overlap` (CSA) each token projects to two halves: the
    first joins the next window's entry, the second its own, so an entry is a softmax over 2m slots.

    State (tensors, in order): entries [n, dim]; the open window's projections and gate logits [< m, C]; with
    overlap, the last closed window's first halves [m, dim] (zeros with -inf gates before the first: no weight)."""

    def __init__(self, hidden_size: int, dim: int, rate: int, overlap: bool, a: AttentionArgs):
        super().__init__()
        width = 2 * dim if overlap else dim
        self.dim, self.rate, self.overlap, self.rope = dim, rate, overlap, a.compress_rope
        self.wkv = nn.Linear(hidden_size, width, bias=False)
        self.wgate = nn.Linear(hidden_size, width, bias=False)
        self.ape = nn.Parameter(torch.zeros(rate, width))  # the gate's bias per slot of a window
        self.norm = RMSNorm(dim, a.eps)

    def empty_state(self, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
        width, d, m = self.wkv.out_features, self.dim, self.rate
        prev = (like.new_zeros(m, d), like.new_full((m, d), float("-inf"))) if self.overlap else \
            (like.new_zeros(0, d), like.new_zeros(0, d))
        return like.new_zeros(0, d), like.new_zeros(0, width), like.new_zeros(0, width), *prev

    def forward(self, x: torch.Tensor, start: int, state: tuple[torch.Tensor, ...]
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """x [T, Hd] at positions start.. → (every entry so far [n, dim], the new state)."""
        entries, open_kv, open_gate, prev_kv, prev_gate = state
        first = start - open_kv.shape[0]  # the open window's first position (a multiple of m)
        kv, gate = torch.cat((open_kv, self.wkv(x))), torch.cat((open_gate, self.wgate(x)))
        m, d = self.rate, self.dim
        closed = kv.shape[0] // m
        if not closed:
            return entries, (entries, kv, gate, prev_kv, prev_gate)
        ck = kv[:closed * m].view(closed, m, -1)
        cg = gate[:closed * m].view(closed, m, -1) + self.ape.to(gate.dtype)
        if self.overlap:  # window w's 2m slots: window w-1's first halves, then its own second halves
            k = torch.cat((torch.cat((prev_kv[None], ck[:-1, :, :d])), ck[..., d:]), dim=1)
            g = torch.cat((torch.cat((prev_gate[None], cg[:-1, :, :d])), cg[..., d:]), dim=1)
            prev_kv, prev_gate = ck[-1, :, :d], cg[-1, :, :d]
        else:
            k, g = ck, cg
        new = self.norm((k * g.softmax(dim=1, dtype=torch.float32).to(k.dtype)).sum(dim=1))
        positions = first + m * torch.arange(closed, device=x.device)
        new = rope_tail(new, *rope_tables(self.rope, positions, new.dtype))
        entries = torch.cat((entries, new))
        return entries, (entries, kv[closed * m:], gate[closed * m:], prev_kv, prev_gate)


class Indexer(nn.Module):
    """CSA's lightning indexer: its own overlapping compressor at `index_head_dim`; query heads from the query
    LoRA; an entry's score for a query is Σ_h w_h · relu(q_h · k) / √Di with per-head weights from the input."""

    def __init__(self, hidden_size: int, a: AttentionArgs):
        super().__init__()
        self.heads, self.dim, self.topk = a.index_heads, a.index_dim, a.index_topk
        self.wq_b = nn.Linear(a.q_lora_rank, a.index_heads * a.index_dim, bias=False)
        self.weights_proj = nn.Linear(hidden_size, a.index_heads, bias=False)
        self.compressor = Compressor(hidden_size, a.index_dim, a.rates[CSA], True, a)

    def select(self, x: torch.Tensor, q_resid: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor,
               rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """visible [T, n] bool → the entries each query attends to: its `topk` best scored among the visible."""
        t = x.shape[0]
        q = rope_tail(self.wq_b(q_resid).view(t, self.heads, self.dim), *rope).float()
        scores = torch.relu(torch.einsum("thd,nd->thn", q, keys.float())) * self.dim ** -0.5
        w = self.weights_proj(x).float() * self.heads ** -0.5
        index = torch.einsum("th,thn->tn", w, scores).masked_fill(~visible, float("-inf"))
        # a stable sort: equal scores go to the earlier entry whatever the row's length (chunks choose as a whole)
        top = index.sort(dim=-1, descending=True, stable=True).indices[:, :self.topk]
        return visible & torch.zeros_like(visible).scatter_(-1, top, True)


class Attention(nn.Module):
    recurrent = True  # its state lives in the sequence's recurrent state (see the module doc)
    eager_only = True  # its state grows as windows close, and whether one closes is decided on the host

    def __init__(self, hidden_size: int, a: AttentionArgs, layer_idx: int):
        super().__init__()
        self.a, self.layer_idx, self.kind = a, layer_idx, a.kinds[layer_idx]
        h, d = a.n_heads, a.head_dim
        self.wq_a = nn.Linear(hidden_size, a.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(a.q_lora_rank, a.eps)
        self.wq_b = nn.Linear(a.q_lora_rank, h * d, bias=False)
        self.wkv = nn.Linear(hidden_size, d, bias=False)
        self.norm = RMSNorm(d, a.eps)
        self.wo_a = nn.Linear(h * d // a.o_groups, a.o_groups * a.o_lora_rank, bias=False)  # one block per group
        self.wo_b = nn.Linear(a.o_groups * a.o_lora_rank, hidden_size, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(h))
        if self.kind != SLIDING:
            self.compressor = Compressor(hidden_size, d, a.rates[self.kind], self.kind == CSA, a)
        if self.kind == CSA:
            self.indexer = Indexer(hidden_size, a)

    def _compressors(self) -> list[Compressor]:
        """In state order: the layer's own, then the indexer's."""
        found = [self.compressor] if hasattr(self, "compressor") else []
        return found + ([self.indexer.compressor] if hasattr(self, "indexer") else [])

    def forward(self, x: torch.Tensor, ropes: dict[str, tuple[torch.Tensor, torch.Tensor]], ctx) -> torch.Tensor:
        """`ropes`: cos, sin of the tokens' positions under the "main" and the "compress" RoPE. In a batched
        forward each sequence's rows attend through its own state."""
        parts = sequence_rows(ctx, x.shape[0])
        if len(parts) == 1:  # (a batch of one sequence: its rows' context)
            return self._forward(x, ropes, parts[0][2])
        return torch.cat([self._forward(x[lo:hi], {name: (c[lo:hi], s[lo:hi]) for name, (c, s) in ropes.items()}, rows)
                          for lo, hi, rows in parts])

    def _forward(self, x: torch.Tensor, ropes: dict[str, tuple[torch.Tensor, torch.Tensor]], ctx) -> torch.Tensor:
        a, t = self.a, x.shape[0]
        if not isinstance(ctx, (SequenceAttention, SequenceRows, TrailingAttention)):
            raise UnsupportedArchitectureError("deepseek_v4 decodes eagerly (its attention state changes shape as "
                                               "windows close): no captured decode steps")
        cos, sin = ropes["main" if self.kind == SLIDING else "compress"]
        q_resid = self.q_norm(self.wq_a(x))
        q = rope_tail(rms(self.wq_b(q_resid).view(t, a.n_heads, a.head_dim), a.eps), cos, sin)
        kv = rope_tail(self.norm(self.wkv(x)), cos, sin)  # [T, D]: the key and the value
        state = ctx.recurrent_state(self.layer_idx) or self._empty_state(x)
        start = int(ctx.positions[0])
        recent = state[0]  # the last (window - 1) keys before this call
        keys = torch.cat((recent, kv))
        query_pos = ctx.positions[:, None]
        key_pos = torch.arange(start - recent.shape[0], start + t, device=x.device)[None, :]
        visible = (key_pos <= query_pos) & (key_pos > query_pos - a.window)
        new_state = [keys[-(a.window - 1):] if a.window > 1 else keys[:0]]
        rest = state[1:]
        if self.kind != SLIDING:
            entries, compressed = self.compressor(x, start, rest[:5])
            new_state += compressed
            seen = torch.arange(entries.shape[0], device=x.device)[None, :] < (query_pos + 1) // self.compressor.rate
            if self.kind == CSA:
                index_keys, index_state = self.indexer.compressor(x, start, rest[5:])
                new_state += index_state
                seen = self.indexer.select(x, q_resid, index_keys, seen, (cos, sin))
            keys, visible = torch.cat((keys, entries)), torch.cat((visible, seen), dim=1)
        ctx.set_recurrent_state(self.layer_idx, tuple(new_state))
        out = sink_attention(q, keys[:, None], keys[:, None], visible, self.attn_sink)  # [T, H, D]
        out = rope_tail(out, cos, -sin)  # the values' rotation, undone at the query's position
        g = a.o_groups
        out = torch.einsum("tgi,gri->tgr", out.reshape(t, g, -1), self.wo_a.weight.view(g, a.o_lora_rank, -1))
        return self.wo_b(out.reshape(t, -1))

    def _empty_state(self, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
        state = [like.new_zeros(0, self.a.head_dim)]
        for c in self._compressors():
            state += c.empty_state(like)
        return tuple(state)
