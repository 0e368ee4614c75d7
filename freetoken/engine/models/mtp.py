"""Multi-token prediction (DeepSeek-V3's MTP layer): one more decoder layer past the model's own that, at
position i, joins the main model's final hidden state h_i (after the final norm) with the embedding of the token
at i + 1 and predicts the token at i + 2 — the draft that speculative decoding checks (engine/speculative.py).

    x_i = eh_proj([enorm(embed(t[i+1])), hnorm(h_i)]);   y_i = layer(x_i) at position i;   logits = head(norm(y_i))

The layer keeps its own cache rows (layer index `n_layers` of the sequence's cache) at the main model's
positions, written after the main layers (`TrailingAttention`). The embedding and the output head are the main
model's, which DeepSeek-V3 shares with its MTP layer, so the checkpoint's copies are not loaded. Its routed
experts are layer `n_layers` of the expert executor (offloaded like any other layer's).

DeepSeek-V3, GLM-4.5 and GLM-5 checkpoints append the layer as `model.layers.{n_layers}.*`
(`num_nextn_predict_layers` of them; the first is used), their GGUFs as `blk.{n_layers}.nextn.*`; Qwen3-Next and
Qwen3.5 name the same parts `mtp.*` (`qwen_checkpoint_name`), with norms that scale by 1 + weight."""

from __future__ import annotations

import dataclasses
import re

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.engine.models.decoder import RMSNorm
from freetoken.errors import ModelLoadError

_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.norm.")  # the MTP layer's own tensors beside its block
_SHARED = ("embed_tokens.", "shared_head.head.")  # copies of the main model's embedding and head


class _SharedHead(nn.Module):
    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm


class MultiTokenPredictor(nn.Module):
    """`layer`: the family's decoder layer built for index `n_layers` (its attention and experts use it);
    `norm`: the family's RMSNorm class (Qwen3-Next's scales by 1 + weight)."""

    def __init__(self, hidden_size: int, eps: float, layer: nn.Module, norm: type[nn.Module] = RMSNorm):
        super().__init__()
        self.enorm = norm(hidden_size, eps)
        self.hnorm = norm(hidden_size, eps)
        self.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.shared_head = _SharedHead(norm(hidden_size, eps))
        self.layer = layer

    def forward(self, model: nn.Module, hidden: torch.Tensor, next_tokens: torch.Tensor, ctx) -> torch.Tensor:
        """hidden [T, Hd]: the main model's normed final hidden states at `ctx.positions`; next_tokens [T]: the
        token after each → logits [T, V] of the token after that."""
        embedded = model.model.embed_tokens(next_tokens)
        x = self.eh_proj(torch.cat((self.enorm(embedded), self.hnorm(hidden.to(embedded.dtype))), dim=-1))
        cos, sin = model.rotary(ctx.positions, x.dtype)
        x = self.run_layer(x, cos, sin, ctx)
        return F.linear(self.shared_head.norm(x), model.output_weight())

    def run_layer(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx) -> torch.Tensor:
        """The block (a family whose layers take or return more than x overrides this)."""
        return self.layer(x, cos, sin, ctx)


# Qwen3-Next / Qwen3.5 name the same parts `mtp.*`: fc is eh_proj, the two pre-fc norms enorm and hnorm, norm the
# head's norm, layers.0 the block
_QWEN_OWN = {"mtp.fc.": "mtp.eh_proj.", "mtp.pre_fc_norm_embedding.": "mtp.enorm.",
             "mtp.pre_fc_norm_hidden.": "mtp.hnorm.", "mtp.norm.": "mtp.shared_head.norm."}


def qwen_checkpoint_name(name: str, n_layers: int, load: bool) -> str | None:
    """`checkpoint_name` for Qwen3-Next's `mtp.*` tensors: None without `load`, its own tensors and block under
    this module's names, its routed experts as layer n_layers's (`model.layers.{n}.mlp.experts.*`); others as
    they are."""
    if not name.startswith("mtp."):
        return name
    if not load:
        return None
    for old, new in _QWEN_OWN.items():
        if name.startswith(old):
            return new + name[len(old):]
    if not name.startswith("mtp.layers.0."):
        return None  # further depths
    rest = name[len("mtp.layers.0."):]
    if rest.startswith("mlp.experts."):
        return f"model.layers.{n_layers}.{rest}"
    return "mtp.layer." + rest


def require_layer(args) -> None:
    """A clear error where the config states no multi-token-prediction layer (`args.mtp_layers` 0)."""
    if not args.mtp_layers:
        raise ModelLoadError("this checkpoint has no multi-token-prediction layer (num_nextn_predict_layers is "
                             "0); run it without speculative decoding")


def with_mtp(args):
    """A family's `args` (`decoder`, `routing`: moe.GroupedRouting, `mtp_layers`, `mtp`) with the first
    multi-token-prediction layer: a routed layer at index n_layers (DeepSeek-V3's and GLM-4.5's are)."""
    require_layer(args)
    routing = dataclasses.replace(args.routing, moe_layers=(*args.routing.moe_layers, args.decoder.n_layers))
    return dataclasses.replace(args, routing=routing, mtp=True)


def checkpoint_name(name: str, n_layers: int, load: bool) -> str | None:
    """The model's name for a checkpoint tensor where the MTP layer follows `n_layers` main layers: main layers'
    names unchanged; with `load`, the first MTP layer's own tensors under `mtp.`, its block under `mtp.layer.`,
    its routed experts unchanged (the expert loader files them as layer n_layers); everything else of the MTP
    layers None (not loaded). GGUF files name them `blk.{n}.nextn.*` (formats/gguf_model.py maps those here)."""
    m = _LAYER.match(name)
    if m is None or int(m.group(1)) < n_layers:
        return name
    rest = name[m.end():]
    if not load or int(m.group(1)) != n_layers or rest.startswith(_SHARED):
        return None
    if rest.startswith(_OWN):
        return "mtp." + rest
    if rest.startswith(("mlp.experts.", "experts.")):  # per expert (safetensors) or stacked (GGUF)
        return name
    return "mtp.layer." + rest
