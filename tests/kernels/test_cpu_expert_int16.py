"""The CPU expert kernel's int16-activation paths (q16.h, q16_avx2.h, q16_rows.h): a bf16 model's Q8_0 and MXFP4
experts against activations quantized per 32-block to int16, one token per expert on 16 or 8 lanes, and Q8_0 at
3-5 tokens 16 rows at a time."""

from __future__ import annotations

import pytest
import torch

from freetoken.kernels.cpu_experts import reference
from support.cpu_kernel import NEVER, block_bf16_from, expert_matrix, random_routing


@pytest.mark.parametrize("fmt", ["Q8_0", "MXFP4"])
@pytest.mark.parametrize("tokens", [1, 2, 5])
@pytest.mark.parametrize("hidden", [96, 544, 2048])
def test_block_formats_against_int16_activations_match_the_float_path(kernel, fmt, tokens, hidden):
    """A bf16 model's Q8_0 or MXFP4 experts below the tile threshold dot int16 activations (per-block power-of-two
    scales, 16 blocks' scales applied at once: f16 for Q8_0, E8M0 for MXFP4, its tiny subnormal scales included):
    equal to the fp32-activation path to fp32 rounding, whatever the row length (a partial group of 16 blocks: 96
    and 544), also with an outlier in one block."""
    gen = torch.Generator().manual_seed(tokens + hidden)
    gate, up = (expert_matrix(fmt, 5, 64, hidden, gen) for _ in range(2))
    down = expert_matrix(fmt, 5, hidden, 64, gen)
    x = torch.randn(tokens, hidden, generator=gen)
    x[0, 37] = 300.0  # its block's other values keep 2^-16 of it as their precision
    x = x.bfloat16().float()
    routing = random_routing(tokens, 5, 2, gen)
    with block_bf16_from(kernel, NEVER):  # experts of 5 tokens on the fp32 path in both runs
        int16 = kernel.moe_forward(x, gate, up, down, *routing, round_to=torch.bfloat16)
        kernel.lib.ft_set_q16(0)
        try:
            float_path = kernel.moe_forward(x, gate, up, down, *routing, round_to=torch.bfloat16)
        finally:
            kernel.lib.ft_set_q16(1)
    want = reference.moe_forward(x, gate, up, down, *routing, round_to=torch.bfloat16)
    assert torch.isfinite(int16).all()
    # bf16 rounding points (projections, silu, products) flip where the two paths land on either side of a tie;
    # MXFP4's codes are coarse (one in eight is zero), so the outlier's own weight can vanish and leave its block's
    # dot to the values its power-of-two scale quantizes coarsest (a 2^-6 step here): up to 5.3e-3 at 96
    assert (int16 - float_path).norm() / float_path.norm() < (5e-3 if fmt == "Q8_0" else 1e-2)
    assert (int16 - want).norm() / want.norm() < 2e-2
    if kernel.q16 and kernel.wants_bf16_activations(gate, up, down, torch.bfloat16) and tokens == 1:
        # one token per expert took the int16 path: the outlier's block quantizes coarser than fp32 does
        assert not torch.equal(int16, float_path)


@pytest.mark.parametrize("fmt", ["Q8_0", "MXFP4"])
@pytest.mark.parametrize("hidden", [544, 2048])
def test_int16_forms_agree_exactly(kernel, fmt, hidden):
    """The int16-activation path's forms (rows one at a time or in interleaved pairs) sum the same integers in the
    same order: bit-identical outputs, a partial group of 16 (or 8) blocks (544) included, on 16 lanes and on 8
    where the build has both. (Where the build has no AVX2 both forms are the fp32 path, trivially equal.)"""
    gen = torch.Generator().manual_seed(hidden)
    gate, up = (expert_matrix(fmt, 5, 96, hidden, gen) for _ in range(2))
    down = expert_matrix(fmt, 5, hidden, 96, gen)
    x = torch.randn(1, hidden, generator=gen).bfloat16().float()
    routing = random_routing(1, 5, 4, gen)  # one token per expert: the int16 path's case (decode)
    before = kernel.lib.ft_set_avx2_dots(1)
    try:
        for eight_lanes in (0, 1) if kernel.q16_sixteen_lanes else (before,):
            kernel.lib.ft_set_avx2_dots(eight_lanes)
            outs = []
            for two_rows in (1, 0):
                kernel.lib.ft_set_q16_form(two_rows)
                outs.append(kernel.moe_forward(x, gate, up, down, *routing, round_to=torch.bfloat16))
            assert torch.equal(outs[0], outs[1])
            assert outs[0].abs().sum() > 0
    finally:
        kernel.lib.ft_set_q16_form(1)
        kernel.lib.ft_set_avx2_dots(before)


@pytest.mark.parametrize("hidden, inter", [(96, 64), (544, 96), (2048, 768)])
@pytest.mark.parametrize("tokens", [2, 3, 4, 5])
def test_int16_rows_at_several_tokens_equal_each_token_alone(kernel, hidden, inter, tokens):
    """A bf16 model's Q8_0 experts at 2-5 tokens each take the int16 path 16 rows at a time (q16_rows.h: block b
    of 16 rows transposed into lanes once, one vpdpwssd per token): the same int16 activations and exact block
    sums as each token alone on the one-token int16 path, scaled and added in another order, so equal but for
    rare bf16 rounding flips (a slip in the transpose would differ everywhere). The switch takes effect (the fp32
    path differs in many places), 4 + 1 tokens split as 3 + 2 included, and the rows' prefetch changes nothing.
    The bf16 dot path, which takes 5+ tokens where no tiles are compiled in (AVX-512-BF16 without AMX: Zen 4), is
    kept off: it would take the 5-token rows."""
    before, before_from = kernel.lib.ft_set_q16_rows(5), kernel.lib.ft_set_q16_rows_from(2)
    if before < 0:
        pytest.skip("built without AVX-512BW: no 16-row int16 path")
    before_bf16 = kernel.lib.ft_set_block_bf16(NEVER)
    gen = torch.Generator().manual_seed(tokens + hidden)
    gate, up = (expert_matrix("Q8_0", 3, inter, hidden, gen) for _ in range(2))
    down = expert_matrix("Q8_0", 3, hidden, inter, gen)
    x = torch.randn(tokens, hidden, generator=gen)
    x[0, 37] = 30.0
    x = x.bfloat16().float()
    experts = torch.tensor([0, 2], dtype=torch.int32)  # both experts take every token
    offsets = torch.tensor([0, tokens, 2 * tokens], dtype=torch.int32)
    pair_tokens = torch.arange(tokens, dtype=torch.int32).repeat(2)
    weights = torch.rand(2 * tokens, generator=gen)
    routed = (experts, offsets, pair_tokens, weights)
    prefetch = kernel.lib.ft_set_q16_rows_prefetch(0)
    try:
        kernel.lib.ft_set_q16_rows_prefetch(prefetch)
        together = kernel.moe_forward(x, gate, up, down, *routed, round_to=torch.bfloat16)
        kernel.lib.ft_set_q16_rows_prefetch(0)
        unprefetched = kernel.moe_forward(x, gate, up, down, *routed, round_to=torch.bfloat16)
        kernel.lib.ft_set_q16_rows(1)
        float_path = kernel.moe_forward(x, gate, up, down, *routed, round_to=torch.bfloat16)
        alone = torch.cat([kernel.moe_forward(x[t:t + 1], gate, up, down, experts,
                                              torch.tensor([0, 1, 2], dtype=torch.int32),
                                              torch.zeros(2, dtype=torch.int32), weights[[t, tokens + t]],
                                              round_to=torch.bfloat16) for t in range(tokens)])
    finally:
        kernel.lib.ft_set_q16_rows(before)
        kernel.lib.ft_set_q16_rows_from(before_from)
        kernel.lib.ft_set_q16_rows_prefetch(prefetch)
        kernel.lib.ft_set_block_bf16(before_bf16)
    assert torch.equal(together, unprefetched)
    assert (together - alone).norm() / alone.norm() < 1e-3
    assert (together != alone).float().mean() < 0.01
    assert not torch.equal(together, float_path)
    want = reference.moe_forward(x, gate, up, down, *routed, round_to=torch.bfloat16)
    assert (together - want).norm() / want.norm() < 2e-2


@pytest.mark.parametrize("fmt", ["Q8_0", "MXFP4"])
@pytest.mark.parametrize("hidden", [96, 544, 2048])
def test_int16_path_on_eight_lanes_matches_sixteen(kernel, fmt, hidden):
    """The int16 path on 8 lanes (q16_avx2.h: the default without AVX-512) against its 16-lane form: the same int16
    activations and exact block sums, scaled and added in another order, so equal to fp32 rounding before the
    bf16 rounding points (a partial group of 8 and of 16 blocks: 96, 544). Also against the fp32 path and the
    reference at fp32 rounding, where the int16 quantization is the only difference (outlier included)."""
    if not kernel.q16_sixteen_lanes:
        pytest.skip("one form only: this build has no AVX-512BW (the other int16 tests check the 8-lane form)")
    gen = torch.Generator().manual_seed(hidden + 1)
    gate, up = (expert_matrix(fmt, 5, 64, hidden, gen) for _ in range(2))
    down = expert_matrix(fmt, 5, hidden, 64, gen)
    x = torch.randn(1, hidden, generator=gen)
    x[0, 37] = 300.0
    x = x.bfloat16().float()
    routing = random_routing(1, 5, 3, gen)
    want = reference.moe_forward(x, gate, up, down, *routing, round_to=torch.bfloat16)
    before = kernel.lib.ft_set_avx2_dots(0)
    outs = []
    try:
        for eight_lanes in (0, 1):
            kernel.lib.ft_set_avx2_dots(eight_lanes)
            outs.append(kernel.moe_forward(x, gate, up, down, *routing, round_to=torch.bfloat16))
    finally:
        kernel.lib.ft_set_avx2_dots(before)
    sixteen, eight = outs
    assert torch.isfinite(eight).all()
    # the forms differ by fp32 rounding of the scaled block sums; bf16 rounding points may flip on ties
    assert (eight - sixteen).norm() / sixteen.norm() < 2e-3
    assert (eight - want).norm() / want.norm() < 2e-2
