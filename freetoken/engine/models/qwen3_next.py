"""Qwen3-Next (Qwen3-Next-80B-A3B): hybrid layers. Most layers mix tokens with Gated DeltaNet (linear attention
whose per-sequence state is a causal-conv window plus one [Dk, Dv] matrix per value head, see gated_delta.py);
every `full_attention_interval`-th layer (or as `layer_types` lists) uses gated full attention: the query
projection also yields a per-channel output gate, q/k get RMSNorm, RoPE covers only `partial_rotary_factor` of
each head. Norms scale by (1 + weight). MoE layers route softmax top-k and add a sigmoid-gated shared expert.

The DeltaNet state lives in the sequence's recurrent state (`ctx.recurrent_state`), so such a sequence cannot
be rolled back, only restored from a snapshot (a fork); in a batched forward each sequence's rows update its own
state (`attention.sequence_rows`), while the projections see every row at once.

Shapes: T tokens, Hd hidden, H heads, Hkv KV heads, D head dim; linear attention: Hk key heads, Hv value heads,
Dk / Dv their dims, C = 2·Hk·Dk + Hv·Dv conv channels, K conv width.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.engine import gpu_paths
from freetoken.engine.attention import sequence_rows
from freetoken.engine.config import MoESpec
from freetoken.engine.models import mtp
from freetoken.engine.models.common_args import decoder_args, num_experts
from freetoken.engine.models.decoder import AttentionContext, DecoderArgs, DecoderModel, DenseMLP
from freetoken.engine.models.gated_delta import (
    causal_conv,
    chunked_gated_delta,
    l2_normalize,
    recurrent_gated_delta,
)
from freetoken.engine.models.moe import QWEN_EXPERTS, SparseMoeBlock
from freetoken.engine.models.mtp import MultiTokenPredictor
from freetoken.engine.models.qwen3_moe import sparse_layers
from freetoken.engine.rope import RopeConfig, apply_rope

MODEL_TYPE = "qwen3_next"
EXPERT_NAMING = QWEN_EXPERTS
DECODE_TOKENS = 1  # steps of at most this many tokens take the recurrent form (longer ones the chunked form)


@dataclass(slots=True)
class LinearAttentionArgs:
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int


@dataclass(slots=True)
class ModelArgs:
    decoder: DecoderArgs
    linear: LinearAttentionArgs
    full_attention_layers: tuple[int, ...]
    intermediate_size: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    num_experts: int
    top_k: int
    norm_topk_prob: bool
    moe_layers: tuple[int, ...] = field(default_factory=tuple)
    mtp_layers: int = 0  # multi-token-prediction layers the checkpoint carries (`mtp.*`)
    mtp: bool = False  # the first of them loaded (with_mtp)

    @classmethod
    def from_config(cls, cfg: dict) -> ModelArgs:
        dec = decoder_args(cfg, qkv_bias=bool(cfg.get("attention_bias", False)), qk_norm=True)
        head_dim = dec.attention.head_dim
        rope_params = cfg.get("rope_parameters") or {}
        factor = float(rope_params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
        dec = dataclasses.replace(dec, rope=RopeConfig.from_hf_config(cfg, int(head_dim * factor)))
        n = dec.n_layers
        types = cfg.get("layer_types")
        if types is None:
            interval = int(cfg.get("full_attention_interval") or 4)
            types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
        linear = LinearAttentionArgs(int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"]),
                                     int(cfg["linear_key_head_dim"]), int(cfg["linear_value_head_dim"]),
                                     int(cfg.get("linear_conv_kernel_dim") or 4))
        return cls(
            dec, linear, tuple(i for i, t in enumerate(types) if t == "full_attention"),
            int(cfg.get("intermediate_size", 0)), int(cfg["moe_intermediate_size"]),
            int(cfg.get("shared_expert_intermediate_size") or 0), num_experts(cfg), int(cfg["num_experts_per_tok"]),
            bool(cfg.get("norm_topk_prob", True)), sparse_layers(cfg, n, num_experts(cfg)),
            # (configs may not state it; a checkpoint without the tensors is refused when they are asked for)
            int(cfg.get("num_nextn_predict_layers", cfg.get("mtp_num_hidden_layers", 1)) or 0),
        )

    def moe_spec(self) -> MoESpec:
        shared = 1 if self.shared_expert_intermediate_size else 0
        return MoESpec(self.moe_layers, self.num_experts, self.top_k, self.decoder.hidden_size,
                       self.moe_intermediate_size, shared, self.shared_expert_intermediate_size)


class OffsetRMSNorm(nn.Module):
    """RMSNorm whose scale is 1 + weight (weights stored centred on 0), applied in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """RMSNorm of the DeltaNet output (plain weight), then times SiLU of the gate z."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return ((self.weight * xf.to(x.dtype)) * F.silu(z.float())).to(x.dtype)


class GatedAttention(nn.Module):
    def __init__(self, args: DecoderArgs, layer_idx: int):
        super().__init__()
        a = args.attention
        self.a, self.layer_idx = a, layer_idx
        self.q_proj = nn.Linear(a.hidden_size, a.n_heads * a.head_dim * 2, bias=a.qkv_bias)  # query and gate
        self.k_proj = nn.Linear(a.hidden_size, a.n_kv_heads * a.head_dim, bias=a.qkv_bias)
        self.v_proj = nn.Linear(a.hidden_size, a.n_kv_heads * a.head_dim, bias=a.qkv_bias)
        self.o_proj = nn.Linear(a.n_heads * a.head_dim, a.hidden_size, bias=False)
        self.q_norm = OffsetRMSNorm(a.head_dim, a.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(a.head_dim, a.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        a, t = self.a, x.shape[0]
        q, gate = self.q_proj(x).view(t, a.n_heads, 2 * a.head_dim).chunk(2, dim=-1)  # each head: query, gate
        k = self.k_proj(x).view(t, a.n_kv_heads, a.head_dim)
        v = self.v_proj(x).view(t, a.n_kv_heads, a.head_dim)
        q, k = apply_rope(self.q_norm(q), cos, sin), apply_rope(self.k_norm(k), cos, sin)  # partial: see rope.py
        out = ctx.attend(self.layer_idx, q, k, v).reshape(t, a.n_heads * a.head_dim)
        return self.o_proj(out * torch.sigmoid(gate.reshape(t, -1)))


class GatedDeltaNet(nn.Module):
    """The linear-attention token mixer. Its state per sequence: (conv window [C, K−1], delta state [Hv, Dk, Dv]
    in fp32)."""

    recurrent = True

    def __init__(self, hidden_size: int, la: LinearAttentionArgs, eps: float, layer_idx: int):
        super().__init__()
        self.la, self.layer_idx = la, layer_idx
        key_total, value_total = la.key_heads * la.key_dim, la.value_heads * la.value_dim
        self.conv_channels = 2 * key_total + value_total
        self._projections(hidden_size)
        self.conv1d = nn.Conv1d(self.conv_channels, self.conv_channels, la.conv_kernel, groups=self.conv_channels,
                                bias=False)
        self.dt_bias = nn.Parameter(torch.ones(la.value_heads))
        self.A_log = nn.Parameter(torch.zeros(la.value_heads))
        self.norm = GatedRMSNorm(la.value_dim, eps)
        self.out_proj = nn.Linear(value_total, hidden_size, bias=False)

    def _projections(self, hidden_size: int) -> None:
        """Qwen3-Next fuses the input projections in two, grouped per key head."""
        la = self.la
        key_total, value_total = la.key_heads * la.key_dim, la.value_heads * la.value_dim
        self.in_proj_qkvz = nn.Linear(hidden_size, 2 * key_total + 2 * value_total, bias=False)
        self.in_proj_ba = nn.Linear(hidden_size, 2 * la.value_heads, bias=False)

    def _split(self, x: torch.Tensor):
        """The projections, grouped per key head as checkpoints lay them out, as q, k [T, Hk, Dk], v, z [T, Hv, Dv]
        and b, a [T, Hv]."""
        la, t = self.la, x.shape[0]
        per = la.value_heads // la.key_heads  # value heads sharing one key head
        qkvz = self.in_proj_qkvz(x).view(t, la.key_heads, 2 * la.key_dim + 2 * per * la.value_dim)
        q, k, v, z = qkvz.split([la.key_dim, la.key_dim, per * la.value_dim, per * la.value_dim], dim=-1)
        b, a = self.in_proj_ba(x).view(t, la.key_heads, 2 * per).split([per, per], dim=-1)
        return (q, k, v.reshape(t, la.value_heads, la.value_dim), z.reshape(t, la.value_heads, la.value_dim),
                b.reshape(t, la.value_heads), a.reshape(t, la.value_heads))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """The projections and the gated norm see every row at once; the convolution and the delta rule run per
        sequence of a batch, each from its own state."""
        la, t = self.la, x.shape[0]
        q, k, v, z, b, a = self._split(x)
        mixed = torch.cat((q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)), dim=-1)
        beta = torch.sigmoid(b).float()  # in the activation dtype first, as the reference does
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        parts = sequence_rows(ctx, t)
        if len(parts) > 1 and t == len(parts) and all(r.recurrent_state(self.layer_idx) is not None
                                                      for _, _, r in parts):
            out = self._recur_stacked(mixed, g, beta, [r for _, _, r in parts])  # one decode token each
        else:
            outs = [self._recur(mixed[lo:hi], g[lo:hi], beta[lo:hi], rows) for lo, hi, rows in parts]
            out = outs[0] if len(outs) == 1 else torch.cat(outs)
        out = self.norm(out.to(x.dtype).reshape(-1, la.value_dim), z.reshape(-1, la.value_dim))
        return self.out_proj(out.reshape(t, -1))

    def _recur_stacked(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, seqs: list) -> torch.Tensor:
        """B sequences' decode tokens (row i of mixed, g, beta is sequence i's one token) in one pass: channels
        and heads are independent, so B sequences' states side by side are one state of B times the channels and
        heads, and the convolution and the delta rule run once for all (the same arithmetic as B passes)."""
        la, b = self.la, mixed.shape[0]
        states = [s.recurrent_state(self.layer_idx) for s in seqs]
        conv_state = torch.cat([st[0] for st in states])  # [B·C, K−1]
        delta_state = torch.cat([st[1] for st in states])  # [B·Hv, Dk, Dv]
        weight = self.conv1d.weight[:, 0, :].repeat(b, 1)
        out, conv_state = causal_conv(mixed.reshape(1, -1), conv_state, weight)
        heads = b * la.value_heads
        q, k, v = (y.reshape(1, heads, -1) for y in self._heads(out.view(b, -1)))
        out, delta_state = _delta_rule(1, mixed.device)(q, k, v, g.reshape(1, heads), beta.reshape(1, heads),
                                                        delta_state)
        conv_state = conv_state.view(b, self.conv_channels, -1)
        delta_state = delta_state.view(b, la.value_heads, la.key_dim, la.value_dim)
        for i, s in enumerate(seqs):  # copies: a view would keep every sequence's state alive with each one's
            s.set_recurrent_state(self.layer_idx, (conv_state[i].clone(), delta_state[i].clone()))
        return out.view(b, la.value_heads, la.value_dim)

    def _recur(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, ctx) -> torch.Tensor:
        """One sequence's rows through the causal convolution and the delta rule, from and to its state."""
        la, t = self.la, mixed.shape[0]
        state = ctx.recurrent_state(self.layer_idx)
        if state is None:
            state = (torch.zeros(self.conv_channels, la.conv_kernel - 1, dtype=mixed.dtype, device=mixed.device),
                     torch.zeros(la.value_heads, la.key_dim, la.value_dim, dtype=torch.float32, device=mixed.device))
        conv_state, delta_state = state
        mixed, conv_state = causal_conv(mixed, conv_state, self.conv1d.weight[:, 0, :])
        out, delta_state = _delta_rule(t, mixed.device)(*self._heads(mixed), g, beta, delta_state)
        ctx.set_recurrent_state(self.layer_idx, (conv_state, delta_state))
        return out

    def _heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The convolution's output [N, C] as the delta rule's fp32 q, k [N, Hv, Dk] (each key head shared by its
        value heads; normalized, q scaled) and v [N, Hv, Dv]."""
        la, n = self.la, mixed.shape[0]
        key_total = la.key_heads * la.key_dim
        q, k, v = mixed.split([key_total, key_total, la.value_heads * la.value_dim], dim=-1)
        per = la.value_heads // la.key_heads
        q, k = (y.reshape(n, la.key_heads, la.key_dim).float().repeat_interleave(per, dim=1) for y in (q, k))
        return (l2_normalize(q) * la.key_dim ** -0.5, l2_normalize(k),
                v.reshape(n, la.value_heads, la.value_dim).float())


def _delta_rule(tokens: int, device: torch.device):
    """The recurrent form for decode steps, the chunked form for longer chunks; on CUDA, with the GPU paths
    "delta-decode" / "delta-prefill", their Triton loops (kernels/gated_delta)."""
    path = "delta-prefill" if tokens > DECODE_TOKENS else "delta-decode"
    if device.type == "cuda" and gpu_paths.enabled(path):
        from freetoken.kernels.gated_delta import kernel

        if kernel.available(device):
            if tokens > DECODE_TOKENS:
                return functools.partial(chunked_gated_delta, carry=kernel.carry_state)
            return kernel.recurrent_gated_delta
    return chunked_gated_delta if tokens > DECODE_TOKENS else recurrent_gated_delta


class HybridLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int, delta_net: type[GatedDeltaNet] = GatedDeltaNet):
        super().__init__()
        dec = args.decoder
        self.input_layernorm = OffsetRMSNorm(dec.hidden_size, dec.rms_norm_eps)
        if layer_idx in args.full_attention_layers:
            self.self_attn = GatedAttention(dec, layer_idx)
            self.mixer_name = "self_attn"
        else:
            self.linear_attn = delta_net(dec.hidden_size, args.linear, dec.rms_norm_eps, layer_idx)
            self.mixer_name = "linear_attn"
        self.post_attention_layernorm = OffsetRMSNorm(dec.hidden_size, dec.rms_norm_eps)
        if layer_idx in args.moe_layers:
            self.mlp = SparseMoeBlock(layer_idx, dec.hidden_size, args.num_experts, args.top_k, args.norm_topk_prob,
                                      args.shared_expert_intermediate_size)
        else:
            self.mlp = DenseMLP(dec.hidden_size, args.intermediate_size)

    def forward(self, x, cos, sin, ctx: AttentionContext):
        x = x + getattr(self, self.mixer_name)(self.input_layernorm(x), cos, sin, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class Model(DecoderModel):
    DELTA_NET = GatedDeltaNet

    def __init__(self, args: ModelArgs):
        super().__init__(args.decoder, lambda i: HybridLayer(args, i, self.DELTA_NET))
        dec = args.decoder
        self.model.norm = OffsetRMSNorm(dec.hidden_size, dec.rms_norm_eps)
        if args.mtp:  # a full-attention routed layer past the model's (models/mtp.py)
            self.mtp = MultiTokenPredictor(dec.hidden_size, dec.rms_norm_eps,
                                           HybridLayer(args, dec.n_layers, self.DELTA_NET), norm=OffsetRMSNorm)


def with_mtp(args: ModelArgs) -> ModelArgs:
    """`args` with the multi-token-prediction layer: full attention and routed experts at index n_layers."""
    mtp.require_layer(args)
    n = args.decoder.n_layers
    return dataclasses.replace(args, full_attention_layers=(*args.full_attention_layers, n),
                               moe_layers=(*args.moe_layers, n), mtp=True)


def checkpoint_name(name: str, args: ModelArgs) -> str | None:
    """The multi-token-prediction layer (`mtp.*`) loads only with `args.mtp` (models/mtp.py)."""
    return mtp.qwen_checkpoint_name(name, args.decoder.n_layers, args.mtp)
