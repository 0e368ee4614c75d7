"""DeepSeek-V3 (`deepseek_v3`) specifics: what its latent cache holds, and YaRN in DeepSeek's own spelling (the
family's parity with transformers is in test_grouped_routing.py)."""

from __future__ import annotations

import math

import pytest
import torch

from freetoken.engine.loader import load_model
from support.checkpoints import hf_logits, prompt_ids, write_hf_checkpoint


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek_v3")
    write_hf_checkpoint("deepseek_v3", path)
    return load_model(path, device="cpu", dtype=torch.float32, progress=False)


def test_the_cache_holds_the_latent_not_per_head_keys(lm):
    """One KV "head" per layer of kv_lora_rank + rotary width: 40 numbers a token here (32 + 8), where
    expanded keys and values would take 4 heads × (24 + 12)."""
    a = lm.args.decoder.attention
    assert (a.n_kv_heads, a.head_dim) == (1, 40)
    cache = lm.new_cache(page_size=4, initial_tokens=8)
    assert cache.k[0].shape[1:] == (1, 40)


def test_yarn_scaled_checkpoints_match_transformers(tmp_path):
    """DeepSeek-V3 ships YaRN with mscale_all_dim: interpolated frequencies and a softmax scale grown by mscale²
    (1.87× at factor 40)."""
    reference = write_hf_checkpoint("deepseek_v3", tmp_path, rope="yarn")
    lm = load_model(tmp_path, device="cpu", dtype=torch.float32, progress=False)
    assert lm.args.latent.softmax_scale == pytest.approx((16 + 8) ** -0.5 * (0.1 * math.log(40) + 1) ** 2)
    ids = prompt_ids()
    torch.testing.assert_close(lm.prefill_logits(ids), hf_logits(reference, ids), atol=1e-4, rtol=0)
