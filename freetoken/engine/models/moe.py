"""The sparse MoE block shared by the MoE families: router (softmax → top-k, optional renormalisation), routed
experts through an `ExpertExecutor`, and an optional shared expert scaled by a sigmoid gate (Qwen2-MoE).

Also the description of how a family names its per-expert checkpoint tensors, so the loader can stack them.

Shapes: N tokens, Hd hidden, E experts, K experts per token.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.engine.config import MoESpec
from freetoken.engine.experts import ExpertExecutor
from freetoken.engine.models.decoder import DenseMLP


@dataclass(slots=True, frozen=True)
class ExpertNaming:
    """How routed-expert tensors are named in a family's HF checkpoints."""

    pattern: re.Pattern  # groups: layer, expert, projection
    projections: dict[str, str]  # checkpoint projection name → gate_proj / up_proj / down_proj

    def match(self, name: str) -> tuple[int, int, str] | None:
        m = self.pattern.fullmatch(name)
        if m is None:
            return None
        return int(m.group(1)), int(m.group(2)), self.projections[m.group(3)]


QWEN_EXPERTS = ExpertNaming(
    re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight"),
    {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"},
)


class SparseMoeBlock(nn.Module):
    def __init__(self, layer_idx: int, hidden_size: int, num_experts: int, top_k: int, norm_topk_prob: bool,
                 shared_expert_intermediate_size: int = 0):
        super().__init__()
        self.layer_idx, self.top_k, self.norm_topk_prob = layer_idx, top_k, norm_topk_prob
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        if shared_expert_intermediate_size:
            self.shared_expert = DenseMLP(hidden_size, shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)
        self.experts: ExpertExecutor | None = None  # attached by the loader; not an nn.Module on purpose

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        topk_weights, topk_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
        out = self.experts.forward(self.layer_idx, x, topk_ids, topk_weights.to(x.dtype))
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class GroupedSigmoidRouter(nn.Module):
    """DeepSeek-V3-style routing (GLM-4.5 too): sigmoid scores; a learnt per-expert bias picks the experts but
    does not weigh them; experts come in `n_group` groups, each group ranked by its two best biased scores, and
    only the best `topk_group` groups compete; the chosen scores are optionally renormalised, then scaled by
    `routed_scaling_factor`. Computed in fp32 whatever the activations."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, n_group: int, topk_group: int,
                 norm_topk_prob: bool, routed_scaling_factor: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts))
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.norm_topk_prob, self.scale = norm_topk_prob, routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, Hd] → (weights [N, K] fp32, ids [N, K])."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        biased = scores + self.e_score_correction_bias.float()
        n, e = biased.shape
        groups = biased.view(n, self.n_group, e // self.n_group).topk(2, dim=-1).values.sum(dim=-1)
        keep = torch.zeros_like(groups, dtype=torch.bool).scatter_(1, groups.topk(self.topk_group, dim=-1).indices,
                                                                   True)
        biased = biased.masked_fill(~keep.repeat_interleave(e // self.n_group, dim=1), float("-inf"))
        ids = biased.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scale, ids


class GroupedSigmoidMoeBlock(nn.Module):
    """Routed experts behind a `GroupedSigmoidRouter` plus always-on shared experts (one MLP of
    n_shared × the expert width, no gate)."""

    def __init__(self, layer_idx: int, hidden_size: int, router: GroupedSigmoidRouter, shared_intermediate_size: int):
        super().__init__()
        self.layer_idx, self.top_k = layer_idx, router.top_k
        self.gate = router
        if shared_intermediate_size:
            self.shared_experts = DenseMLP(hidden_size, shared_intermediate_size)
        self.experts: ExpertExecutor | None = None  # attached by the loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts.forward(self.layer_idx, x, ids, weights.to(x.dtype))
        if hasattr(self, "shared_experts"):
            out = out + self.shared_experts(x)
        return out


@dataclass(slots=True)
class GroupedRouting:
    """The MLP side of the DeepSeek-style families (deepseek_v3, glm4_moe): dense layers first, then routed
    experts behind a `GroupedSigmoidRouter` plus shared experts, as their configs spell it."""

    intermediate_size: int  # the dense layers' MLP
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
    def from_config(cls, cfg: dict, n_layers: int) -> GroupedRouting:
        first_dense = int(cfg.get("first_k_dense_replace") or 0)
        kinds = cfg.get("mlp_layer_types")  # GLM-5 spells the layers out ("dense" / "sparse")
        moe_layers = tuple(i for i, k in enumerate(kinds) if k == "sparse") if kinds else tuple(range(first_dense,
                                                                                                      n_layers))
        return cls(int(cfg["intermediate_size"]), int(cfg["moe_intermediate_size"]),
                   int(cfg.get("n_routed_experts") or cfg.get("num_local_experts")), int(cfg["num_experts_per_tok"]),
                   int(cfg.get("n_shared_experts") or 0), int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1),
                   bool(cfg.get("norm_topk_prob", True)), float(cfg.get("routed_scaling_factor") or 1.0), moe_layers)

    def moe_spec(self, hidden_size: int) -> MoESpec:
        shared = self.n_shared_experts
        return MoESpec(self.moe_layers, self.num_experts, self.top_k, hidden_size, self.moe_intermediate_size,
                       shared, shared * self.moe_intermediate_size)

    def mlp(self, layer_idx: int, hidden_size: int) -> nn.Module:
        """Layer `layer_idx`'s MLP: the routed block, or a dense one."""
        if layer_idx not in self.moe_layers:
            return DenseMLP(hidden_size, self.intermediate_size)
        router = GroupedSigmoidRouter(hidden_size, self.num_experts, self.top_k, self.n_group, self.topk_group,
                                      self.norm_topk_prob, self.routed_scaling_factor)
        shared = self.n_shared_experts * self.moe_intermediate_size
        return GroupedSigmoidMoeBlock(layer_idx, hidden_size, router, shared)


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def without_layers_past(name: str, n_layers: int) -> str | None:
    """None for tensors of layers past the model's (the multi-token-prediction layers checkpoints append)."""
    m = _LAYER.match(name)
    return None if m and int(m.group(1)) >= n_layers else name
