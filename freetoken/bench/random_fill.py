"""Seeded random fills for synthetic models' host tensors at memory speed: word i is splitmix64's finaliser of
i * GOLDEN + seed, counter-based, so the bytes are the same whatever the thread count or chunking, and good enough
for random weights (uniform bytes, no visible correlation).

The CPU expert kernel's `ft_random_fill` computes it on all its pool threads; this module's torch form (the
same words) is the fallback where the kernel cannot be built. torch's own CPU generator fills sequentially,
~70 MB/s here: the 29 GB of Qwen3-30B-A3B's Q8_0 experts took most of a device call to build, and its 61 GB of
bf16 experts did not fit in one.
"""

from __future__ import annotations

import torch

CHUNK_WORDS = 1 << 23  # 64 MiB of words at a time: bounds the temporaries
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64 (torch's integers are signed)
_M1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_M2 = -7723592293110705685  # 0x94D049BB133111EB


def _mix(words: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 (wrapping multiplies; logical shifts through a mask of the sign's spread)."""
    def shr(x: torch.Tensor, n: int) -> torch.Tensor:
        return (x >> n) & ((1 << (64 - n)) - 1)

    words = (words ^ shr(words, 30)) * _M1
    words = (words ^ shr(words, 27)) * _M2
    return words ^ shr(words, 31)


def seed_word(seed: int) -> int:
    """The 64-bit offset a seed adds to every word's counter (seeds 0, 1, 2 … far apart)."""
    return seed * 0x632BE59BD9B4E019 % (1 << 64)


def _words(seed: int, start: int, n: int) -> torch.Tensor:
    index = torch.arange(start, start + n, dtype=torch.int64)
    offset = seed_word(seed)
    return _mix(index * _GOLDEN + (offset - (1 << 64) if offset >= 1 << 63 else offset))


def _kernel():
    from freetoken.kernels.cpu_experts.kernel import CpuExpertKernel

    return CpuExpertKernel.get()


def random_bytes_(t: torch.Tensor, seed: int) -> torch.Tensor:
    """Fills a contiguous CPU tensor's bytes with seeded uniform random bytes; returns it."""
    kernel = _kernel()
    if kernel is not None:
        kernel.random_fill(t, seed_word(seed))
        return t
    flat = t.view(-1).view(torch.uint8)
    whole = flat.numel() // 8
    for start in range(0, whole, CHUNK_WORDS):
        n = min(CHUNK_WORDS, whole - start)
        flat[start * 8:(start + n) * 8].view(torch.int64).copy_(_words(seed, start, n))
    tail = flat.numel() - whole * 8
    if tail:
        flat[whole * 8:].copy_(_words(seed, whole, 1).view(torch.uint8)[:tail])
    return t


def random_uniform_(t: torch.Tensor, bound: float, seed: int) -> torch.Tensor:
    """Fills a contiguous f32/bf16 CPU tensor with seeded values uniform in [-bound, bound); returns it."""
    kernel = _kernel() if t.dtype in (torch.float32, torch.bfloat16) else None
    if kernel is not None:
        kernel.random_fill(t, seed_word(seed), bound)
        return t
    flat = t.view(-1)
    for start in range(0, flat.numel(), CHUNK_WORDS):
        n = min(CHUNK_WORDS, flat.numel() - start)
        top = (_words(seed, start, n) >> 40) & ((1 << 24) - 1)  # 24 random bits a value
        flat[start:start + n].copy_(top.to(torch.float32).mul_(2 * bound / (1 << 24)).sub_(bound))
    return t
