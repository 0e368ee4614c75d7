"""DeepSeek-V4's hyper-connection weights in one Triton launch: from a token's projected mixes, the sigmoid
weights into and out of a block and the N×N stream mixing made doubly stochastic by Sinkhorn-Knopp. Plain torch
(`reference.py`) spends ~120 launches on it per block and token batch (19 rounds of two normalisations, each a
sum, an add and a divide, on a 4×4 matrix), twice a layer: at decode, where V4 runs eagerly, launches are the
step's cost. One program per token holds its matrix in registers through every round. fp32 throughout; the
tests run it under Triton's interpreter on the CPU.

Shapes: T tokens, N streams (hc_mult), NB the power of two ≥ N the program's block has (masked beyond N).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no triton on this platform: `available()` says so
    triton = None


def available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


if triton is not None:

    @triton.jit
    def _mix_kernel(mixes_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, eps,
                    N: tl.constexpr, NB: tl.constexpr, ITERS: tl.constexpr):
        """Program t: pre, post [N] and comb [N, N] of token t (rows i, columns j; softmax along j)."""
        t = tl.program_id(0)
        width = (2 + N) * N
        i, j = tl.arange(0, NB), tl.arange(0, NB)
        mi = i < N
        s0, s1, s2 = tl.load(scale_ptr), tl.load(scale_ptr + 1), tl.load(scale_ptr + 2)
        pre = tl.sigmoid(tl.load(mixes_ptr + t * width + i, mask=mi, other=0.0) * s0
                         + tl.load(base_ptr + i, mask=mi, other=0.0)) + eps
        post = 2 * tl.sigmoid(tl.load(mixes_ptr + t * width + N + i, mask=mi, other=0.0) * s1
                              + tl.load(base_ptr + N + i, mask=mi, other=0.0))
        tl.store(pre_ptr + t * N + i, pre, mask=mi)
        tl.store(post_ptr + t * N + i, post, mask=mi)
        cell = i[:, None] * N + j[None, :]
        inside = mi[:, None] & (j < N)[None, :]
        logits = tl.load(mixes_ptr + t * width + 2 * N + cell, mask=inside, other=0.0) * s2 \
            + tl.load(base_ptr + 2 * N + cell, mask=inside, other=0.0)
        logits = tl.where(inside, logits, float("-inf"))
        e = tl.exp(logits - tl.max(logits, axis=1)[:, None])
        e = tl.where(inside, e, 0.0)
        comb = tl.where(inside, e / tl.sum(e, axis=1)[:, None] + eps, 0.0)
        comb = comb / (tl.sum(comb, axis=0)[None, :] + eps)
        for _ in tl.static_range(ITERS - 1):
            comb = comb / (tl.sum(comb, axis=1)[:, None] + eps)
            comb = comb / (tl.sum(comb, axis=0)[None, :] + eps)
        tl.store(comb_ptr + t * N * N + cell, comb, mask=inside)


def hyper_mix(mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int,
              eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As reference.hyper_mix (fp32 inputs on one device): pre, post [T, N] and comb [T, N, N], new tensors."""
    mixes, base, scale = (x.float().contiguous() for x in (mixes, base, scale))
    t = mixes.shape[0]
    if mixes.shape[-1] != (2 + n) * n or base.numel() != (2 + n) * n or scale.numel() != 3:
        raise ValueError(f"hyper_mix: mixes {tuple(mixes.shape)}, base {tuple(base.shape)} and scale "
                         f"{tuple(scale.shape)} do not fit {n} streams")
    pre = mixes.new_empty(t, n)
    post = mixes.new_empty(t, n)
    comb = mixes.new_empty(t, n, n)
    if t:
        _mix_kernel[(t,)](mixes, base, scale, pre, post, comb, float(eps), N=n,
                          NB=triton.next_power_of_2(n), ITERS=max(1, iters))
    return pre, post, comb
