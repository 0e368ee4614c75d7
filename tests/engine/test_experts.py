"""The padded batched expert path (short prefill chunks) computes what one-expert-at-a-time does."""

from __future__ import annotations

import pytest
import torch

from freetoken.engine.experts import (
    LayerExperts,
    group_by_expert,
    grouped_expert_forward,
    run_groups,
    run_groups_padded,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_groups_equal_one_expert_at_a_time(dtype):
    gen = torch.Generator().manual_seed(0)
    experts = LayerExperts(*(torch.randn(shape, generator=gen).to(dtype) * 0.1
                             for shape in ((6, 24, 16), (6, 24, 16), (6, 16, 24))))
    hidden = torch.randn(13, 16, generator=gen).to(dtype)
    ids = torch.randint(0, 6, (13, 2), generator=gen)
    ids[:, 1] = (ids[:, 0] + 1 + torch.randint(0, 5, (13,), generator=gen)) % 6  # two distinct experts per token
    weights = torch.rand(13, 2, generator=gen)
    groups = group_by_expert(ids, weights, 6, dtype)
    assert len({len(g.tokens) for g in groups}) > 1  # uneven: the padding is exercised
    want = run_groups(hidden, groups, experts.weights_of)
    # the experts' weights at other slot numbers (as in an expert cache), computed in two padded groups
    slots = LayerExperts(*(torch.flip(w, dims=[0]) for w in (experts.gate_proj, experts.up_proj, experts.down_proj)))
    got = torch.zeros_like(hidden)
    half = len(groups) // 2
    for part in (groups[:half], groups[half:]):
        run_groups_padded(hidden, part, slots, [5 - g.expert for g in part], got)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_grouped_forward_padded_equals_unpadded():
    """What the resident executor runs for batched decode on CUDA (`padded=True`), checked on the CPU."""
    gen = torch.Generator().manual_seed(1)
    experts = LayerExperts(*(torch.randn(shape, generator=gen) * 0.1 for shape in ((8, 24, 16), (8, 24, 16),
                                                                                    (8, 16, 24))))
    hidden = torch.randn(9, 16, generator=gen)
    ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(9)])
    weights = torch.rand(9, 2, generator=gen)
    torch.testing.assert_close(grouped_expert_forward(experts, hidden, ids, weights, padded=True),
                               grouped_expert_forward(experts, hidden, ids, weights), atol=1e-5, rtol=1e-5)
