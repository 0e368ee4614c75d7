"""DeepSeek-V4 (`deepseek_v4`; V4-Flash, V4-Pro): shared-KV attention over a sliding window plus compressed
history, manifold-constrained hyper-connections, hash-routed and top-k routed MoE.

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
cache holds nothing for this family; a sequence is restored from a snapshot (a fork), as the hybrid families'.

Residual: `hc_mult` streams per token. Before each block a small projection of the streams gives a collapse
weight per stream (`pre`), an expand weight (`post`) and a stream-mixing matrix (`comb`, made doubly stochastic
by Sinkhorn iterations): block input = Σ pre·stream, new streams = post·block output + combᵀ·streams. `hc_head`
collapses the streams before the final norm.

MoE: every layer routes; scores sqrt(softplus(logits)) (or sigmoid / softmax), renormalised over the chosen and
scaled. The first "hash_moe" layers choose their experts by token id (`tid2eid[token]`), the rest by top-k of
the scores plus a selection bias. Experts and the one shared expert use a SwiGLU clamped at `swiglu_limit`.

Weight names are DeepSeek's own (`attn.wq_a`, `ffn.experts.N.w1`, `hc_attn_fn`: what transformers writes back).
The multi-token-prediction layers are not loaded.

Shapes: T tokens, N streams, Hd hidden, H heads, D head dim, r rope dims, n compressed entries, m compress rate,
Hi / Di indexer heads / head dim, G output groups.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.engine import gpu_paths
from freetoken.engine.attention import SequenceAttention, sink_attention
from freetoken.engine.config import MoESpec
from freetoken.engine.experts import ExpertExecutor, ExpertForm
from freetoken.engine.models.common_args import decoder_args
from freetoken.engine.models.decoder import DecoderArgs, DecoderModel, RMSNorm
from freetoken.engine.models.moe import ExpertNaming
from freetoken.engine.rope import RopeConfig, inverse_frequencies
from freetoken.errors import ModelLoadError, UnsupportedArchitectureError

MODEL_TYPE = "deepseek_v4"
EXPERT_NAMING = ExpertNaming(re.compile(r"model\.layers\.(\d+)\.ffn\.experts\.(\d+)\.(w1|w2|w3)\.weight"),
                             {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"})

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
_RATIO_KINDS = {0: SLIDING, 4: CSA, 128: HCA}  # older configs' `compress_ratios`


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


@dataclass(slots=True)
class Routing:
    num_experts: int
    top_k: int
    intermediate_size: int
    n_shared: int
    scoring: str
    scale: float
    hash_layers: tuple[int, ...]
    swiglu_limit: float


@dataclass(slots=True)
class ModelArgs:
    decoder: DecoderArgs
    attention: AttentionArgs
    routing: Routing
    hc_mult: int
    hc_iters: int
    hc_eps: float
    full_attention_layers: tuple[int, ...] = ()  # the paged cache holds no layer's rows (see the module doc)
    values_are_keys: bool = True

    @classmethod
    def from_config(cls, cfg: dict) -> ModelArgs:
        dec = decoder_args(cfg)
        n, head_dim = dec.n_layers, dec.attention.head_dim
        factor = cfg.get("partial_rotary_factor")
        rope_dim = int(cfg.get("qk_rope_head_dim") or head_dim * (factor if factor is not None else 64 / 512))
        kinds = cfg.get("layer_types") or [_RATIO_KINDS[r] for r in cfg.get("compress_ratios") or []] or \
            [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
        rates = {CSA: 4, HCA: 128, **(cfg.get("compress_rates") or {})}
        mlp_kinds = cfg.get("mlp_layer_types") or \
            ["hash_moe"] * int(cfg.get("num_hash_layers", 3)) + ["moe"] * n
        main, compress = _ropes(cfg, rope_dim, dec.max_position_embeddings)
        attention = AttentionArgs(dec.attention.n_heads, head_dim, rope_dim, int(cfg["q_lora_rank"]),
                                  int(cfg["o_groups"]), int(cfg["o_lora_rank"]), int(cfg.get("sliding_window") or 128),
                                  tuple(kinds[:n]), {k: int(rates[k]) for k in (CSA, HCA)},
                                  int(cfg["index_n_heads"]), int(cfg["index_head_dim"]), int(cfg["index_topk"]),
                                  dec.rms_norm_eps, compress)
        routing = Routing(int(cfg["n_routed_experts"]), int(cfg["num_experts_per_tok"]),
                          int(cfg["moe_intermediate_size"]), int(cfg.get("n_shared_experts") or 0),
                          cfg.get("scoring_func") or "sqrtsoftplus", float(cfg.get("routed_scaling_factor") or 1.0),
                          tuple(i for i, k in enumerate(mlp_kinds[:n]) if k == "hash_moe"),
                          float(cfg.get("swiglu_limit") or 0.0))
        if routing.scoring not in _SCORES:
            raise UnsupportedArchitectureError(f"deepseek_v4 scoring_func {routing.scoring!r}; known: "
                                               f"{', '.join(_SCORES)}")
        dec = dataclasses.replace(dec, rope=main)
        return cls(dec, attention, routing, int(cfg.get("hc_mult") or 4),
                   int(cfg.get("hc_sinkhorn_iters") or 20), float(cfg.get("hc_eps") or 1e-6))

    def token_mixers(self) -> str:
        """What `ft info` says of the attention layers and the per-sequence state they keep."""
        a = self.attention
        count = {k: a.kinds.count(k) for k in (HCA, CSA, SLIDING)}
        # compressed entries a token adds, in bf16: D per m tokens (CSA: and the indexer's Di per m)
        per_token = 2 * sum(a.head_dim / a.rates[k] + (a.index_dim / a.rates[k] if k == CSA else 0)
                            for k in a.kinds if k != SLIDING)
        return (f"{count[HCA]} HCA (1 entry per {a.rates[HCA]} tokens), {count[CSA]} CSA (1 per {a.rates[CSA]}, "
                f"top-{a.index_topk} entries), {count[SLIDING]} sliding only; windows of {a.window} keys; state per "
                f"sequence, not paged: {per_token:.0f} B of compressed history per token in bf16")

    def moe_spec(self) -> MoESpec:
        r = self.routing
        return MoESpec(tuple(range(self.decoder.n_layers)), r.num_experts, r.top_k, self.decoder.hidden_size,
                       r.intermediate_size, r.n_shared, r.intermediate_size if r.n_shared else 0)


def _ropes(cfg: dict, rope_dim: int, max_pos: int) -> tuple[RopeConfig, RopeConfig]:
    """The "main" RoPE (sliding layers) and the "compress" one (compressed layers, compressors, indexer), as
    transformers nests them in `rope_parameters`; a flat spelling is the compress one's scaling (YaRN) with
    `compress_rope_theta`, as transformers reads it. YaRN here never scales cos/sin (attention_factor 1)."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(cfg.get("rope_theta") or 10000.0)
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        main, compress = dict(params["main"]), dict(params["compress"])
    else:
        flat = {k: v for k, v in params.items() if k not in ("main", "compress", "rope_theta")}
        main = {"rope_type": "default", "rope_theta": theta}
        compress = {"rope_type": "default", **flat, "rope_theta": float(cfg.get("compress_rope_theta") or 160000.0)}

    def config(p: dict) -> RopeConfig:
        kind = p.pop("rope_type", None) or p.pop("type", None) or "default"
        t = float(p.pop("rope_theta", theta))
        p.pop("partial_rotary_factor", None)
        if kind == "yarn":
            p.setdefault("attention_factor", 1.0)
        return RopeConfig(t, rope_dim, kind, p, max_pos)

    return config(main), config(compress)


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


# ------------------------------------------------------------------------------------------------- attention


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

    def forward(self, x: torch.Tensor, ropes: dict[str, tuple[torch.Tensor, torch.Tensor]],
                ctx: SequenceAttention) -> torch.Tensor:
        """`ropes`: cos, sin of the tokens' positions under the "main" and the "compress" RoPE."""
        a, t = self.a, x.shape[0]
        if not isinstance(ctx, SequenceAttention):
            raise UnsupportedArchitectureError("deepseek_v4 runs one sequence at a time, eagerly (its attention "
                                               "state is per sequence): no batched or captured decode steps")
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


# ------------------------------------------------------------------------------------------- hyper-connections


def hyper_weights(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
                  eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, N, Hd] → (pre [T, N], post [T, N], comb [T, N, N]), in fp32: one projection of the normed,
    flattened streams, then `hyper_mix` (on CUDA with the GPU path "hyper-sinkhorn", one Triton launch instead
    of ~120 small ones: kernels/hyper_sinkhorn)."""
    mixes = F.linear(rms(streams.flatten(1).float(), norm_eps), fn.float())
    mix = hyper_mix
    if mixes.is_cuda and gpu_paths.enabled("hyper-sinkhorn"):
        from freetoken.kernels.hyper_sinkhorn import kernel

        if kernel.available(mixes.device):
            mix = kernel.hyper_mix
    return mix(mixes, base.float(), scale.float(), streams.shape[1], iters, eps)


def hyper_mix(mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int,
              eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mixes [T, (2 + N) N], base [(2 + N) N], scale [3] (fp32) → pre, post [T, N] and comb [T, N, N]: the
    streams' weights into a block, the block's output into each stream, and the streams' mixing, made doubly
    stochastic by `iters` rounds of Sinkhorn-Knopp (it mixes streams without growing them)."""
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(-1, n, n) * scale[2] + comb_b.view(n, n), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb


class HyperHead(nn.Module):
    """The final collapse of the streams into one (before the model's norm)."""

    def __init__(self, hidden_size: int, n: int, eps: float, norm_eps: float):
        super().__init__()
        self.hc_fn = nn.Parameter(torch.zeros(n, n * hidden_size))
        self.hc_base = nn.Parameter(torch.zeros(n))
        self.hc_scale = nn.Parameter(torch.zeros(1))
        self.eps, self.norm_eps = eps, norm_eps

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mixes = F.linear(rms(streams.flatten(1).float(), self.norm_eps), self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.eps
        return (pre[..., None] * streams).sum(dim=1).to(streams.dtype)


# ------------------------------------------------------------------------------------------------------- MoE


def clamped_swiglu(limit: float) -> ExpertForm:
    """silu(min(g, limit)) · clamp(u, ±limit): V4's experts, on every expert path (GPU, CPU kernel, torch)."""
    return ExpertForm(limit=limit, clamp_silu=True)


class SharedExpert(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, limit: float):
        super().__init__()
        self.w1 = nn.Linear(hidden_size, intermediate_size, bias=False)  # gate
        self.w2 = nn.Linear(intermediate_size, hidden_size, bias=False)  # down
        self.w3 = nn.Linear(hidden_size, intermediate_size, bias=False)  # up
        self.form = clamped_swiglu(limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.form.activate(self.w1(x), self.w3(x)))


_SCORES = {"sqrtsoftplus": lambda z: F.softplus(z).sqrt(), "sigmoid": torch.sigmoid,
           "softmax": lambda z: z.softmax(dim=-1)}


class Router(nn.Module):
    """Scores per expert; a hash layer takes the experts its table gives each token id, the others the top-k of
    the scores plus a selection bias. The chosen scores, renormalised and scaled, weigh the experts (fp32)."""

    def __init__(self, hidden_size: int, r: Routing, vocab_size: int, hashed: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(r.num_experts, hidden_size))
        if hashed:
            self.tid2eid = nn.Parameter(torch.zeros(vocab_size, r.top_k, dtype=torch.long), requires_grad=False)
        else:
            self.bias = nn.Parameter(torch.zeros(r.num_experts))
        self.top_k, self.score, self.scale = r.top_k, _SCORES[r.scoring], r.scale

    def forward(self, x: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, Hd], tokens [T] → (weights [T, K] fp32, ids [T, K])."""
        scores = self.score(F.linear(x.float(), self.weight.float()))
        if hasattr(self, "tid2eid"):
            ids = self.tid2eid[tokens]
        else:
            ids = (scores + self.bias.float()).topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.scale, ids


class MoE(nn.Module):
    def __init__(self, layer_idx: int, hidden_size: int, r: Routing, vocab_size: int):
        super().__init__()
        self.layer_idx, self.top_k = layer_idx, r.top_k
        self.gate = Router(hidden_size, r, vocab_size, layer_idx in r.hash_layers)
        if r.n_shared:  # transformers' shared expert is one MLP of the expert width, whatever n_shared_experts
            self.shared_experts = SharedExpert(hidden_size, r.intermediate_size, r.swiglu_limit)
        self.experts: ExpertExecutor | None = None  # attached by the loader

    def forward(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x, tokens)
        out = self.experts.forward(self.layer_idx, x, ids, weights.to(x.dtype))
        return out + self.shared_experts(x) if hasattr(self, "shared_experts") else out


# --------------------------------------------------------------------------------------------------- model


class Layer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        dec, n = args.decoder, args.hc_mult
        self.args = args
        self.attn_norm = RMSNorm(dec.hidden_size, dec.rms_norm_eps)
        self.attn = Attention(dec.hidden_size, args.attention, layer_idx)
        self.ffn_norm = RMSNorm(dec.hidden_size, dec.rms_norm_eps)
        self.ffn = MoE(layer_idx, dec.hidden_size, args.routing, dec.vocab_size)
        for block in ("attn", "ffn"):
            setattr(self, f"hc_{block}_fn", nn.Parameter(torch.zeros((2 + n) * n, n * dec.hidden_size)))
            setattr(self, f"hc_{block}_base", nn.Parameter(torch.zeros((2 + n) * n)))
            setattr(self, f"hc_{block}_scale", nn.Parameter(torch.zeros(3)))

    def _around(self, block: str, streams: torch.Tensor, run) -> torch.Tensor:
        """Collapses the streams into the block's input, runs it, expands its output back beside the mixed
        streams."""
        a = self.args
        pre, post, comb = hyper_weights(streams, getattr(self, f"hc_{block}_fn"), getattr(self, f"hc_{block}_base"),
                                        getattr(self, f"hc_{block}_scale"), a.hc_iters, a.hc_eps,
                                        a.decoder.rms_norm_eps)
        out = run((pre[..., None] * streams).sum(dim=1).to(streams.dtype))
        dtype = streams.dtype
        return post.to(dtype)[..., None] * out[:, None, :] + comb.to(dtype).transpose(1, 2) @ streams

    def forward(self, streams: torch.Tensor, ropes: dict, ctx: SequenceAttention, tokens: torch.Tensor):
        streams = self._around("attn", streams, lambda x: self.attn(self.attn_norm(x), ropes, ctx))
        return self._around("ffn", streams, lambda x: self.ffn(self.ffn_norm(x), tokens))


class Model(DecoderModel):
    def __init__(self, args: ModelArgs):
        super().__init__(args.decoder, lambda i: Layer(args, i))
        self.v4 = args
        dec = args.decoder
        self.model.hc_head = HyperHead(dec.hidden_size, args.hc_mult, args.hc_eps, dec.rms_norm_eps)

    def expert_forms(self) -> dict[int, ExpertForm]:
        """Every layer's experts clamp their SwiGLU."""
        limit = self.v4.routing.swiglu_limit
        return {i: clamped_swiglu(limit) for i in range(self.v4.decoder.n_layers)} if limit else {}

    def forward(self, tokens: torch.Tensor, ctx: SequenceAttention,
                logits_for: str | torch.Tensor = "all") -> torch.Tensor:
        x = self.model.embed_tokens(tokens)
        ropes = {"main": rope_tables(self.v4.decoder.rope, ctx.positions, x.dtype),
                 "compress": rope_tables(self.v4.attention.compress_rope, ctx.positions, x.dtype)}
        streams = x[:, None, :].expand(-1, self.v4.hc_mult, -1).contiguous()
        for layer in self.model.layers:
            streams = layer(streams, ropes, ctx, tokens)
        x = self.model.hc_head(streams)
        if isinstance(logits_for, torch.Tensor):
            x = x[logits_for]
        elif logits_for == "last":
            x = x[-1:]
        return F.linear(self.model.norm(x), self.output_weight())


_TOP_LEVEL = {"embed.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight",
              "norm.weight": "model.norm.weight", "hc_head_fn": "model.hc_head.hc_fn",
              "hc_head_base": "model.hc_head.hc_base", "hc_head_scale": "model.hc_head.hc_scale"}
_LAYER = re.compile(r"(?:model\.)?layers\.(\d+)\.(.+)")


def checkpoint_name(name: str, args: ModelArgs) -> str | None:
    """DeepSeek's names (transformers writes them back on save), with or without the `model.` prefix; the
    multi-token-prediction layers (`mtp.*`, or layers past the model's) are left out."""
    if name.startswith("mtp."):
        return None
    if name.endswith((".scale", "_scale_inv")):  # the checkpoint reader consumes them under an fp8 config
        raise ModelLoadError(f"{name}: block scales, but config.json has no quantization_config with quant_method "
                             "fp8 and a weight_block_size; the checkpoint's config is incomplete")
    if (m := _LAYER.fullmatch(name)) is not None:
        return None if int(m.group(1)) >= args.decoder.n_layers else f"model.layers.{m.group(1)}.{m.group(2)}"
    return _TOP_LEVEL.get(name.removeprefix("model."), name)
