"""Dashboard fixtures: a real server over a tiny random MoE model with offloaded experts (its cache far below the
pool, so every step misses and the traffic panels have something to show)."""

from __future__ import annotations

import pytest
import torch

from support.checkpoints import PARITY_CASES, write_hf_checkpoint


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_moe")
    write_hf_checkpoint(path=path, **PARITY_CASES["qwen3_moe"])
    return path


def offloaded(tiny_moe, slots: int = 3):
    from freetoken.engine.loader import load_model

    probe = load_model(tiny_moe, progress=False)
    return load_model(tiny_moe, progress=False, expert_cache=slots * probe.moe_spec.bytes_per_expert(torch.float32))
