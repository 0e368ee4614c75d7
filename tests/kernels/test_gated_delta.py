"""The gated delta rule's Triton kernel against its plain-torch reference (under Triton's interpreter without a
GPU: TRITON_INTERPRET=1 must be set before the kernel is defined, so the check runs in a fresh interpreter)."""

from __future__ import annotations

import textwrap

import pytest

pytest.importorskip("triton")

from support.decode_checks import KERNEL_RUNS, run_fresh  # noqa: E402

# Head dims that are and are not powers of two (masked lanes), several value blocks, 1 and 5 tokens, a state
# that must be left as it was.
CHECK = textwrap.dedent("""
    import sys
    import torch
    from freetoken.kernels.gated_delta.kernel import recurrent_gated_delta
    from freetoken.kernels.gated_delta.reference import recurrent_gated_delta as reference

    device = torch.device(sys.argv[1])
    gen = torch.Generator().manual_seed(0)
    for t, heads, dk, dv in [(1, 4, 16, 8), (5, 3, 24, 80), (1, 2, 128, 128), (3, 1, 8, 130)]:
        q = torch.nn.functional.normalize(torch.randn(t, heads, dk, generator=gen), dim=-1) * dk ** -0.5
        k = torch.nn.functional.normalize(torch.randn(t, heads, dk, generator=gen), dim=-1)
        v = torch.randn(t, heads, dv, generator=gen)
        g, beta = -torch.rand(t, heads, generator=gen) * 2, torch.rand(t, heads, generator=gen)
        state = torch.randn(heads, dk, dv, generator=gen)
        args = [x.to(device) for x in (q, k, v, g, beta, state)]
        before = args[-1].clone()
        out, new_state = recurrent_gated_delta(*args)
        want, want_state = reference(q, k, v, g, beta, state)
        torch.testing.assert_close(out.cpu(), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(new_state.cpu(), want_state, atol=1e-5, rtol=1e-5)
        assert torch.equal(args[-1], before)
    print("ok")
""")


# The chunk loop: head dims that are and are not powers of two, a value dim wider than one block, several chunks,
# through the whole chunked rule (the kernel as its `carry`).
CARRY_CHECK = textwrap.dedent("""
    import sys
    import torch
    from freetoken.kernels.gated_delta.kernel import carry_state
    from freetoken.kernels.gated_delta.reference import chunked_gated_delta

    device = torch.device(sys.argv[1])
    gen = torch.Generator().manual_seed(1)
    for t, heads, dk, dv, chunk in [(40, 2, 16, 8, 16), (70, 3, 24, 80, 32), (16, 1, 32, 16, 16)]:
        q = torch.nn.functional.normalize(torch.randn(t, heads, dk, generator=gen), dim=-1) * dk ** -0.5
        k = torch.nn.functional.normalize(torch.randn(t, heads, dk, generator=gen), dim=-1)
        v = torch.randn(t, heads, dv, generator=gen)
        g, beta = -torch.rand(t, heads, generator=gen) * 2, torch.rand(t, heads, generator=gen)
        state = torch.randn(heads, dk, dv, generator=gen)
        args = [x.to(device) for x in (q, k, v, g, beta, state)]
        out, new_state = chunked_gated_delta(*args, chunk=chunk, carry=carry_state)
        want, want_state = chunked_gated_delta(q, k, v, g, beta, state, chunk=chunk)
        torch.testing.assert_close(out.cpu(), want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(new_state.cpu(), want_state, atol=1e-4, rtol=1e-4)
    print("ok")
""")


@pytest.mark.parametrize("device, interpret", KERNEL_RUNS)
def test_the_chunk_loop_kernel_equals_the_reference(device, interpret):
    run_fresh(CARRY_CHECK, device, interpret=interpret)


@pytest.mark.parametrize("device, interpret", KERNEL_RUNS)
def test_the_recurrent_kernel_equals_the_reference(device, interpret):
    run_fresh(CHECK, device, interpret=interpret)
