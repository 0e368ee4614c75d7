"""The CPU expert kernel's AMX tile paths, bf16 tiles and Q8_0 on int8 tiles, against the reference: on real tiles
where the CPU has AMX, and on tiles emulated in C on any AVX-512 machine (bf16: AVX-512-BF16)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from freetoken.kernels.cpu_experts import build, reference
from freetoken.kernels.cpu_experts.kernel import CpuExpertKernel
from support.cpu_kernel import expert_matrix, without_q16_rows


@pytest.fixture(scope="module")
def emulated_kernel(tmp_path_factory):
    """The kernel built over AMX tiles emulated in C (FT_AMX_EMULATE, kernels/cpu_experts/tiles.h), so the tile
    paths' layouts are tested on machines without AMX."""
    lib = build.load(tmp_path_factory.mktemp("emulated-amx"), emulate_amx=True)
    if lib is None:
        pytest.fail("the CPU expert kernel did not build: CI machines have a C compiler")
    return CpuExpertKernel(lib, 2)


@pytest.fixture
def emulated_tiles(emulated_kernel):
    """The emulated build, for the int8 tile path."""
    if not emulated_kernel.amx_q8:
        pytest.skip("no AVX-512BW: the int8 tile path needs it, emulated or not")
    return emulated_kernel


@pytest.fixture(params=["native", "emulated"])
def tiles(request):
    """A kernel whose bf16 experts run on AMX tiles: the CPU's own (skipped without AMX) or tiles emulated in C
    (skipped without AVX-512-BF16, which the bf16 tile path needs for its conversions, emulated or not)."""
    kernel = request.getfixturevalue("kernel" if request.param == "native" else "emulated_kernel")
    if not kernel.amx:
        pytest.skip("no AMX on this CPU" if request.param == "native" else "no AVX-512-BF16 on this CPU")
    return kernel


@pytest.mark.parametrize("tokens", [2, 7, 16, 17, 40])
def test_amx_tiles_match_the_reference(tiles, tokens):
    """Where the CPU has AMX (Sapphire Rapids and later), a bf16 model's experts from 2 tokens on run on tiles
    (several token tiles per expert above 16, experts with different tile counts in one call); the result must
    equal the reference's as closely as the AVX-512 path does."""
    kernel = tiles
    gen = torch.Generator().manual_seed(tokens)
    gate, up = (expert_matrix("BF16", 4, 64, 96, gen) for _ in range(2))
    down = expert_matrix("BF16", 4, 96, 64, gen)
    x = torch.randn(tokens, 96, generator=gen).bfloat16().float()
    every, some = list(range(tokens)), list(range(0, tokens, 3))  # expert 3 takes every third token
    routing = (torch.tensor([1, 3], dtype=torch.int32),
               torch.tensor([0, tokens, tokens + len(some)], dtype=torch.int32),
               torch.tensor(every + some, dtype=torch.int32), torch.rand(tokens + len(some), generator=gen))
    want = reference.moe_forward(x, gate, up, down, *routing, round_to=torch.bfloat16)
    on_tiles = kernel.moe_forward(x, gate, up, down, *routing, round_to=torch.bfloat16)
    kernel.lib.ft_set_amx(2, 6, 1)
    try:
        vectors = kernel.moe_forward(x, gate, up, down, *routing, round_to=torch.bfloat16)
    finally:
        kernel.lib.ft_set_amx(2, 6, 0)
    assert torch.isfinite(on_tiles).all()
    assert (on_tiles - want).norm() / want.norm() < 2e-3 and (vectors - want).norm() / want.norm() < 2e-3


def test_the_dequantization_prefetch_changes_no_result(tiles):
    """ft_set_amx_dequant_prefetch (software prefetch while Q8_0 rows are dequantized for the tiles, 4 KiB ahead
    by default) reads further ahead only: the tiles' result is the same bit for bit at any distance, none too."""
    kernel = tiles
    gen = torch.Generator().manual_seed(8)
    gate, up = (expert_matrix("Q8_0", 3, 64, 256, gen) for _ in range(2))
    down = expert_matrix("Q8_0", 3, 256, 64, gen)
    x = torch.randn(8, 256, generator=gen).bfloat16().float()
    routing = (torch.tensor([0, 2], dtype=torch.int32), torch.tensor([0, 8, 16], dtype=torch.int32),
               torch.arange(8, dtype=torch.int32).repeat(2), torch.rand(16, generator=gen))
    ahead = kernel.moe_forward(x, gate, up, down, *routing, round_to=torch.bfloat16)
    default = kernel.lib.ft_set_amx_dequant_prefetch(0)
    try:
        none = kernel.moe_forward(x, gate, up, down, *routing, round_to=torch.bfloat16)
        assert kernel.lib.ft_set_amx_dequant_prefetch(1024) == 0
        near = kernel.moe_forward(x, gate, up, down, *routing, round_to=torch.bfloat16)
    finally:
        assert kernel.lib.ft_set_amx_dequant_prefetch(default) == 1024
    assert default == 4096 and torch.equal(none, ahead) and torch.equal(near, ahead)


def test_dequantizing_as_interleaved_runs_of_rows_changes_no_result(tiles):
    """ft_set_amx_dequant_streams: a 16-row block of Q8_0 rows dequantized for the tiles as 1, 2, 4 (default), 8 or
    16 interleaved runs of rows: the same bf16 rows whatever the order, so the same bits; other values change
    nothing."""
    kernel = tiles
    gen = torch.Generator().manual_seed(12)
    gate, up = (expert_matrix("Q8_0", 3, 64, 256, gen) for _ in range(2))
    down = expert_matrix("Q8_0", 3, 256, 64, gen)
    x = torch.randn(40, 256, generator=gen).bfloat16().float()
    counts = [8, 20, 40]
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    routing = (torch.arange(3, dtype=torch.int32), offsets,
               torch.cat([torch.randperm(40, generator=gen)[:n].sort().values for n in counts]).int(),
               torch.rand(sum(counts), generator=gen))
    default = kernel.moe_forward(x, gate, up, down, *routing, round_to=torch.bfloat16)
    runs = {}
    try:
        for streams, kept in ((1, 1), (2, 2), (8, 8), (16, 16), (3, 16), (0, 16), (32, 16)):
            kernel.lib.ft_set_amx_dequant_streams(streams)
            assert kernel.lib.ft_set_amx_dequant_streams(streams) == kept
            runs[streams] = kernel.moe_forward(x, gate, up, down, *routing, round_to=torch.bfloat16)
    finally:
        assert kernel.lib.ft_set_amx_dequant_streams(4) == 16
    want = reference.moe_forward(x, gate, up, down, *routing, round_to=torch.bfloat16)
    assert all(torch.equal(got, default) for got in runs.values())
    assert (default - want).norm() / want.norm() < 2e-2


def test_amx_tiles_cover_long_calls(tiles):
    """A prefill-sized call on tiles: an expert with 17 token tiles (272 tokens) beside 35 experts of 5-6 tokens
    (each down task walks 52 token tiles); the result equals the reference's as the short calls' do."""
    kernel = tiles
    gen = torch.Generator().manual_seed(5)
    experts, tokens = 36, 272
    gate, up = (expert_matrix("BF16", experts, 32, 64, gen) for _ in range(2))
    down = expert_matrix("BF16", experts, 64, 32, gen)
    x = torch.randn(tokens, 64, generator=gen).bfloat16().float()
    pairs = [list(range(tokens))] + [list(range(e, tokens, 50)) for e in range(1, experts)]
    offsets = [0]
    for p in pairs:
        offsets.append(offsets[-1] + len(p))
    routing = (torch.arange(experts, dtype=torch.int32), torch.tensor(offsets, dtype=torch.int32),
               torch.tensor([t for p in pairs for t in p], dtype=torch.int32), torch.rand(offsets[-1], generator=gen))
    want = reference.moe_forward(x, gate, up, down, *routing, round_to=torch.bfloat16)
    got = kernel.moe_forward(x, gate, up, down, *routing, round_to=torch.bfloat16)
    assert torch.isfinite(got).all()
    assert (got - want).norm() / want.norm() < 2e-3


@pytest.mark.parametrize("fmt", ["BF16", "Q8_0"])
def test_token_tiles_in_pairs_change_no_result(tiles, fmt):
    """ft_set_amx_tile_pairs: two token tiles a pass (on by default) load each weight tile once for both; every
    (row, token) sum still adds the same products in the same order, so the result equals one tile a pass bit for
    bit (experts of 1, 2, 3 and 5 token tiles, so pairs and a last single tile meet in one call)."""
    kernel = tiles
    gen = torch.Generator().manual_seed(11)
    gate, up = (expert_matrix(fmt, 4, 64, 96, gen) for _ in range(2))
    down = expert_matrix(fmt, 4, 96, 64, gen)
    x = torch.randn(80, 96, generator=gen).bfloat16().float()
    counts = [9, 32, 40, 80]
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    routing = (torch.arange(4, dtype=torch.int32), offsets,
               torch.cat([torch.randperm(80, generator=gen)[:n].sort().values for n in counts]).int(),
               torch.rand(sum(counts), generator=gen))
    paired = kernel.moe_forward(x, gate, up, down, *routing, round_to=torch.bfloat16)
    assert kernel.lib.ft_set_amx_tile_pairs(0) == 1
    try:
        single = kernel.moe_forward(x, gate, up, down, *routing, round_to=torch.bfloat16)
    finally:
        kernel.lib.ft_set_amx_tile_pairs(1)
    want = reference.moe_forward(x, gate, up, down, *routing, round_to=torch.bfloat16)
    assert torch.equal(paired, single) and (paired - want).norm() / want.norm() < 2e-2




@contextlib.contextmanager
def int8_tiles(kernel):
    """Q8_0 experts at 2-32 tokens per expert on int8 tiles (off by default: slower where measured)."""
    kernel.lib.ft_set_amx_q8(2, 32)
    try:
        yield
    finally:
        kernel.lib.ft_set_amx_q8(2, 0)


def _q8_tile_case(tokens: int, hidden: int):
    """Q8_0 experts of a bf16 model, two experts with different token counts (one every token, one every third),
    an outlier in x."""
    gen = torch.Generator().manual_seed(tokens * 1000 + hidden)
    gate, up = (expert_matrix("Q8_0", 4, 64, hidden, gen) for _ in range(2))
    down = expert_matrix("Q8_0", 4, hidden, 64, gen)
    x = torch.randn(tokens, hidden, generator=gen)
    x[0, 37] = 300.0
    x = x.bfloat16().float()
    every, some = list(range(tokens)), list(range(0, tokens, 3))
    routing = (torch.tensor([1, 3], dtype=torch.int32),
               torch.tensor([0, tokens, tokens + len(some)], dtype=torch.int32),
               torch.tensor(every + some, dtype=torch.int32), torch.rand(tokens + len(some), generator=gen))
    return x, gate, up, down, routing


@pytest.mark.parametrize("tiles", ["emulated", "native"])
@pytest.mark.parametrize("tokens", [2, 5, 16, 17, 32])
@pytest.mark.parametrize("hidden", [96, 544])
def test_q8_0_on_int8_tiles_matches_the_reference(request, tiles, tokens, hidden):
    """A bf16 model's Q8_0 experts at 2-32 tokens per expert run on int8 tiles straight from their blocks (int16
    activations split into a signed high and an unsigned low byte; an odd number of blocks, 17, included, and two
    token tiles from 17 tokens): equal to the reference to the bf16 rounding points' flips, and not the other
    paths' result (the tiles really ran)."""
    kernel = request.getfixturevalue("emulated_tiles" if tiles == "emulated" else "kernel")
    if tiles == "native" and kernel.amx_q8 != 1:
        pytest.skip("no AMX int8 tiles on this CPU")
    x, gate, up, down, routing = _q8_tile_case(tokens, hidden)
    want = reference.moe_forward(x, gate, up, down, *routing, round_to=torch.bfloat16)
    with int8_tiles(kernel):
        got = kernel.moe_forward(x, gate, up, down, *routing, round_to=torch.bfloat16)
    with without_q16_rows(kernel):  # (at 2-5 tokens the 16-row int16 path sums the same integers as the tiles)
        other = kernel.moe_forward(x, gate, up, down, *routing, round_to=torch.bfloat16)
    assert torch.isfinite(got).all()
    assert (got - want).norm() / want.norm() < 5e-3
    assert not torch.equal(got, other)


@pytest.mark.parametrize("tiles", ["emulated", "native"])
def test_int8_tiles_sum_the_same_16_or_32_rows_a_pass(request, tiles):
    """One pass of the int8 tiles takes 16 weight rows or 32 (two A tiles against the same activations): each row
    gets the same block sums in the same order, so the same bits."""
    kernel = request.getfixturevalue("emulated_tiles" if tiles == "emulated" else "kernel")
    if tiles == "native" and kernel.amx_q8 != 1:
        pytest.skip("no AMX int8 tiles on this CPU")
    x, gate, up, down, routing = _q8_tile_case(17, 544)
    outs = []
    with int8_tiles(kernel):
        try:
            for rows in (16, 32):
                kernel.lib.ft_set_amx_q8_rows(rows)
                outs.append(kernel.moe_forward(x, gate, up, down, *routing, round_to=torch.bfloat16))
        finally:
            kernel.lib.ft_set_amx_q8_rows(16)
    assert torch.equal(outs[0], outs[1])
    assert outs[0].abs().sum() > 0


def test_emulated_int8_tiles_compute_what_real_ones_do(kernel, emulated_tiles):
    """Where the CPU has AMX, the emulation (what the tests without AMX check) gives the very bits the real tiles
    give: the same integer block sums, then the same vector code."""
    if kernel.amx_q8 != 1:
        pytest.skip("no AMX int8 tiles on this CPU")
    x, gate, up, down, routing = _q8_tile_case(17, 544)
    with int8_tiles(kernel), int8_tiles(emulated_tiles):
        real = kernel.moe_forward(x, gate, up, down, *routing, round_to=torch.bfloat16)
        emulated = emulated_tiles.moe_forward(x, gate, up, down, *routing, round_to=torch.bfloat16)
    assert torch.equal(emulated, real)
