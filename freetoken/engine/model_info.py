"""`ft info`: what a checkpoint is, read from its config and tensor headers without loading any weights."""

from __future__ import annotations

import torch

from freetoken.engine.checkpoints import GGUFCheckpoint, HFCheckpoint, open_checkpoint
from freetoken.engine.config import MoESpec
from freetoken.engine.loader import no_param_init
from freetoken.engine.models import family_for
from freetoken.engine.offload.budget import kv_bytes_per_token
from freetoken.engine.sources import resolve_model_source

_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1}


def describe(source: str | None) -> str:
    path = resolve_model_source(source)
    ckpt = open_checkpoint(path)
    family = family_for(ckpt.config.get("model_type"))
    args = family.ModelArgs.from_config(ckpt.config)
    spec: MoESpec | None = args.moe_spec()
    with torch.device("meta"), no_param_init():
        model = family.Model(args)
    dense = sum(p.numel() for p in model.parameters())
    dec = args.decoder
    lines = [
        f"model          {path}",
        f"format         {ckpt.format}",
        f"architecture   {family.MODEL_TYPE}",
        f"layers         {dec.n_layers}",
        f"hidden size    {dec.hidden_size}",
        f"attention      {_attention(args)}",
        f"vocabulary     {dec.vocab_size}",
        f"context        {dec.max_position_embeddings}",
    ]
    if hasattr(args, "token_mixers"):  # a family that says itself what its layers keep (deepseek_v4)
        lines.append(f"token mixers   {args.token_mixers()}")
    elif (full := getattr(args, "full_attention_layers", None)) is not None:
        lines.append(f"token mixers   {len(full)} full-attention layers, {dec.n_layers - len(full)} Gated DeltaNet "
                     "(recurrent state)")
    lines.append(f"KV per token   {_size(kv_bytes_per_token(args, torch.bfloat16))} in bf16")
    if (mtp := _mtp(ckpt, family)) is not None:
        lines.append(f"MTP layer      {mtp}")
    if spec is None:
        lines.append(f"parameters     {_count(dense)} (dense)")
        return "\n".join(lines)
    routed = spec.total_routed_experts * spec.params_per_expert
    active = dense + len(spec.moe_layers) * spec.top_k * spec.params_per_expert
    shared = f", {spec.num_shared_experts} shared (intermediate {spec.shared_expert_intermediate_size})" \
        if spec.num_shared_experts else ""
    lines += [
        f"parameters     {_count(dense + routed)} total, {_count(active)} active per token",
        f"MoE layers     {len(spec.moe_layers)} of {dec.n_layers}",
        f"experts        {spec.num_experts} routed per layer, top-{spec.top_k}{shared}; "
        f"{spec.total_routed_experts} routed in all",
        f"expert shape   hidden {spec.hidden_size} × intermediate {spec.expert_intermediate_size} "
        f"({_count(spec.params_per_expert)} parameters)",
        f"expert bytes   {_expert_bytes(ckpt, spec)}",
    ]
    return "\n".join(lines)


def _mtp(ckpt: HFCheckpoint | GGUFCheckpoint, family) -> str | None:
    """What the checkpoint's multi-token-prediction layer is good for here, or None without one."""
    names = ckpt.file.tensors if isinstance(ckpt, GGUFCheckpoint) else ckpt.shards
    if not any(".nextn." in n or ".eh_proj." in n or n.startswith(("mtp.", "model.mtp.")) for n in names):
        return None
    if hasattr(family, "with_mtp"):
        return "present: --speculative drafts with it (ft generate, ft chat, ft serve)"
    return "present, not used (no speculative decoding for this family yet)"


def _attention(args) -> str:
    dec = args.decoder
    rope = f"RoPE {dec.rope.rope_type} (theta {dec.rope.theta:g})"
    if (latent := getattr(args, "latent", None)) is not None:  # deepseek_v3: what the cache holds per token
        return (f"multi-head latent, {dec.attention.n_heads} heads; cached per token: latent {latent.kv_lora_rank} "
                f"+ rotary key {latent.rope_dim}; {rope}")
    a = dec.attention
    text = f"{a.n_heads} heads, {a.n_kv_heads} KV heads, head dim {a.head_dim}, {rope}"
    if (sliding := getattr(args, "sliding_layers", None)) is not None:  # gpt_oss
        text += f"; attention sinks; sliding window {args.sliding_window} on {len(sliding)} of {dec.n_layers} layers"
    return text


def _expert_bytes(ckpt: HFCheckpoint | GGUFCheckpoint, spec: MoESpec) -> str:
    layer = spec.moe_layers[0]
    if isinstance(ckpt, GGUFCheckpoint):
        names = [f"blk.{layer}.ffn_{p}_exps.weight" for p in ("gate", "up", "down")]
        infos = [ckpt.file.tensors[n] for n in names if n in ckpt.file.tensors]
        if len(infos) == 3:
            per_expert = sum(i.n_bytes for i in infos) // spec.num_experts
            kinds = "/".join(i.type_name for i in infos)
            return f"{_size(per_expert)} per expert ({kinds}); {_size(per_expert * spec.total_routed_experts)} in all"
        return "unknown (no stacked expert tensors in this file)"
    dtype = _hf_expert_dtype(ckpt)
    block_scaled = (ckpt.config.get("quantization_config") or {}).get("quant_method") == "fp8"
    if any(n.endswith("_blocks") and ".experts." in n for n in ckpt.shards):  # gpt-oss's MXFP4 release
        dtype = "MXFP4"
        per_expert = spec.bytes_per_expert("MXFP4")
    elif block_scaled and dtype == "I8":  # DeepSeek-V4's FP4 experts: two values a byte, kept as MXFP4 blocks
        dtype = "FP4, kept as MXFP4 blocks when offloaded"
        per_expert = spec.bytes_per_expert("MXFP4")
    else:
        per_expert = spec.params_per_expert * _SAFETENSORS_BYTES.get(dtype, 2)
    return f"{_size(per_expert)} per expert ({dtype}); {_size(per_expert * spec.total_routed_experts)} in all"


def _hf_expert_dtype(ckpt: HFCheckpoint) -> str:
    from safetensors import safe_open

    name = next((n for n in ckpt.shards if ".experts." in n and not n.endswith(("scale", "_scale_inv"))),
                next(iter(ckpt.shards)))
    with safe_open(str(ckpt.shards[name]), framework="pt") as f:
        return f.get_slice(name).get_dtype()


def _count(n: int) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def _size(n: int) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} B"
