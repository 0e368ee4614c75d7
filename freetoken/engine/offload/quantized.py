"""Routed experts kept in their GGUF block format in host memory, dequantized only where they are computed.

A Q8_0 expert is 1.06 bytes per weight against bf16's 2 (Q4_K: 0.56), so keeping experts quantized in host RAM
cuts the bytes every cache miss moves over PCIe by that ratio. Each expert's bytes are contiguous (the expert
is the outermost dimension of a stacked GGUF tensor), so one expert is one slice of the raw stack.

Shapes: E experts, H hidden, I expert intermediate, B bytes of one expert's matrix in its block format.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from freetoken.engine.experts import ExpertForm
from freetoken.kernels.gguf_dequant.reference import dequantize

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


@dataclass(slots=True)
class QuantizedExperts:
    raw: dict[str, torch.Tensor]  # projection → [E, B] uint8
    type_names: dict[str, str]  # projection → GGUF type ("Q8_0", "Q4_K", ...)
    shapes: dict[str, tuple[int, int]]  # projection → (out, in) of one expert: gate/up (I, H), down (H, I)
    form: ExpertForm | None = None  # biases and activation where not plain SwiGLU (see experts.ExpertForm)

    @property
    def num_experts(self) -> int:
        return self.raw["gate_proj"].shape[0]

    def expert_nbytes(self) -> int:
        return sum(r.shape[1] for r in self.raw.values())

    def dequantized(self, expert: int, projection: str, dtype: torch.dtype,
                    raw: torch.Tensor | None = None) -> torch.Tensor:
        """One expert's matrix in `dtype`, from `raw` (its bytes, wherever they were copied) or from the store."""
        data = self.raw[projection][expert] if raw is None else raw
        out, inp = self.shapes[projection]
        return dequantize(data, self.type_names[projection], out * inp, dtype).view(out, inp)

    def weights_of(self, expert: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return tuple(self.dequantized(expert, p, dtype) for p in PROJECTIONS)
