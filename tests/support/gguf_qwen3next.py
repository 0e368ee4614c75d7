"""Qwen3-Next checkpoints written as GGUF (architecture qwen3next) the way llama.cpp's converter writes them, from
the tiny checkpoints `write_hf_checkpoint("qwen3_next", ...)` writes:

- names from gguf-py's tensor map for qwen3next (checked in the test), the fused DeltaNet input projection
  regrouped: HF's in_proj_qkvz rows come per key head as [q, k, v, z]; the converter writes `attn_qkv` (every
  head's q, then every k, then every v) and `attn_gate` (every z);
- A_log as A = -exp(A_log) (`ssm_a`, no suffix), dt_bias as `ssm_dt.bias`, the conv kernel squeezed to
  [channels, kernel], and every (1 + w) norm (all but the DeltaNet's output norm) stored as 1 + w;
- the DeltaNet sizes as `ssm.*` keys, the partial rotary width as the rope dimension count. llama.cpp's
  qwen3next has no dense-MLP layers: the checkpoint must route every layer (`mlp_only_layers=[]`).

Qwen3.5-MoE (architecture qwen35moe, `write_qwen35moe_gguf`) keeps the projections apart (`attn_qkv`,
`attn_gate`, `ssm_alpha`, `ssm_beta`) and reorders every value-head axis from HF's grouping by key head to ggml's
tiled order (the converter's `_reorder_v_heads`), when there are more value heads than key heads.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from support.gguf_writing import close_writer, open_writer, read_checkpoint

NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
    "linear_attn.in_proj_ba.weight": "ssm_ba.weight", "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.A_log": "ssm_a", "linear_attn.dt_bias": "ssm_dt.bias", "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
    **{f"self_attn.{p}_proj.weight": f"attn_{g}.weight" for p, g in (("q", "q"), ("k", "k"), ("v", "v"),
                                                                     ("o", "output"))},
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    **{f"mlp.shared_expert.{p}_proj.weight": f"ffn_{p}_shexp.weight" for p in ("gate", "up", "down")},
}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")


def split_qkvz(w: torch.Tensor, cfg: dict) -> tuple[torch.Tensor, torch.Tensor]:
    heads, dk = cfg["linear_num_key_heads"], cfg["linear_key_head_dim"]
    dv = cfg["linear_num_value_heads"] // heads * cfg["linear_value_head_dim"]
    q, k, v, z = w.view(heads, 2 * dk + 2 * dv, -1).split([dk, dk, dv, dv], dim=1)
    width = w.shape[-1]
    return torch.cat([t.reshape(-1, width) for t in (q, k, v)]), z.reshape(-1, width)


def _converted(hf: dict[str, torch.Tensor], convert) -> dict[str, np.ndarray]:
    """What both architectures' converters share: the global tensors, the routed experts stacked per layer, and
    `convert(layer, module, w)` → {GGUF name: tensor} for every other layer tensor."""
    out = {"token_embd.weight": hf["model.embed_tokens.weight"], "output_norm.weight": hf["model.norm.weight"] + 1,
           "output.weight": hf["lm_head.weight"]}
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name, w in hf.items():
        m = _LAYER.fullmatch(name)
        if m is None:
            continue
        if e := _EXPERT.fullmatch(m[2]):
            experts.setdefault((int(m[1]), e[2]), {})[int(e[1])] = w
        else:
            out |= convert(m[1], m[2], w)
    for (layer, part), by_id in sorted(experts.items()):
        out[f"blk.{layer}.ffn_{part}_exps.weight"] = torch.stack([by_id[i] for i in range(len(by_id))])
    return {n: t.float().numpy() for n, t in out.items()}


def _common(module: str, w: torch.Tensor) -> torch.Tensor:
    """The converter's changes both architectures get (Qwen3NextModel.modify_tensors)."""
    if module == "linear_attn.A_log":
        return -torch.exp(w)
    if module == "linear_attn.conv1d.weight":
        return w.squeeze(1)
    if module.endswith("norm.weight") and module != "linear_attn.norm.weight":
        return w + 1  # the (1 + w) norms, stored as 1 + w
    if module == "mlp.shared_expert_gate.weight":
        return w.reshape(-1)  # llama.cpp declares it {n_embd}
    return w


def gguf_tensors(hf: dict[str, torch.Tensor], cfg: dict) -> dict[str, np.ndarray]:
    def convert(layer: str, module: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
        if module == "linear_attn.in_proj_qkvz.weight":
            qkv, z = split_qkvz(w, cfg)
            return {f"blk.{layer}.attn_qkv.weight": qkv, f"blk.{layer}.attn_gate.weight": z}
        return {f"blk.{layer}.{NAMES[module]}": _common(module, w)}

    return _converted(hf, convert)


def write_qwen3next_gguf(hf_dir: Path, gguf_path: Path) -> Path:
    return _write(hf_dir, gguf_path, "qwen3next", gguf_tensors)


def _write(hf_dir: Path, gguf_path: Path, arch: str, tensors) -> Path:
    cfg, hf = read_checkpoint(hf_dir)
    types = cfg["layer_types"]
    interval = types.index("full_attention") + 1
    if any((t == "full_attention") != ((i + 1) % interval == 0) for i, t in enumerate(types)):
        raise ValueError("qwen3next GGUFs state the layer pattern as full_attention_interval only")
    w = open_writer(gguf_path, arch, cfg)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_dimension_count(int(cfg["head_dim"] * cfg["rope_parameters"]["partial_rotary_factor"]))
    w.add_expert_count(cfg["num_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
    w.add_ssm_state_size(cfg["linear_key_head_dim"])
    w.add_ssm_group_count(cfg["linear_num_key_heads"])
    w.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
    w.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
    w.add_full_attention_interval(interval)
    close_writer(w, hf_dir, tensors(hf, cfg))
    return Path(gguf_path)


QWEN35_NAMES = {
    **{k: v for k, v in NAMES.items() if not k.startswith("linear_attn.in_proj")},
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight", "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight", "linear_attn.in_proj_b.weight": "ssm_beta.weight",
}


def tile_value_heads(t: torch.Tensor, dim: int, head_dim: int, cfg: dict) -> torch.Tensor:
    """HF's value heads grouped by key head [K0: v0 v1 …, K1: …] → ggml's tiled order [v0: K0 K1 …, v1: …]."""
    kh, vh = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], kh, vh // kh, head_dim, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).reshape(shape)


def qwen35_tensors(hf: dict[str, torch.Tensor], cfg: dict) -> dict[str, np.ndarray]:
    dv, key_total = cfg["linear_value_head_dim"], cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
    tile = lambda t, dim, head_dim: tile_value_heads(t, dim, head_dim, cfg)  # noqa: E731

    def convert(layer: str, module: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
        if module in ("linear_attn.in_proj_qkv.weight", "linear_attn.conv1d.weight"):  # value rows / channels
            w = w.squeeze(1) if w.dim() == 3 else w
            w = torch.cat((w[:2 * key_total], tile(w[2 * key_total:], 0, dv)))
            return {f"blk.{layer}.{QWEN35_NAMES[module]}": w}
        if module == "linear_attn.in_proj_z.weight":
            w = tile(w, 0, dv)
        elif module in ("linear_attn.in_proj_a.weight", "linear_attn.in_proj_b.weight", "linear_attn.dt_bias",
                        "linear_attn.A_log"):
            w = tile(w, 0, 1)
        elif module == "linear_attn.out_proj.weight":
            w = tile(w, 1, dv)
        return {f"blk.{layer}.{QWEN35_NAMES[module]}": _common(module, w)}

    return _converted(hf, convert)


def write_qwen35moe_gguf(hf_dir: Path, gguf_path: Path) -> Path:
    return _write(hf_dir, gguf_path, "qwen35moe", qwen35_tensors)
