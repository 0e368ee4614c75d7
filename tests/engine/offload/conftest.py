"""Fixtures of the offloaded-executor tests."""

from __future__ import annotations

import pytest

from support.offload_cases import MOE_FAMILIES, family_checkpoint


@pytest.fixture(scope="session", params=MOE_FAMILIES)
def checkpoint(request, tmp_path_factory):
    """(path, resident model, resident greedy tokens) of each MoE family's tiny checkpoint, written once."""
    return family_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
