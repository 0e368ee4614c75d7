"""Routed-expert execution: the only way a model touches its routed experts.

A model's MoE block computes the router and calls `ExpertExecutor.forward(layer, hidden, topk_ids,
topk_weights)`. Where the expert weights live (all resident on the GPU, a byte-budgeted GPU cache over pinned
host RAM, the CPU) is the executor's business; every executor must give the same result as the resident one.

Shapes: N tokens, H hidden, I expert intermediate, E experts, K experts per token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


@dataclass(slots=True)
class LayerExperts:
    """Stacked weights of one layer's routed experts, in HF orientation (out_features, in_features)."""

    gate_proj: torch.Tensor  # [E, I, H]
    up_proj: torch.Tensor  # [E, I, H]
    down_proj: torch.Tensor  # [E, H, I]

    @property
    def num_experts(self) -> int:
        return self.gate_proj.shape[0]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.gate_proj, self.up_proj, self.down_proj))


class ExpertExecutor(Protocol):
    def forward(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        """hidden [N, H], topk_ids [N, K] (int), topk_weights [N, K] → weighted sum of expert outputs [N, H]."""
        ...


def expert_mlp(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """SwiGLU expert: x [n, H]; gate, up [I, H]; down [H, I]."""
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


def grouped_expert_forward(experts: LayerExperts, hidden: torch.Tensor, topk_ids: torch.Tensor,
                           topk_weights: torch.Tensor) -> torch.Tensor:
    """Groups the (token, expert) pairs by expert and runs each expert once on its tokens."""
    n, k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=experts.num_experts).tolist()  # one host sync per layer
    token_of_pair = order // k
    weight_of_pair = topk_weights.reshape(-1)[order].to(hidden.dtype)
    out = torch.zeros_like(hidden)
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        tokens = token_of_pair[start:start + count]
        y = expert_mlp(hidden[tokens], experts.gate_proj[e], experts.up_proj[e], experts.down_proj[e])
        out.index_add_(0, tokens, y * weight_of_pair[start:start + count, None])
        start += count
    return out


def gathered_expert_forward(experts: LayerExperts, hidden: torch.Tensor, topk_ids: torch.Tensor,
                            topk_weights: torch.Tensor) -> torch.Tensor:
    """Runs every (token, expert) pair as one batched matmul over gathered weights: no host synchronisation,
    so it can be captured in a CUDA graph. Copies K experts' weights per token: meant for decode (small N)."""
    n, k = topk_ids.shape
    ids = topk_ids.reshape(-1)
    x = hidden.repeat_interleave(k, dim=0)[:, :, None]  # [N*K, H, 1]
    h = F.silu(torch.bmm(experts.gate_proj[ids], x)) * torch.bmm(experts.up_proj[ids], x)  # [N*K, I, 1]
    y = torch.bmm(experts.down_proj[ids], h)[:, :, 0]  # [N*K, H]
    return (y * topk_weights.reshape(-1, 1).to(y.dtype)).view(n, k, -1).sum(dim=1)


class ResidentExpertExecutor:
    """All routed experts resident on one device (the model's)."""

    def __init__(self, layers: dict[int, LayerExperts]):
        self.layers = layers

    def forward(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        if hidden.is_cuda and torch.cuda.is_current_stream_capturing():
            return gathered_expert_forward(self.layers[layer], hidden, topk_ids, topk_weights)
        return grouped_expert_forward(self.layers[layer], hidden, topk_ids, topk_weights)

    def nbytes(self) -> int:
        return sum(le.nbytes() for le in self.layers.values())
