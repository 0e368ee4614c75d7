"""GLM-4.5 / 4.6 / 4.7 MoE (`glm4_moe`): GQA attention with q/k/v biases, optional per-head q/k RMSNorm and
partial RoPE (the first half of each head); DeepSeek-style grouped sigmoid routing with a selection bias and a
routed scaling factor, shared experts; the first `first_k_dense_replace` layers dense. The multi-token
prediction layers the checkpoints carry past `num_hidden_layers` are not loaded (for speculative decoding later).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from freetoken.engine.config import MoESpec
from freetoken.engine.models.common_args import decoder_args
from freetoken.engine.models.decoder import DecoderArgs, DecoderLayer, DecoderModel, DenseMLP
from freetoken.engine.models.moe import QWEN_EXPERTS, GroupedSigmoidMoeBlock, GroupedSigmoidRouter
from freetoken.engine.rope import RopeConfig

MODEL_TYPE = "glm4_moe"
EXPERT_NAMING = QWEN_EXPERTS
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


@dataclass(slots=True)
class ModelArgs:
    decoder: DecoderArgs
    intermediate_size: int
    moe_intermediate_size: int
    num_experts: int
    top_k: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    moe_layers: tuple[int, ...]

    @classmethod
    def from_config(cls, cfg: dict) -> ModelArgs:
        dec = decoder_args(cfg, qkv_bias=bool(cfg.get("attention_bias", True)), qk_norm=bool(cfg.get("use_qk_norm")))
        params = cfg.get("rope_parameters") or {}
        factor = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5)))
        dec = dataclasses.replace(dec, rope=RopeConfig.from_hf_config(cfg, int(dec.attention.head_dim * factor)))
        first_dense = int(cfg.get("first_k_dense_replace") or 0)
        return cls(dec, int(cfg["intermediate_size"]), int(cfg["moe_intermediate_size"]),
                   int(cfg.get("n_routed_experts") or cfg.get("num_local_experts")), int(cfg["num_experts_per_tok"]),
                   int(cfg.get("n_shared_experts") or 0), int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1),
                   bool(cfg.get("norm_topk_prob", True)), float(cfg.get("routed_scaling_factor") or 1.0),
                   tuple(range(first_dense, dec.n_layers)))

    def moe_spec(self) -> MoESpec:
        shared = self.n_shared_experts
        return MoESpec(self.moe_layers, self.num_experts, self.top_k, self.decoder.hidden_size,
                       self.moe_intermediate_size, shared, shared * self.moe_intermediate_size)


class Model(DecoderModel):
    def __init__(self, args: ModelArgs):
        dec = args.decoder

        def make_layer(i: int) -> DecoderLayer:
            if i in args.moe_layers:
                router = GroupedSigmoidRouter(dec.hidden_size, args.num_experts, args.top_k, args.n_group,
                                              args.topk_group, args.norm_topk_prob, args.routed_scaling_factor)
                shared = args.n_shared_experts * args.moe_intermediate_size
                mlp = GroupedSigmoidMoeBlock(i, dec.hidden_size, router, shared)
            else:
                mlp = DenseMLP(dec.hidden_size, args.intermediate_size)
            return DecoderLayer(dec, i, mlp)

        super().__init__(dec, make_layer)


def checkpoint_name(name: str, args: ModelArgs) -> str | None:
    """Layers past the model's (the multi-token prediction layers) are left out."""
    m = _LAYER.match(name)
    return None if m and int(m.group(1)) >= args.decoder.n_layers else name
