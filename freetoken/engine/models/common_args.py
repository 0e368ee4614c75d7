"""Reading the config.json fields every decoder family shares into `DecoderArgs`."""

from __future__ import annotations

from freetoken.engine.models.decoder import AttentionArgs, DecoderArgs
from freetoken.engine.rope import RopeConfig


def decoder_args(cfg: dict, *, qkv_bias: bool = False, qk_norm: bool = False) -> DecoderArgs:
    hidden, n_heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or hidden // n_heads)
    eps = float(cfg.get("rms_norm_eps", 1e-6))
    attention = AttentionArgs(
        hidden_size=hidden, n_heads=n_heads, n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        head_dim=head_dim, qkv_bias=qkv_bias, o_bias=False, qk_norm=qk_norm, rms_norm_eps=eps,
    )
    return DecoderArgs(
        vocab_size=int(cfg["vocab_size"]), hidden_size=hidden, n_layers=int(cfg["num_hidden_layers"]),
        attention=attention, rope=RopeConfig.from_hf_config(cfg, head_dim), rms_norm_eps=eps,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
    )


def num_experts(cfg: dict) -> int:
    """HF spells the routed-expert count `num_experts` (Qwen) or `num_local_experts` (Mixtral, some saves)."""
    return int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
