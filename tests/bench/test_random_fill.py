"""The hashed random fills of synthetic models: the same bytes for the same seed whatever the chunking, other
bytes for another seed, uniform bytes and uniform values of the asked bound."""

from __future__ import annotations

import torch

from freetoken.bench import random_fill


def test_bytes_are_seeded_uniform_and_independent_of_chunking(monkeypatch):
    a = random_fill.random_bytes_(torch.empty(1_000_003, dtype=torch.uint8), seed=5)
    monkeypatch.setattr(random_fill, "CHUNK_WORDS", 1000)  # other chunk boundaries
    b = random_fill.random_bytes_(torch.empty(1_000_003, dtype=torch.uint8), seed=5)
    c = random_fill.random_bytes_(torch.empty(1_000_003, dtype=torch.uint8), seed=6)
    assert torch.equal(a, b) and (a != c).float().mean() > 0.99
    counts = torch.bincount(a.long(), minlength=256).float()
    assert (counts / counts.mean() - 1).abs().max() < 0.06  # every byte value ≈ 1/256 (≈ 3,900 each)
    bits = torch.stack([(a >> i) & 1 for i in range(8)]).float().mean(dim=1)
    assert ((bits - 0.5).abs() < 0.005).all()  # no stuck bit in any byte position
    words = a[:800_000].view(torch.int64)
    assert abs(torch.corrcoef(torch.stack([(words[:-1] >> 40).double(), (words[1:] >> 40).double()]))[0, 1]) < 0.01


def test_uniform_values_have_the_bound_and_the_seed():
    t = random_fill.random_uniform_(torch.empty(500_000, dtype=torch.bfloat16), bound=0.5, seed=1)
    f = t.float()
    assert f.min() >= -0.5 and f.max() <= 0.5
    assert abs(f.mean()) < 0.003 and abs(f.std() - 0.5 / 3 ** 0.5) < 0.003
    again = random_fill.random_uniform_(torch.empty(500_000, dtype=torch.bfloat16), bound=0.5, seed=1)
    assert torch.equal(t, again)


def test_the_kernel_fills_the_same_bytes_as_the_torch_form(monkeypatch):
    from freetoken.kernels.cpu_experts.kernel import CpuExpertKernel

    if CpuExpertKernel.get() is None:
        import pytest

        pytest.skip("no C compiler: the torch form is the only one")
    fast = random_fill.random_bytes_(torch.empty(100_005, dtype=torch.uint8), seed=9)
    fast_values = random_fill.random_uniform_(torch.empty(10_001, dtype=torch.bfloat16), bound=0.1, seed=9)
    monkeypatch.setattr(random_fill, "_kernel", lambda: None)
    assert torch.equal(fast, random_fill.random_bytes_(torch.empty(100_005, dtype=torch.uint8), seed=9))
    slow_values = random_fill.random_uniform_(torch.empty(10_001, dtype=torch.bfloat16), bound=0.1, seed=9)
    assert (fast_values.float() - slow_values.float()).abs().max() <= 0.1 / 128  # at most a bf16 ulp apart
