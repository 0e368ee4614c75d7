"""The paged split-KV decode attention kernel (Triton) against its plain-torch reference.

Without a GPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1 must be set before the kernel is
defined, so the check runs in a fresh interpreter); with one it also runs compiled.
"""

from __future__ import annotations

import textwrap

import pytest

pytest.importorskip("triton")

from freetoken.kernels.paged_decode.kernel import BLOCK_N, split_keys, splits_for, supports  # noqa: E402
from support.decode_checks import KERNEL_RUNS, run_fresh  # noqa: E402

# Grouped-query layouts (8, 1 and 3 query heads per KV head), bf16 and fp32, windows with several splits, one
# whose later splits lie wholly past the valid length, slots in random order, garbage in the slots past it, and
# a second position through the same buffers (what a captured graph's replay does).
CHECK = textwrap.dedent("""
    import sys
    import torch
    from freetoken.kernels.paged_decode.kernel import PagedDecodeAttention
    from freetoken.kernels.paged_decode.reference import paged_decode_attention

    device = torch.device(sys.argv[1])
    gen = torch.Generator().manual_seed(0)
    cases = [(32, 4, 128, 300, 250, torch.bfloat16), (32, 4, 128, 600, 100, torch.bfloat16),
             (8, 8, 16, 130, 1, torch.float32), (12, 4, 32, 520, 519, torch.float32),
             (16, 4, 64, 4096, 70, torch.float32),  # a window far past the valid keys (one graph for all lengths)
             (16, 4, 64, 8192, 5000, torch.float32)]  # 40 of 45 splits with keys: the merge loads 32 at a time
    for i, (heads, kv, d, window, n, dtype) in enumerate(cases):
        pool = 2 * window + 7
        k = torch.randn(pool, kv, d, generator=gen).to(dtype).to(device)
        v = torch.randn(pool, kv, d, generator=gen).to(dtype).to(device)
        slots = torch.randperm(pool, generator=gen)[:window].to(device)
        q = torch.randn(1, heads, d, generator=gen).to(dtype).to(device)
        k[slots[n:]] = 1e4  # keys past the valid length must not leak in
        block_n = (64, 32, 128)[i % 3]  # the default and the sweep's other step sizes
        programs = 4 * 45 if i == 5 else 12
        attn = PagedDecodeAttention(window, heads, kv, d, device, dtype, programs=programs, block_n=block_n)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        for position in (n - 1, n // 2):
            pos = torch.tensor([position], device=device)
            attn.out.fill_(float("nan"))  # every output element must be written
            got = attn(q, k, v, slots, pos).float()
            want = paged_decode_attention(q, k, v, slots, pos).float()
            err = ((got - want).norm() / want.norm()).item()
            assert err < tol, (heads, kv, d, window, position, dtype, block_n, err)
    # a batch: rows of their own slot tables and positions (one of them a single valid key), one launch
    heads, kv, d, window, dtype = 16, 4, 64, 200, torch.float32
    pool, batch = 3 * window, 3
    k = torch.randn(pool, kv, d, generator=gen).to(device)
    v = torch.randn(pool, kv, d, generator=gen).to(device)
    slots = torch.stack([torch.randperm(pool, generator=gen)[:window] for _ in range(batch)]).to(device)
    q = torch.randn(batch, heads, d, generator=gen).to(device)
    attn = PagedDecodeAttention(window, heads, kv, d, device, dtype, programs=12, batch=batch)
    for positions in ([199, 0, 57], [10, 120, 199]):
        pos = torch.tensor(positions, device=device)
        attn.out.fill_(float("nan"))
        got, want = attn(q, k, v, slots, pos).float(), paged_decode_attention(q, k, v, slots, pos).float()
        assert ((got - want).norm() / want.norm()).item() < 1e-4, positions
        for i in range(batch):  # each row equals that row alone
            alone = paged_decode_attention(q[i:i + 1], k, v, slots[i], pos[i:i + 1]).float()
            assert ((got[i:i + 1] - alone).norm() / alone.norm()).item() < 1e-4, (positions, i)
    print("ok")
""")


@pytest.mark.parametrize("device, interpret", KERNEL_RUNS)
def test_the_kernel_matches_the_reference(device, interpret):
    run_fresh(CHECK, device, interpret=interpret)


def test_splits_cover_the_valid_keys_in_whole_blocks():
    for window in (1, 63, 64, 1000, 16416, 32768):
        splits = splits_for(window, kv_heads=4, programs=264)
        assert 1 <= splits * 4 <= 264 and (splits - 1) * BLOCK_N < window
        for valid in {1, 64, 65, window // 3 + 1, window}:
            per_split, blocks = split_keys(valid, splits), -(-valid // BLOCK_N)
            # every valid key in some split, each split at most one block over an even share
            assert per_split % BLOCK_N == 0 and splits * per_split >= valid
            assert (per_split // BLOCK_N - 1) * splits < blocks


def test_supported_shapes():
    assert supports(32, 4, 128) and supports(8, 8, 16)
    assert not supports(32, 5, 128) and not supports(8, 8, 8) and not supports(8, 8, 96)
