"""DeepSeek-V3 / R1 / V3.1-style MoE (`deepseek_v3`): multi-head latent
attention (MLA), grouped sigmoid routing with a selection bias and routed scaling (moe.py), shared experts, the
first `first_k_dense_replace` layers dense. The multi-token-prediction layer past `num_hidden_layers` loads on
request (`load_model(mtp=True)`: models/mtp.py) for speculative decoding; otherwise it is left out.

MLA caches, per token, the compressed latent c (kv_lora_rank, after its RMSNorm) and the shared rotary key
k_pe (qk_rope_head_dim), not per-head keys and values: 576 numbers instead of 128 × 320 for V3. Attention runs
in the absorbed form: each head's no-position query is carried into latent space through that head's slice of
kv_b_proj (W_UK), so scores are q_lat·c + q_pe·k_pe over the one cached "head"; the weighted sum of latents goes
back through W_UV to the head's values. It equals expanding K and V (what transformers does) up to rounding.
The cache's one KV head holds [c, k_pe] as keys and [c, 0] as values (the pools share a width), so every
attention path (SDPA, the captured decode step, batches) runs it unchanged as grouped-query attention with one
KV head; the query is pre-scaled so the paths' 1/√width becomes MLA's softmax scale.

Shapes: T tokens, H heads, r kv_lora_rank, n / p / v the no-position, rotary and value head dims.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import nn

from freetoken.engine.attention import KeySelection
from freetoken.engine.config import MoESpec
from freetoken.engine.models import mtp
from freetoken.engine.models.common_args import decoder_args
from freetoken.engine.models.decoder import AttentionContext, DecoderArgs, DecoderModel, RMSNorm
from freetoken.engine.models.moe import QWEN_EXPERTS, GroupedRouting
from freetoken.engine.models.mtp import MultiTokenPredictor
from freetoken.engine.rope import RopeConfig, apply_rope

MODEL_TYPE = "deepseek_v3"
EXPERT_NAMING = QWEN_EXPERTS


@dataclass(slots=True)
class LatentArgs:
    q_lora_rank: int | None
    kv_lora_rank: int
    nope_dim: int
    rope_dim: int
    v_dim: int
    rope_interleave: bool
    softmax_scale: float
    bias: bool


@dataclass(slots=True)
class ModelArgs:
    decoder: DecoderArgs
    latent: LatentArgs
    routing: GroupedRouting
    values_are_keys: bool = True  # the cache holds [latent, rotary key] once: attention reads it as both
    mtp_layers: int = 0  # multi-token-prediction layers the checkpoint appends (num_nextn_predict_layers)
    mtp: bool = False  # the first of them loaded (with_mtp)

    @classmethod
    def from_config(cls, cfg: dict) -> ModelArgs:
        dec = decoder_args(cfg)
        r, p = int(cfg["kv_lora_rank"]), int(cfg["qk_rope_head_dim"])
        nope, v = int(cfg["qk_nope_head_dim"]), int(cfg["v_head_dim"])
        rope = RopeConfig.from_hf_config(cfg, p)
        scale = (nope + p) ** -0.5
        if rope.rope_type != "default" and rope.params.get("mscale_all_dim"):
            scale *= _yarn_mscale(float(rope.params["factor"]), float(rope.params["mscale_all_dim"])) ** 2
        latent = LatentArgs(cfg.get("q_lora_rank"), r, nope, p, v, bool(cfg.get("rope_interleave", True)), scale,
                            bool(cfg.get("attention_bias", False)))
        # the cache's view: one KV "head" of [latent, rotary key]
        attention = dataclasses.replace(dec.attention, n_kv_heads=1, head_dim=r + p)
        dec = dataclasses.replace(dec, attention=attention, rope=rope)
        return cls(dec, latent, GroupedRouting.from_config(cfg, dec.n_layers),
                   mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0))

    def moe_spec(self) -> MoESpec:
        return self.routing.moe_spec(self.decoder.hidden_size)


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class LatentAttention(nn.Module):
    def __init__(self, hidden_size: int, n_heads: int, la: LatentArgs, layer_idx: int):
        super().__init__()
        self.la, self.n_heads, self.layer_idx = la, n_heads, layer_idx
        qk = la.nope_dim + la.rope_dim
        if la.q_lora_rank:
            self.q_a_proj = nn.Linear(hidden_size, la.q_lora_rank, bias=la.bias)
            self.q_a_layernorm = RMSNorm(la.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(la.q_lora_rank, n_heads * qk, bias=False)
        else:
            self.q_proj = nn.Linear(hidden_size, n_heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, la.kv_lora_rank + la.rope_dim, bias=la.bias)
        self.kv_a_layernorm = RMSNorm(la.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(la.kv_lora_rank, n_heads * (la.nope_dim + la.v_dim), bias=False)
        self.o_proj = nn.Linear(n_heads * la.v_dim, hidden_size, bias=la.bias)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.la.rope_interleave:  # checkpoints store rotary pairs interleaved: to the half-split layout
            x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
        return apply_rope(x, cos, sin)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext, *,
                q_resid: torch.Tensor | None = None, extra_key: torch.Tensor | None = None,
                select: KeySelection | None = None) -> torch.Tensor:
        """`q_resid`: the query LoRA's normed down-projection if the caller has it; `extra_key` [T, E]: columns
        cached after each token's [latent, k_pe] that attention itself ignores (the query is zero there: the
        sparse-attention indexer's keys), `select`: the keys each query attends to (see attention.KeySelection)."""
        la, h, t = self.la, self.n_heads, x.shape[0]
        if la.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)) if q_resid is None else q_resid)
        else:
            q = self.q_proj(x)
        q_nope, q_pe = q.view(t, h, la.nope_dim + la.rope_dim).split([la.nope_dim, la.rope_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([la.kv_lora_rank, la.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        q_pe, k_pe = self._rope(q_pe, cos, sin), self._rope(k_pe[:, None, :], cos, sin)
        w = self.kv_b_proj.weight.view(h, la.nope_dim + la.v_dim, la.kv_lora_rank)
        q_latent = torch.einsum("thn,hnr->thr", q_nope, w[:, :la.nope_dim])  # W_UK absorbed into the query
        parts, key_parts = [q_latent, q_pe], [latent[:, None, :], k_pe]
        if extra_key is not None:
            parts.append(q_pe.new_zeros(t, h, extra_key.shape[-1]))
            key_parts.append(extra_key[:, None, :].to(k_pe.dtype))
        width = sum(p.shape[-1] for p in parts)
        query = torch.cat(parts, dim=-1) * (la.softmax_scale * math.sqrt(width))
        keys = torch.cat(key_parts, dim=-1)
        # the values are the keys: the output's latent columns are the weighted latents, its rotary columns
        # (weighted rotary keys) are dropped; so the cache holds each token's [latent, k_pe] once
        extra = {} if select is None else {"select": select}
        out = ctx.attend(self.layer_idx, query, keys, keys, **extra)[..., :la.kv_lora_rank]  # [T, H, r]
        out = torch.einsum("thr,hvr->thv", out, w[:, la.nope_dim:])  # back through W_UV
        return self.o_proj(out.reshape(t, h * la.v_dim))


class Layer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        dec = args.decoder
        self.input_layernorm = RMSNorm(dec.hidden_size, dec.rms_norm_eps)
        self.self_attn = LatentAttention(dec.hidden_size, dec.attention.n_heads, args.latent, layer_idx)
        self.post_attention_layernorm = RMSNorm(dec.hidden_size, dec.rms_norm_eps)
        self.mlp = args.routing.mlp(layer_idx, dec.hidden_size)

    def forward(self, x, cos, sin, ctx: AttentionContext):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class Model(DecoderModel):
    def __init__(self, args: ModelArgs):
        super().__init__(args.decoder, lambda i: Layer(args, i))
        if args.mtp:
            dec = args.decoder
            self.mtp = MultiTokenPredictor(dec.hidden_size, dec.rms_norm_eps, Layer(args, dec.n_layers))


with_mtp = mtp.with_mtp


def checkpoint_name(name: str, args: ModelArgs) -> str | None:
    """The multi-token-prediction layers past the model's are left out unless `args.mtp` (see models/mtp.py)."""
    return mtp.checkpoint_name(name, args.decoder.n_layers, args.mtp)
