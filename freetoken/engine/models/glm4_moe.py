"""GLM-4.5 / 4.6 / 4.7 MoE (`glm4_moe`): GQA attention with q/k/v biases, optional per-head q/k RMSNorm and
partial RoPE (the first half of each head); DeepSeek-style grouped sigmoid routing with a selection bias and a
routed scaling factor, shared experts; the first `first_k_dense_replace` layers dense. The multi-token-prediction
layer past `num_hidden_layers` loads on request (`load_model(mtp=True)`: models/mtp.py) for speculative decoding.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from freetoken.engine.config import MoESpec
from freetoken.engine.models import mtp
from freetoken.engine.models.common_args import decoder_args
from freetoken.engine.models.decoder import DecoderArgs, DecoderLayer, DecoderModel
from freetoken.engine.models.moe import QWEN_EXPERTS, GroupedRouting
from freetoken.engine.models.mtp import MultiTokenPredictor
from freetoken.engine.rope import RopeConfig

MODEL_TYPE = "glm4_moe"
EXPERT_NAMING = QWEN_EXPERTS


@dataclass(slots=True)
class ModelArgs:
    decoder: DecoderArgs
    routing: GroupedRouting
    mtp_layers: int = 0  # multi-token-prediction layers the checkpoint appends (num_nextn_predict_layers)
    mtp: bool = False  # the first of them loaded (with_mtp)

    @classmethod
    def from_config(cls, cfg: dict) -> ModelArgs:
        dec = decoder_args(cfg, qkv_bias=bool(cfg.get("attention_bias", True)), qk_norm=bool(cfg.get("use_qk_norm")))
        params = cfg.get("rope_parameters") or {}
        factor = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5)))
        dec = dataclasses.replace(dec, rope=RopeConfig.from_hf_config(cfg, int(dec.attention.head_dim * factor)))
        return cls(dec, GroupedRouting.from_config(cfg, dec.n_layers),
                   mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0))

    def moe_spec(self) -> MoESpec:
        return self.routing.moe_spec(self.decoder.hidden_size)


class Model(DecoderModel):
    def __init__(self, args: ModelArgs):
        dec = args.decoder
        super().__init__(dec, lambda i: DecoderLayer(dec, i, args.routing.mlp(i, dec.hidden_size)))
        if args.mtp:
            n = dec.n_layers
            self.mtp = MultiTokenPredictor(dec.hidden_size, dec.rms_norm_eps,
                                           DecoderLayer(dec, n, args.routing.mlp(n, dec.hidden_size)))


with_mtp = mtp.with_mtp


def checkpoint_name(name: str, args: ModelArgs) -> str | None:
    """The multi-token-prediction layers past the model's are left out unless `args.mtp` (see models/mtp.py)."""
    return mtp.checkpoint_name(name, args.decoder.n_layers, args.mtp)
