"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): per-head q/k RMSNorm, softmax top-k routing with optional
renormalisation, no shared expert; `mlp_only_layers` / `decoder_sparse_step` choose dense layers."""

from __future__ import annotations

from dataclasses import dataclass, field

from freetoken.engine.config import MoESpec
from freetoken.engine.models.common_args import decoder_args, num_experts
from freetoken.engine.models.decoder import DecoderArgs, DecoderLayer, DecoderModel, DenseMLP
from freetoken.engine.models.moe import QWEN_EXPERTS, SparseMoeBlock

MODEL_TYPE = "qwen3_moe"
EXPERT_NAMING = QWEN_EXPERTS


@dataclass(slots=True)
class ModelArgs:
    decoder: DecoderArgs
    intermediate_size: int
    moe_intermediate_size: int
    num_experts: int
    top_k: int
    norm_topk_prob: bool
    moe_layers: tuple[int, ...] = field(default_factory=tuple)

    @classmethod
    def from_config(cls, cfg: dict) -> ModelArgs:
        dec = decoder_args(cfg, qkv_bias=bool(cfg.get("attention_bias", False)), qk_norm=True)
        return cls(
            dec, int(cfg.get("intermediate_size", 0)), int(cfg["moe_intermediate_size"]), num_experts(cfg),
            int(cfg["num_experts_per_tok"]), bool(cfg.get("norm_topk_prob", False)),
            sparse_layers(cfg, dec.n_layers, num_experts(cfg)),
        )

    def moe_spec(self) -> MoESpec:
        return MoESpec(self.moe_layers, self.num_experts, self.top_k, self.decoder.hidden_size,
                       self.moe_intermediate_size)


def sparse_layers(cfg: dict, n_layers: int, n_experts: int) -> tuple[int, ...]:
    """Qwen's rule: a layer is MoE unless listed in mlp_only_layers or off the decoder_sparse_step grid."""
    dense = set(cfg.get("mlp_only_layers") or [])
    step = int(cfg.get("decoder_sparse_step") or 1)
    return tuple(i for i in range(n_layers) if i not in dense and n_experts > 0 and (i + 1) % step == 0)


class Model(DecoderModel):
    def __init__(self, args: ModelArgs):
        dec = args.decoder

        def make_layer(i: int) -> DecoderLayer:
            if i in args.moe_layers:
                mlp = SparseMoeBlock(i, dec.hidden_size, args.num_experts, args.top_k, args.norm_topk_prob)
            else:
                mlp = DenseMLP(dec.hidden_size, args.intermediate_size)
            return DecoderLayer(dec, i, mlp)

        super().__init__(dec, make_layer)
