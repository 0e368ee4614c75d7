"""Plain-torch reference of the CPU expert kernel: the same function, the same signature, computed in fp32.

`moe_forward` runs the listed experts of one layer on the tokens routed to them and returns the routing-weighted
sum of their SwiGLU outputs. Weights are given as `ExpertMatrix` stacks exactly as the host store holds them
(float tensors, or the raw bytes of a GGUF block format), so the fast kernel and this reference read the same
memory.

Shapes: T tokens, H hidden, I expert intermediate, E experts in the stack, n experts run, P (token, expert) pairs
grouped by expert: pair_offsets[e]..pair_offsets[e+1] are the pairs of experts[e].
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from freetoken.kernels.gguf_dequant.reference import dequantize

# Formats the fast kernel reads directly; the reference reads any format `dequantize` knows.
KERNEL_FORMATS = ("F32", "BF16", "Q8_0", "MXFP4", "FP8_B32")
_TORCH_FORMATS = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


@dataclass(frozen=True, slots=True)
class ExpertMatrix:
    """One projection of every expert of a layer: [E, out, in] floats, or [E, bytes] uint8 in a GGUF format."""

    data: torch.Tensor
    format: str  # "F32", "BF16", "F16", "Q8_0", ...
    shape: tuple[int, int]  # (out, in) of one expert

    @classmethod
    def of(cls, stacked: torch.Tensor) -> ExpertMatrix:
        """A float stack [E, out, in]."""
        return cls(stacked, _TORCH_FORMATS[stacked.dtype], tuple(stacked.shape[1:]))

    def expert(self, e: int) -> torch.Tensor:
        """Expert e's matrix as fp32 [out, in]."""
        if self.data.dtype == torch.uint8:
            out, inp = self.shape
            return dequantize(self.data[e], self.format, out * inp, torch.float32).view(out, inp)
        return self.data[e].float()


@dataclass(frozen=True, slots=True)
class ExpertForm:
    """What an expert computes besides its three matmuls, where a family differs from plain SwiGLU
    (silu(x Wg) * (x Wu), then W_down): per-expert biases on the projections (gate/up [E, I], down [E, H], by
    expert id, never by cache slot), gpt-oss's clamped SwiGLU, (clamp(u, ±limit) + 1) · g · σ(αg) with
    g = min(g, limit) (`clamped`), or DeepSeek-V4's, silu(min(g, limit)) · clamp(u, ±limit) (`clamp_silu`). The
    engine's GPU paths, this reference and the fast kernel all read it."""

    gate_bias: torch.Tensor | None = None
    up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    clamped: bool = False
    alpha: float = 1.702
    limit: float = 7.0
    clamp_silu: bool = False

    @property
    def is_plain(self) -> bool:
        return self.gate_bias is None and self.down_bias is None and not self.clamped and not self.clamp_silu

    def clamp_inputs(self, g: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """V4's clamps on the gate and up values (identity for every other form)."""
        if not self.clamp_silu:
            return g, u
        return g.clamp(max=self.limit), u.clamp(-self.limit, self.limit)

    def activate(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        if not self.clamped:
            g, u = self.clamp_inputs(g, u)
            return F.silu(g) * u
        g = g.clamp(max=self.limit)
        return (u.clamp(-self.limit, self.limit) + 1) * (g * torch.sigmoid(g * self.alpha))

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> ExpertForm:
        def move(t):
            return None if t is None else t.to(device, dtype or t.dtype)

        return replace(self, gate_bias=move(self.gate_bias), up_bias=move(self.up_bias),
                       down_bias=move(self.down_bias))


def moe_forward(x: torch.Tensor, gate: ExpertMatrix, up: ExpertMatrix, down: ExpertMatrix,
                experts: torch.Tensor, pair_offsets: torch.Tensor, pair_tokens: torch.Tensor,
                pair_weights: torch.Tensor, round_to: torch.dtype = torch.float32,
                form: ExpertForm | None = None) -> torch.Tensor:
    """x [T, H] fp32 → y [T, H] fp32 = Σ_pairs weight · down(silu(gate x) · up x) (or `form`'s function).
    `round_to` rounds the projections' outputs, the silu and the products to that dtype, where a GPU expert in
    that dtype rounds (with a `form`: the dots, the biased values, the activation, the weighted output)."""
    def r(t: torch.Tensor) -> torch.Tensor:
        return t.to(round_to).float()

    f = form
    y = torch.zeros_like(x, dtype=torch.float32)
    for i, e in enumerate(experts.tolist()):
        lo, hi = int(pair_offsets[i]), int(pair_offsets[i + 1])
        tokens = pair_tokens[lo:hi].long()
        h = x[tokens].float()
        g, u = r(F.linear(h, gate.expert(e))), r(F.linear(h, up.expert(e)))
        if f is None or (f.gate_bias is None and not f.clamped):  # plain SwiGLU, or V4's with its clamps first
            if f is not None:
                g, u = f.clamp_inputs(g, u)
            act = r(r(F.silu(g)) * u)
        else:
            if f.gate_bias is not None:
                g, u = r(g + f.gate_bias[e].float()), r(u + f.up_bias[e].float())
            act = r(f.activate(g, u))
        out = F.linear(act, down.expert(e))
        if f is not None and f.down_bias is not None:
            out = r(out) + f.down_bias[e].float()
        y.index_add_(0, tokens, r(r(out) * r(pair_weights[lo:hi, None].float())))
    return y
