"""DeepSeek-V4 (`deepseek_v4`; V4-Flash, V4-Pro): shared-KV attention over a sliding window plus compressed
history, manifold-constrained hyper-connections, hash-routed and top-k routed MoE.

Attention: `compressed_attention.py` (a sliding window plus history compressed every 4 tokens, with an indexer
choosing the entries each query reads, or every 128); its state is the sequence's recurrent state, not paged K/V.
Residual: `hyper_connections.py` (`hc_mult` streams per token, mixed around each block).

MoE: every layer routes; scores sqrt(softplus(logits)) (or sigmoid / softmax), renormalised over the chosen and
scaled. The first "hash_moe" layers choose their experts by token id (`tid2eid[token]`), the rest by top-k of
the scores plus a selection bias. Experts and the one shared expert use a SwiGLU clamped at `swiglu_limit`.

Weight names are DeepSeek's own (`attn.wq_a`, `ffn.experts.N.w1`, `hc_attn_fn`: what transformers writes back).
The multi-token-prediction layer (`mtp.0.*`) loads on request (`load_model(mtp=True)`, `MultiTokenPredictor`).

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

from freetoken.engine.attention import BatchAttention, SequenceAttention
from freetoken.engine.config import MoESpec
from freetoken.engine.experts import ExpertExecutor, ExpertForm
from freetoken.engine.models import mtp
from freetoken.engine.models.common_args import decoder_args
from freetoken.engine.models.compressed_attention import (
    CSA,
    HCA,
    SLIDING,
    Attention,
    AttentionArgs,
    rope_tables,
)
from freetoken.engine.models.decoder import DecoderArgs, DecoderModel, RMSNorm
from freetoken.engine.models.hyper_connections import HyperHead, hyper_weights
from freetoken.engine.models.moe import ExpertNaming
from freetoken.engine.rope import RopeConfig
from freetoken.errors import ModelLoadError, UnsupportedArchitectureError

MODEL_TYPE = "deepseek_v4"
EXPERT_NAMING = ExpertNaming(re.compile(r"model\.layers\.(\d+)\.ffn\.experts\.(\d+)\.(w1|w2|w3)\.weight"),
                             {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"})

_RATIO_KINDS = {0: SLIDING, 4: CSA, 128: HCA}  # older configs' `compress_ratios`


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
    mtp_layers: int = 0  # multi-token-prediction layers the checkpoint carries (`mtp.N.*`)
    mtp: bool = False  # the first of them loaded (with_mtp): a sliding-window layer at index n_layers

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
                   int(cfg.get("hc_sinkhorn_iters") or 20), float(cfg.get("hc_eps") or 1e-6),
                   mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0))

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
        return MoESpec(tuple(range(self.decoder.n_layers + self.mtp)), r.num_experts, r.top_k,
                       self.decoder.hidden_size, r.intermediate_size, r.n_shared,
                       r.intermediate_size if r.n_shared else 0)


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

    def forward(self, streams: torch.Tensor, ropes: dict, ctx: SequenceAttention | BatchAttention,
                tokens: torch.Tensor):
        streams = self._around("attn", streams, lambda x: self.attn(self.attn_norm(x), ropes, ctx))
        return self._around("ffn", streams, lambda x: self.ffn(self.ffn_norm(x), tokens))


class MultiTokenPredictor(nn.Module):
    """V4's MTP layer (DeepSeek's `mtp.0.*`): the main model's last streams (before its hc_head) at position i,
    each through hnorm and h_proj, plus enorm and e_proj of the embedding of the token at i + 1, run as streams
    through one more layer (sliding window, routed) and collapsed by the layer's own hc_head; its norm and the
    main head give the logits of the token at i + 2 (models/mtp.py has the other families')."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        dec = args.decoder
        self.enorm = RMSNorm(dec.hidden_size, dec.rms_norm_eps)
        self.hnorm = RMSNorm(dec.hidden_size, dec.rms_norm_eps)
        self.e_proj = nn.Linear(dec.hidden_size, dec.hidden_size, bias=False)
        self.h_proj = nn.Linear(dec.hidden_size, dec.hidden_size, bias=False)
        self.norm = RMSNorm(dec.hidden_size, dec.rms_norm_eps)
        self.hc_head = HyperHead(dec.hidden_size, args.hc_mult, args.hc_eps, dec.rms_norm_eps)
        self.layer = Layer(args, dec.n_layers)
        self.hc_mult = args.hc_mult

    def forward(self, model: Model, hidden: torch.Tensor, next_tokens: torch.Tensor, ctx) -> torch.Tensor:
        """hidden [T, N·Hd]: the main model's streams at `ctx.positions`; next_tokens [T] → logits [T, V]."""
        t = hidden.shape[0]
        embedded = model.model.embed_tokens(next_tokens)
        streams = self.h_proj(self.hnorm(hidden.view(t, self.hc_mult, -1).to(embedded.dtype)))
        streams = streams + self.e_proj(self.enorm(embedded))[:, None, :]
        streams = self.layer(streams, model.ropes(ctx.positions, embedded.dtype), ctx, next_tokens)
        return F.linear(self.norm(self.hc_head(streams)), model.output_weight())


class Model(DecoderModel):
    def __init__(self, args: ModelArgs):
        super().__init__(args.decoder, lambda i: Layer(args, i))
        self.v4 = args
        dec = args.decoder
        self.model.hc_head = HyperHead(dec.hidden_size, args.hc_mult, args.hc_eps, dec.rms_norm_eps)
        if args.mtp:
            self.mtp = MultiTokenPredictor(args)

    def expert_forms(self) -> dict[int, ExpertForm]:
        """Every layer's experts clamp their SwiGLU (the MTP layer's too)."""
        limit = self.v4.routing.swiglu_limit
        return {i: clamped_swiglu(limit) for i in range(self.v4.decoder.n_layers + self.v4.mtp)} if limit else {}

    def ropes(self, positions: torch.Tensor, dtype: torch.dtype) -> dict:
        """cos, sin of the positions under the "main" RoPE (sliding layers) and the "compress" one."""
        return {"main": rope_tables(self.v4.decoder.rope, positions, dtype),
                "compress": rope_tables(self.v4.attention.compress_rope, positions, dtype)}

    def streams(self, tokens: torch.Tensor, ctx: SequenceAttention | BatchAttention) -> torch.Tensor:
        """tokens [T] → the last layer's streams [T, N, Hd] (before the hc_head)."""
        x = self.model.embed_tokens(tokens)
        ropes = self.ropes(ctx.positions, x.dtype)
        streams = x[:, None, :].expand(-1, self.v4.hc_mult, -1).contiguous()
        for layer in self.model.layers:
            streams = layer(streams, ropes, ctx, tokens)
        return streams

    def final_states(self, tokens: torch.Tensor, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        streams = self.streams(tokens, ctx)
        return self.model.norm(self.model.hc_head(streams)), streams.flatten(1)

    def forward(self, tokens: torch.Tensor, ctx: SequenceAttention | BatchAttention,
                logits_for: str | torch.Tensor = "all") -> torch.Tensor:
        x = self.model.hc_head(self.streams(tokens, ctx))
        if isinstance(logits_for, torch.Tensor):
            x = x[logits_for]
        elif logits_for == "last":
            x = x[-1:]
        return F.linear(self.model.norm(x), self.output_weight())


_TOP_LEVEL = {"embed.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight",
              "norm.weight": "model.norm.weight", "hc_head_fn": "model.hc_head.hc_fn",
              "hc_head_base": "model.hc_head.hc_base", "hc_head_scale": "model.hc_head.hc_scale"}
_LAYER = re.compile(r"(?:model\.)?layers\.(\d+)\.(.+)")


def with_mtp(args: ModelArgs) -> ModelArgs:
    """`args` with the multi-token-prediction layer: a sliding-window layer, routed by top-k, at index n_layers."""
    mtp.require_layer(args)
    attention = dataclasses.replace(args.attention, kinds=(*args.attention.kinds, SLIDING))
    return dataclasses.replace(args, attention=attention, mtp=True)


# the MTP layer's own tensors beside its block (`mtp.0.` stripped) → this module's names; None: not loaded (the
# checkpoint's copies of the embedding and head)
_MTP_OWN = {"e_proj.": "mtp.e_proj.", "h_proj.": "mtp.h_proj.", "enorm.": "mtp.enorm.", "hnorm.": "mtp.hnorm.",
            "norm.": "mtp.norm.", "hc_head_fn": "mtp.hc_head.hc_fn", "hc_head_base": "mtp.hc_head.hc_base",
            "hc_head_scale": "mtp.hc_head.hc_scale", "emb.": None, "embed": None, "head.": None}


def _mtp_name(name: str, args: ModelArgs) -> str | None:
    if not args.mtp or not name.startswith("mtp.0."):
        return None
    rest = name[len("mtp.0."):]
    for prefix, target in _MTP_OWN.items():
        if rest.startswith(prefix):
            return None if target is None else target + rest[len(prefix):]
    if rest.startswith("ffn.experts."):  # the expert loader files them as layer n_layers's
        return f"model.layers.{args.decoder.n_layers}.{rest}"
    return "mtp.layer." + rest


def checkpoint_name(name: str, args: ModelArgs) -> str | None:
    """DeepSeek's names (transformers writes them back on save), with or without the `model.` prefix; the
    multi-token-prediction layer (`mtp.0.*`) only with `args.mtp`, layers past the model's never."""
    if name.startswith("mtp."):
        return _mtp_name(name, args)
    if name.endswith((".scale", "_scale_inv")):  # the checkpoint reader consumes them under an fp8 config
        raise ModelLoadError(f"{name}: block scales, but config.json has no quantization_config with quant_method "
                             "fp8 and a weight_block_size; the checkpoint's config is incomplete")
    if (m := _LAYER.fullmatch(name)) is not None:
        return None if int(m.group(1)) >= args.decoder.n_layers else f"model.layers.{m.group(1)}.{m.group(2)}"
    return _TOP_LEVEL.get(name.removeprefix("model."), name)
