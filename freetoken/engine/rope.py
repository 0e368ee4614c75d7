"""Rotary position embeddings: inverse frequencies for the RoPE variants our families use, and their application.

Variants: "default", "linear", "llama3" (Llama 3.1 frequency-band rescaling) and "yarn" (NTK-by-parts
interpolation with an attention temperature). Layout is the half-split one of HF checkpoints (`rotate_half`);
GGUF loaders un-permute llama's interleaved Q/K rows at load time so one layout serves every source.

Shapes: T tokens, H heads, D head dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(slots=True, frozen=True)
class RopeConfig:
    theta: float
    head_dim: int
    rope_type: str = "default"
    params: dict = field(default_factory=dict)  # the variant's scaling parameters as HF names them
    max_position_embeddings: int = 4096

    @classmethod
    def from_hf_config(cls, cfg: dict, head_dim: int) -> RopeConfig:
        """Reads both HF spellings: `rope_parameters` (transformers 5) and `rope_theta` + `rope_scaling` (4.x)."""
        params = dict(cfg.get("rope_parameters") or {})
        legacy = cfg.get("rope_scaling") or {}
        params = {**legacy, **params}
        theta = params.pop("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            from freetoken.errors import UnsupportedArchitectureError

            raise UnsupportedArchitectureError(
                f"RoPE type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        max_pos = int(cfg.get("max_position_embeddings", 4096))
        return cls(float(theta), head_dim, rope_type, params, max_pos)


def inverse_frequencies(rc: RopeConfig) -> tuple[torch.Tensor, float]:
    """Returns (inv_freq [D/2] float32 on the CPU, attention scaling applied to cos/sin).

    Computed on the CPU explicitly: models are built on the meta device, where these would hold no values."""
    dim = rc.head_dim
    base_inv = 1.0 / (rc.theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    p = rc.params
    if "freq_factors" in p:  # GGUF llama3-style scaling: per-frequency divisors precomputed by the converter
        base_inv = base_inv / torch.tensor(p["freq_factors"], dtype=torch.float32, device="cpu")
    if rc.rope_type == "default":
        return base_inv, 1.0
    if rc.rope_type == "linear":
        return base_inv / float(p["factor"]), 1.0
    if rc.rope_type == "llama3":
        return _llama3(base_inv, p), 1.0
    return _yarn(rc, p)


def _llama3(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    factor, low, high = float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old_ctx = float(p["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are interpolated by `factor`, short ones kept, the band between blended smoothly.
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(in_band, blended, scaled)


def _yarn(rc: RopeConfig, p: dict) -> tuple[torch.Tensor, float]:
    dim, base = rc.head_dim, rc.theta
    orig_ctx = float(p.get("original_max_position_embeddings") or rc.max_position_embeddings)
    factor = p.get("factor") or rc.max_position_embeddings / orig_ctx
    factor = float(factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention_factor = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig_ctx / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(float(p.get("beta_fast") or 32)), correction_dim(float(p.get("beta_slow") or 1))
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim)
    extrapolate = 1 - ramp  # 1 where rotations are fast enough to keep the original frequency
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv, float(attention_factor)


class RotaryEmbedding(torch.nn.Module):
    """Computes cos/sin for absolute positions; frequencies in fp32 like the reference implementation."""

    def __init__(self, rc: RopeConfig):
        super().__init__()
        inv_freq, self.attention_scaling = inverse_frequencies(rc)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos, sin: [T, R] with R ≤ D: partial RoPE (Qwen3-Next, GLM-4.5) rotates the first R
    dims of each head and passes the rest through."""
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :r], cos, sin), x[..., r:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
