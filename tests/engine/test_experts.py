"""The batched expert paths (padded groups for short chunks, sorted grouped matmuls for any chunk) compute what
one-expert-at-a-time does."""

from __future__ import annotations

import pytest
import torch

from freetoken.engine.experts import (
    ExpertForm,
    LayerExperts,
    gathered_expert_forward,
    group_by_expert,
    grouped_expert_forward,
    run_groups,
    run_groups_padded,
    sorted_expert_forward,
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 37, 300])
@pytest.mark.parametrize("groups_per_call", [1023, 3])
@pytest.mark.parametrize("host_counts", [False, True])
def test_sorted_grouped_matmuls_equal_one_expert_at_a_time(dtype, tokens, groups_per_call, host_counts, monkeypatch):
    """What the resident executor runs for chunks on Hopper (torch._grouped_mm), checked on the CPU's fallback:
    uneven and empty groups, ids naming slots of a larger stack, a chunk cut into several sorted passes, and
    (3 groups per call) a stack of more rows than one grouped call takes (an executor's 1,820 slots on the H200
    against torch's 1,023), in windows, the last one unused. `host_counts`: the pairs per row given by the caller
    (the offloaded prefill knows them), so the windows are cut without a sync."""
    from freetoken.engine import experts as module

    monkeypatch.setattr(module, "GROUPED_MM_TOKENS", 128)  # 300 tokens: three passes
    monkeypatch.setattr(module, "GROUPED_MM_GROUPS", groups_per_call)
    gen = torch.Generator().manual_seed(tokens)
    stacks = LayerExperts(*(torch.randn(shape, generator=gen).to(dtype) * 0.1
                            for shape in ((10, 32, 16), (10, 32, 16), (10, 16, 32))))
    hidden = torch.randn(tokens, 16, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(7, generator=gen)[:3] for _ in range(tokens)])  # rows 7-9 never used
    weights = torch.rand(tokens, 3, generator=gen)
    want = run_groups(hidden, group_by_expert(ids, weights, 10, dtype), stacks.weights_of)
    row_pairs = torch.bincount(ids.reshape(-1), minlength=10).tolist() if host_counts else None
    got = sorted_expert_forward(stacks, hidden, ids, weights, row_pairs=row_pairs)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    if host_counts and groups_per_call == 3 and tokens <= module.GROUPED_MM_TOKENS:  # the counts are what cuts
        shifted = [*row_pairs[:2], row_pairs[2] + 1, row_pairs[3] - 1, *row_pairs[4:]]  # across a window's end
        assert not torch.allclose(sorted_expert_forward(stacks, hidden, ids, weights, row_pairs=shifted), want,
                                  atol=tol, rtol=tol)


@pytest.mark.parametrize("path", ["padded", "sorted", "gathered"])
def test_every_batched_path_applies_the_expert_form(path):
    """gpt-oss's experts (biases by expert id, clamped SwiGLU) on the batched paths, whose stacks are indexed by
    slot while the biases are indexed by expert: each equals one expert at a time."""
    gen = torch.Generator().manual_seed(2)
    e, h, i = 6, 16, 24
    form = ExpertForm(*(torch.randn(shape, generator=gen) for shape in ((e, i), (e, i), (e, h))), clamped=True,
                      limit=0.9)
    experts = LayerExperts(*(torch.randn(shape, generator=gen) * 0.3 for shape in ((e, i, h), (e, i, h), (e, h, i))),
                           form=form)
    hidden = torch.randn(11, h, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:2] for _ in range(11)])
    weights = torch.rand(11, 2, generator=gen)
    want = run_groups(hidden, group_by_expert(ids, weights, e, hidden.dtype), experts.weights_of, form)
    plain = run_groups(hidden, group_by_expert(ids, weights, e, hidden.dtype), experts.weights_of)
    slots = LayerExperts(*(torch.flip(w, dims=[0]) for w in (experts.gate_proj, experts.up_proj, experts.down_proj)))
    slot_ids = e - 1 - ids  # the same experts at other stack rows, as in an expert cache
    if path == "padded":
        got = torch.zeros_like(hidden)
        groups = group_by_expert(ids, weights, e, hidden.dtype)
        run_groups_padded(hidden, groups, slots, [e - 1 - g.expert for g in groups], got, form)
    elif path == "sorted":
        got = sorted_expert_forward(slots, hidden, slot_ids, weights, form, ids)
    else:
        got = gathered_expert_forward(slots, hidden, slot_ids, weights, form, ids)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (plain - want).abs().max() > 0.1
