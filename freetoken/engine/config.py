"""Family-independent descriptions of a loaded model and of the runtime knobs.

`MoESpec` is the contract the offloader, planner, dashboard and benchmarks read: they never look inside a model
family. `EngineConfig` holds runtime knobs and is frozen so one engine never changes behaviour mid-run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Bytes per block and elements per block of the GGUF formats we read (ggml's block layouts).
_GGUF_BLOCKS: dict[str, tuple[int, int]] = {
    "F32": (1, 4), "F16": (1, 2), "BF16": (1, 2), "Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20),
    "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210), "MXFP4": (32, 17),
    "FP8_B32": (32, 36),
}


@dataclass(slots=True, frozen=True)
class MoESpec:
    """Shape of a model's routed experts. Dense models have no MoESpec (None)."""

    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    hidden_size: int
    expert_intermediate_size: int
    num_shared_experts: int = 0
    shared_expert_intermediate_size: int = 0

    @property
    def params_per_expert(self) -> int:
        # gate, up: [I, H]; down: [H, I]
        return 3 * self.hidden_size * self.expert_intermediate_size

    @property
    def total_routed_experts(self) -> int:
        return len(self.moe_layers) * self.num_experts

    def bytes_per_expert(self, fmt: torch.dtype | str) -> int:
        """Bytes one routed expert takes in a torch dtype or a GGUF tensor type name ("Q4_K", ...)."""
        if isinstance(fmt, torch.dtype):
            return self.params_per_expert * fmt.itemsize
        if fmt not in _GGUF_BLOCKS:
            raise ValueError(f"unknown weight format {fmt!r}; known: {', '.join(_GGUF_BLOCKS)}")
        elems, nbytes = _GGUF_BLOCKS[fmt]
        per_matrix = self.hidden_size * self.expert_intermediate_size
        return 3 * (per_matrix // elems) * nbytes


@dataclass(slots=True, frozen=True)
class EngineConfig:
    """Runtime knobs of one engine instance."""

    device: str = "cpu"
    dtype: torch.dtype | None = None  # None: bf16 on CUDA, fp32 on CPU
    kv_page_size: int = 16
    max_seq_len: int | None = None  # None: the model's context length

    def resolved_dtype(self) -> torch.dtype:
        if self.dtype is not None:
            return self.dtype
        return torch.bfloat16 if torch.device(self.device).type == "cuda" else torch.float32
