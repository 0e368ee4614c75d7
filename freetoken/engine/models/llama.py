"""Llama (dense): SmolLM2, Llama 2/3.x and the many checkpoints sharing its `model_type`."""

from __future__ import annotations

from dataclasses import dataclass

from freetoken.engine.config import MoESpec
from freetoken.engine.models.common_args import decoder_args
from freetoken.engine.models.decoder import DecoderArgs, DecoderLayer, DecoderModel, DenseMLP
from freetoken.engine.models.moe import ExpertNaming

MODEL_TYPE = "llama"
EXPERT_NAMING: ExpertNaming | None = None


@dataclass(slots=True)
class ModelArgs:
    decoder: DecoderArgs
    intermediate_size: int
    mlp_bias: bool = False

    @classmethod
    def from_config(cls, cfg: dict) -> ModelArgs:
        bias = bool(cfg.get("attention_bias", False))
        dec = decoder_args(cfg, qkv_bias=bias)
        dec.attention.o_bias = bias
        return cls(dec, int(cfg["intermediate_size"]), bool(cfg.get("mlp_bias", False)))

    def moe_spec(self) -> MoESpec | None:
        return None


class Model(DecoderModel):
    def __init__(self, args: ModelArgs):
        dec = args.decoder

        def make_layer(i: int) -> DecoderLayer:
            return DecoderLayer(dec, i, DenseMLP(dec.hidden_size, args.intermediate_size, args.mlp_bias))

        super().__init__(dec, make_layer)
