"""Building blocks shared by the decoder-only families: RMSNorm, GQA attention over the paged KV cache, the
dense SwiGLU MLP, the decoder layer and the embedding → layers → norm → head stack.

Parameter names mirror Hugging Face (`model.layers.N.self_attn.q_proj.weight`, ...), so a checkpoint loads by
name. A family file supplies its arguments, its MLP/MoE block per layer and its weight-name mapping.

Shapes: T tokens of one sequence, V vocab, Hd hidden, H query heads, Hkv KV heads, D head dim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.engine.attention import BatchAttention, SequenceAttention, StaticDecodeAttention
from freetoken.engine.rope import RopeConfig, RotaryEmbedding, apply_rope


@dataclass(slots=True)
class AttentionArgs:
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3)
    rms_norm_eps: float = 1e-6


@dataclass(slots=True)
class DecoderArgs:
    vocab_size: int
    hidden_size: int
    n_layers: int
    attention: AttentionArgs
    rope: RopeConfig
    rms_norm_eps: float
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 whatever the activation dtype, as the reference implementations do.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, a: AttentionArgs, layer_idx: int):
        super().__init__()
        self.a, self.layer_idx = a, layer_idx
        self.q_proj = nn.Linear(a.hidden_size, a.n_heads * a.head_dim, bias=a.qkv_bias)
        self.k_proj = nn.Linear(a.hidden_size, a.n_kv_heads * a.head_dim, bias=a.qkv_bias)
        self.v_proj = nn.Linear(a.hidden_size, a.n_kv_heads * a.head_dim, bias=a.qkv_bias)
        self.o_proj = nn.Linear(a.n_heads * a.head_dim, a.hidden_size, bias=a.o_bias)
        if a.qk_norm:
            self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps)
            self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        a, t = self.a, x.shape[0]
        q = self.q_proj(x).view(t, a.n_heads, a.head_dim)
        k = self.k_proj(x).view(t, a.n_kv_heads, a.head_dim)
        v = self.v_proj(x).view(t, a.n_kv_heads, a.head_dim)
        if a.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.attend(ctx, q, k, v)
        return self.o_proj(out.reshape(t, a.n_heads * a.head_dim))

    def attend(self, ctx: AttentionContext, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The context's attention over the cache (a family with sinks or windows passes them here)."""
        return ctx.attend(self.layer_idx, q, k, v)


AttentionContext = SequenceAttention | StaticDecodeAttention | BatchAttention


class DenseMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, args: DecoderArgs, layer_idx: int, mlp: nn.Module, mlp_name: str = "mlp"):
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args.attention, layer_idx)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp_name = mlp_name
        self.add_module(mlp_name, mlp)  # HF names differ: `mlp` or mixtral's `block_sparse_moe`

    def forward(self, x, cos, sin, ctx: AttentionContext):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        return x + getattr(self, self.mlp_name)(self.post_attention_layernorm(x))


class DecoderStack(nn.Module):
    """HF's inner `model`: embeddings, layers, final norm."""

    def __init__(self, args: DecoderArgs, make_layer: Callable[[int], DecoderLayer]):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(make_layer(i) for i in range(args.n_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class DecoderModel(nn.Module):
    """A causal LM; the attention context decides where keys and values live (see attention.py)."""

    def __init__(self, args: DecoderArgs, make_layer: Callable[[int], DecoderLayer]):
        super().__init__()
        self.args = args
        self.model = DecoderStack(args, make_layer)
        self.rotary = RotaryEmbedding(args.rope)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def output_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.args.tie_word_embeddings else self.lm_head.weight

    def forward(self, tokens: torch.Tensor, ctx: AttentionContext,
                logits_for: str | torch.Tensor = "all") -> torch.Tensor:
        """tokens [T] at `ctx.positions` → logits [T, V] ("all"), [1, V] ("last") or [R, V] for the R row indices
        given as a tensor (a batch's last row of each sequence)."""
        x = self.hidden_states(tokens, ctx)
        if isinstance(logits_for, torch.Tensor):
            x = x[logits_for]
        elif logits_for == "last":
            x = x[-1:]
        return F.linear(self.model.norm(x), self.output_weight())

    def final_states(self, tokens: torch.Tensor, ctx: AttentionContext) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [T] → (what the output head reads [T, Hd]: after the final norm, what a multi-token-prediction
        layer reads [T, ...]: the same here; DeepSeek-V4's MTP reads its streams)."""
        x = self.model.norm(self.hidden_states(tokens, ctx))
        return x, x

    def hidden_states(self, tokens: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """tokens [T] → the last layer's output [T, Hd], before the final norm."""
        x = self.model.embed_tokens(tokens)
        cos, sin = self.rotary(ctx.positions, x.dtype)
        return self.run_layers(x, cos, sin, ctx)

    def run_layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """The decoder layers in order (a family whose layers pass more than x along overrides this)."""
        for layer in self.model.layers:
            x = layer(x, cos, sin, ctx)
        return x
