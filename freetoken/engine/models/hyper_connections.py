"""DeepSeek-V4's manifold-constrained hyper-connections: the residual as `hc_mult` streams per token.

Residual: `hc_mult` streams per token. Before each block a small projection of the streams gives a collapse
weight per stream (`pre`), an expand weight (`post`) and a stream-mixing matrix (`comb`, made doubly stochastic
by Sinkhorn iterations): block input = Σ pre·stream, new streams = post·block output + combᵀ·streams. `hc_head`
collapses the streams before the final norm.

Shapes: T tokens, N streams, Hd hidden.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.engine import gpu_paths
from freetoken.engine.models.compressed_attention import rms


def hyper_weights(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
                  eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, N, Hd] → (pre [T, N], post [T, N], comb [T, N, N]), in fp32: one projection of the normed,
    flattened streams, then `hyper_mix` (on CUDA with the GPU path "hyper-sinkhorn", one Triton launch instead
    of ~120 small ones: kernels/hyper_sinkhorn)."""
    mixes = F.linear(rms(streams.flatten(1).float(), norm_eps), fn.float())
    mix = hyper_mix
    if mixes.is_cuda and gpu_paths.enabled("hyper-sinkhorn"):
        from freetoken.kernels.hyper_sinkhorn import kernel

        if kernel.available(mixes.device):
            mix = kernel.hyper_mix
    return mix(mixes, base.float(), scale.float(), streams.shape[1], iters, eps)


def hyper_mix(mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int,
              eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mixes [T, (2 + N) N], base [(2 + N) N], scale [3] (fp32) → pre, post [T, N] and comb [T, N, N]: the
    streams' weights into a block, the block's output into each stream, and the streams' mixing, made doubly
    stochastic by `iters` rounds of Sinkhorn-Knopp (it mixes streams without growing them)."""
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(-1, n, n) * scale[2] + comb_b.view(n, n), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb


class HyperHead(nn.Module):
    """The final collapse of the streams into one (before the model's norm)."""

    def __init__(self, hidden_size: int, n: int, eps: float, norm_eps: float):
        super().__init__()
        self.hc_fn = nn.Parameter(torch.zeros(n, n * hidden_size))
        self.hc_base = nn.Parameter(torch.zeros(n))
        self.hc_scale = nn.Parameter(torch.zeros(1))
        self.eps, self.norm_eps = eps, norm_eps

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mixes = F.linear(rms(streams.flatten(1).float(), self.norm_eps), self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.eps
        return (pre[..., None] * streams).sum(dim=1).to(streams.dtype)
