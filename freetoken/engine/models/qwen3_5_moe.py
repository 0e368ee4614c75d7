"""Qwen3.5/3.6-MoE: Qwen3-Next's hybrid layers (qwen3_next.py) with the DeltaNet's input projections kept apart
(`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`, no per-key-head grouping), every layer MoE and top-k
weights always renormalised. Hub checkpoints are the vision-language model (`qwen3_5_moe`: the text model's
config under `text_config`, its weights under `model.language_model.`); the vision tower is not loaded, so text
prompts run and images are refused by the chat template's lack of them. Text-only saves (`qwen3_5_moe_text`)
load as they are. For text, the multimodal RoPE sections all see the same position: plain partial RoPE.

Shapes as in qwen3_next.py.
"""

from __future__ import annotations

import torch
from torch import nn

from freetoken.engine.models import mtp, qwen3_next
from freetoken.engine.models.moe import QWEN_EXPERTS

MODEL_TYPE = "qwen3_5_moe"
MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
EXPERT_NAMING = QWEN_EXPERTS


class ModelArgs(qwen3_next.ModelArgs):
    __slots__ = ()

    @classmethod
    def from_config(cls, cfg: dict) -> qwen3_next.ModelArgs:
        text = dict(cfg.get("text_config") or cfg)
        text.setdefault("norm_topk_prob", True)
        text["mlp_only_layers"], text["decoder_sparse_step"] = [], 1  # every layer routes
        return qwen3_next.ModelArgs.from_config(text)


class SplitProjectionDeltaNet(qwen3_next.GatedDeltaNet):
    def _projections(self, hidden_size: int) -> None:
        la = self.la
        key_total, value_total = la.key_heads * la.key_dim, la.value_heads * la.value_dim
        self.in_proj_qkv = nn.Linear(hidden_size, 2 * key_total + value_total, bias=False)
        self.in_proj_z = nn.Linear(hidden_size, value_total, bias=False)
        self.in_proj_b = nn.Linear(hidden_size, la.value_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden_size, la.value_heads, bias=False)

    def _split(self, x: torch.Tensor):
        la, t = self.la, x.shape[0]
        key_total = la.key_heads * la.key_dim
        q, k, v = self.in_proj_qkv(x).split([key_total, key_total, la.value_heads * la.value_dim], dim=-1)
        return (q.reshape(t, la.key_heads, la.key_dim), k.reshape(t, la.key_heads, la.key_dim),
                v.reshape(t, la.value_heads, la.value_dim), self.in_proj_z(x).view(t, la.value_heads, la.value_dim),
                self.in_proj_b(x), self.in_proj_a(x))


class Model(qwen3_next.Model):
    DELTA_NET = SplitProjectionDeltaNet


with_mtp = qwen3_next.with_mtp


def checkpoint_name(name: str, args: qwen3_next.ModelArgs) -> str | None:
    """Vision-language checkpoints: the language model's tensors under the text model's names; the vision tower
    is left out, the multi-token-prediction layer loaded only with `args.mtp` (models/mtp.py)."""
    if name.startswith("model.visual."):
        return None
    if name.startswith(("mtp.", "model.mtp.")):
        return mtp.qwen_checkpoint_name(name.removeprefix("model."), args.decoder.n_layers, args.mtp)
    return "model." + name.removeprefix("model.language_model.") if name.startswith("model.language_model.") \
        else name
