"""Fixtures of the kernel tests."""

from __future__ import annotations

import pytest

from freetoken.kernels.cpu_experts.kernel import CpuExpertKernel


@pytest.fixture(scope="module")
def kernel():
    """The CPU expert kernel, built for this machine (a build failure fails the test: CI has a C compiler)."""
    k = CpuExpertKernel.get()
    if k is None:
        pytest.fail("the CPU expert kernel did not build: CI machines have a C compiler")
    return k
