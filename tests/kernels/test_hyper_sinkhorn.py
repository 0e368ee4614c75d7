"""DeepSeek-V4's hyper-connection weights: the Triton kernel against the model's plain-torch `hyper_mix` (under
Triton's interpreter without a GPU, in a fresh interpreter: TRITON_INTERPRET must be set before the kernel is
defined)."""

from __future__ import annotations

import textwrap

import pytest
import torch

pytest.importorskip("triton")

from freetoken.kernels.hyper_sinkhorn.reference import hyper_mix  # noqa: E402
from support.decode_checks import KERNEL_RUNS, run_fresh  # noqa: E402

# V4's 4 streams and 20 rounds; a stream count that is not a power of two (masked lanes); one round only (the
# first normalisations alone); decode's one token and a prefill chunk's several; logits large enough that the
# softmax must subtract its maximum.
CHECK = textwrap.dedent("""
    import sys
    import torch
    from freetoken.kernels.hyper_sinkhorn.kernel import hyper_mix
    from freetoken.kernels.hyper_sinkhorn.reference import hyper_mix as reference

    device = torch.device(sys.argv[1])
    gen = torch.Generator().manual_seed(0)
    for t, n, iters, spread in [(1, 4, 20, 1.0), (7, 4, 20, 30.0), (3, 3, 20, 2.0), (2, 4, 1, 1.0), (0, 4, 20, 1.0)]:
        mixes = torch.randn(t, (2 + n) * n, generator=gen) * spread
        base, scale = torch.randn((2 + n) * n, generator=gen), torch.rand(3, generator=gen) + 0.5
        got = hyper_mix(*(x.to(device) for x in (mixes, base, scale)), n, iters, 1e-6)
        want = reference(mixes, base, scale, n, iters, 1e-6)
        for g, w in zip(got, want):
            assert g.shape == w.shape, (g.shape, w.shape)
            torch.testing.assert_close(g.cpu(), w, atol=1e-6, rtol=1e-5)
    print("ok")
""")


@pytest.mark.parametrize("device, interpret", KERNEL_RUNS)
def test_the_kernel_equals_the_reference(device, interpret):
    run_fresh(CHECK, device, interpret=interpret)


def test_the_reference_makes_comb_doubly_stochastic():
    """Each round ends on the columns, so after 20 every column of the mixing sums to 1 (to the ε the rounds add)
    and every row nearly so; the weights into and out of a block stay in their sigmoid ranges."""
    gen = torch.Generator().manual_seed(1)
    pre, post, comb = hyper_mix(torch.randn(5, 24, generator=gen) * 3, torch.randn(24, generator=gen),
                                torch.ones(3), 4, 20, 1e-6)
    torch.testing.assert_close(comb.sum(dim=-2), torch.ones(5, 4), atol=1e-5, rtol=0)
    torch.testing.assert_close(comb.sum(dim=-1), torch.ones(5, 4), atol=0.1, rtol=0)
    assert (pre > 0).all() and (pre <= 1 + 1e-6).all() and (post > 0).all() and (post < 2).all()
