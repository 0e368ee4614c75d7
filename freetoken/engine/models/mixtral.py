"""Mixtral (8x7B, 8x22B): every layer sparse, softmax over all experts then the top-k renormalised; HF names
the block `block_sparse_moe` and the expert projections w1 (gate), w3 (up), w2 (down)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from freetoken.engine.config import MoESpec
from freetoken.engine.models.common_args import decoder_args, num_experts
from freetoken.engine.models.decoder import DecoderArgs, DecoderLayer, DecoderModel
from freetoken.engine.models.moe import ExpertNaming, SparseMoeBlock

MODEL_TYPE = "mixtral"
EXPERT_NAMING = ExpertNaming(
    re.compile(r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight"),
    {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"},
)
MLP_NAME = "block_sparse_moe"


@dataclass(slots=True)
class ModelArgs:
    decoder: DecoderArgs
    intermediate_size: int  # per expert
    num_experts: int
    top_k: int

    @classmethod
    def from_config(cls, cfg: dict) -> ModelArgs:
        return cls(decoder_args(cfg), int(cfg["intermediate_size"]), num_experts(cfg),
                   int(cfg["num_experts_per_tok"]))

    def moe_spec(self) -> MoESpec:
        layers = tuple(range(self.decoder.n_layers))
        return MoESpec(layers, self.num_experts, self.top_k, self.decoder.hidden_size, self.intermediate_size)


class Model(DecoderModel):
    def __init__(self, args: ModelArgs):
        dec = args.decoder

        def make_layer(i: int) -> DecoderLayer:
            moe = SparseMoeBlock(i, dec.hidden_size, args.num_experts, args.top_k, norm_topk_prob=True)
            return DecoderLayer(dec, i, moe, mlp_name=MLP_NAME)

        super().__init__(dec, make_layer)
