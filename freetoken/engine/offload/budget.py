"""`--expert-cache auto`: how many bytes of routed experts the device can hold next to everything else.

The device must first fit the dense weights, a KV reserve and room for activations; what is left goes to the
expert cache. When every expert fits, nothing is offloaded.
"""

from __future__ import annotations

import logging

import torch

from freetoken.engine.config import MoESpec

log = logging.getLogger(__name__)

ACTIVATION_RESERVE = 2 * 2**30  # prefill chunks of 2048 tokens, logits, allocator slack
KV_RESERVE_TOKENS = 32768
STAGING_BYTES = 512 << 20  # decode's share of the staging ring
PREFILL_STAGING_BYTES = 3 << 30


def staging_slots_for(spec: MoESpec, expert_bytes: int, prefill_ahead: bool = False) -> int:
    """Staging slots beyond the cache, never < 2. Decode wants two steps' worth of experts (2 × top-k: one step
    streaming while the last computes, within STAGING_BYTES: Mixtral's 352 MB experts get 2). With
    `prefill_ahead` (a long chunk streams the next layer while this one computes) two layers' worth (2 × experts
    per layer, within PREFILL_STAGING_BYTES: 2.25 GiB for Qwen3-30B-A3B in bf16)."""
    per = max(expert_bytes, 1)
    decode = min(2 * spec.top_k, STAGING_BYTES // per)
    prefill = min(2 * spec.num_experts, PREFILL_STAGING_BYTES // per) if prefill_ahead else 0
    return max(2, decode, prefill)


def split_expert_budget(nbytes: int, block_share: float, slot_bytes: int, row_bytes: int | None,
                        total: int) -> tuple[int, int]:
    """(dequantized slots, block-store rows) for an expert cache of `nbytes`: `block_share` of it keeps experts in
    their block format (`row_bytes` each; None for dense experts, which have none), the rest dequantized. Neither
    holds more than every expert."""
    if not 0.0 <= block_share <= 1.0:
        raise ValueError(f"the block share of the expert cache is a fraction from 0 to 1, got {block_share}")
    if row_bytes is None:
        block_share = 0.0
    rows = min(int(nbytes * block_share) // row_bytes, total) if block_share else 0
    slots = min((nbytes - rows * (row_bytes or 0)) // slot_bytes, total) if block_share < 1 else 0
    return slots, rows


def auto_expert_cache(free_bytes: int, dense_bytes: int, kv_bytes: int, expert_bytes: int,
                      activation_reserve: int = ACTIVATION_RESERVE) -> int | None:
    """Expert-cache bytes for the free device memory, or None when every expert fits (keep them resident)."""
    left = free_bytes - dense_bytes - kv_bytes - activation_reserve
    if left >= expert_bytes:
        return None
    return max(left, 0)


def kv_bytes_per_token(args, dtype: torch.dtype) -> int:
    """K and V of one token in every layer that keeps them (a hybrid model's full-attention layers only; one
    tensor where the values are the keys, as DeepSeek's cached latent is)."""
    a = args.decoder.attention
    layers = getattr(args, "full_attention_layers", None)
    n = args.decoder.n_layers if layers is None else len(layers)
    pools = 1 if getattr(args, "values_are_keys", False) else 2
    return pools * n * a.n_kv_heads * a.head_dim * dtype.itemsize


def resolve_auto(device: torch.device, spec: MoESpec, args, dense_bytes: int, dtype: torch.dtype,
                 prefill_ahead: bool = False) -> int | None:
    """Applies `auto_expert_cache` to this device; the CPU's memory is the host's, so nothing is offloaded."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    tokens = min(KV_RESERVE_TOKENS, args.decoder.max_position_embeddings)
    kv = tokens * kv_bytes_per_token(args, dtype)
    per_expert = spec.bytes_per_expert(dtype)
    experts = spec.total_routed_experts * per_expert
    staging = staging_slots_for(spec, per_expert, prefill_ahead) * per_expert  # the executor's ring, beside the cache
    cache = auto_expert_cache(free, dense_bytes, kv, experts, ACTIVATION_RESERVE + staging)
    if cache is None:
        log.info("expert cache auto: all %.1f GiB of experts fit on %s; keeping them resident", experts / 2**30, device)
    else:
        log.info("expert cache auto: %.1f GiB of %.1f GiB of experts on %s (free %.1f GiB, dense %.1f GiB, "
                 "KV reserve %.1f GiB for %d tokens, staging %.1f GiB)", cache / 2**30, experts / 2**30, device,
                 free / 2**30, dense_bytes / 2**30, kv / 2**30, tokens, staging / 2**30)
    return cache
