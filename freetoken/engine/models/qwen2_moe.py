"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): q/k/v biases, routed experts plus one shared expert whose
output is scaled by a sigmoid gate; top-k weights are not renormalised unless `norm_topk_prob`."""

from __future__ import annotations

from dataclasses import dataclass, field

from freetoken.engine.config import MoESpec
from freetoken.engine.models.common_args import decoder_args, num_experts
from freetoken.engine.models.decoder import DecoderArgs, DecoderLayer, DecoderModel, DenseMLP
from freetoken.engine.models.moe import QWEN_EXPERTS, SparseMoeBlock
from freetoken.engine.models.qwen3_moe import sparse_layers

MODEL_TYPE = "qwen2_moe"
EXPERT_NAMING = QWEN_EXPERTS


@dataclass(slots=True)
class ModelArgs:
    decoder: DecoderArgs
    intermediate_size: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    num_experts: int
    top_k: int
    norm_topk_prob: bool
    moe_layers: tuple[int, ...] = field(default_factory=tuple)

    @classmethod
    def from_config(cls, cfg: dict) -> ModelArgs:
        dec = decoder_args(cfg, qkv_bias=bool(cfg.get("qkv_bias", True)))
        return cls(
            dec, int(cfg.get("intermediate_size", 0)), int(cfg["moe_intermediate_size"]),
            int(cfg.get("shared_expert_intermediate_size") or 0), num_experts(cfg),
            int(cfg["num_experts_per_tok"]), bool(cfg.get("norm_topk_prob", False)),
            sparse_layers(cfg, dec.n_layers, num_experts(cfg)),
        )

    def moe_spec(self) -> MoESpec:
        shared = 1 if self.shared_expert_intermediate_size else 0
        return MoESpec(self.moe_layers, self.num_experts, self.top_k, self.decoder.hidden_size,
                       self.moe_intermediate_size, shared, self.shared_expert_intermediate_size)


class Model(DecoderModel):
    def __init__(self, args: ModelArgs):
        dec = args.decoder

        def make_layer(i: int) -> DecoderLayer:
            if i in args.moe_layers:
                mlp = SparseMoeBlock(i, dec.hidden_size, args.num_experts, args.top_k, args.norm_topk_prob,
                                     args.shared_expert_intermediate_size)
            else:
                mlp = DenseMLP(dec.hidden_size, args.intermediate_size)
            return DecoderLayer(dec, i, mlp)

        super().__init__(dec, make_layer)
