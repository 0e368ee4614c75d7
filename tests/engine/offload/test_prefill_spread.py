"""GPU path "prefill-spread": a prefill chunk, which evicts nothing, fills the free expert-cache slots and block-store
rows up to an even share per layer instead of in layer order, so that no later turn finds its first layers all
cached (the link idle) and its last ones all missing (bound by the link)."""

from __future__ import annotations

import pytest
import torch

from freetoken.engine.loader import load_model
from freetoken.engine.offload import prefill
from freetoken.engine.offload.expert_cache import ExpertCache
from freetoken.engine.offload.policy import make_policy
from support.checkpoints import PARITY_CASES, write_gguf_from_hf, write_hf_checkpoint

DEEPER = dict(num_hidden_layers=4, mlp_only_layers=[1])  # MoE layers 0, 2 and 3


def test_a_layer_fills_up_to_its_even_share_of_the_free_slots():
    cache = ExpertCache(7, make_policy("freq"))
    assert cache.fillable(0) == 7 and cache.fillable(0, layers=3) == 3  # ceil(7 / 3)
    for e in range(3):
        cache.admit((0, e))
    assert cache.fillable(0, layers=3) == 0 and cache.fillable(1, layers=3) == 3 and cache.fillable(0) == 4
    for e in range(3):
        cache.admit((1, e))
    assert cache.fillable(2, layers=3) == 1  # the last free slot, below the share
    cache.resize(4)  # evicts three of them: the layers' counts follow
    assert sum(cache.per_layer.values()) == len(cache.slot_of) == 4


@pytest.fixture(scope="module")
def q8_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("spread")
    write_hf_checkpoint(path=path / "hf", **PARITY_CASES["qwen3_moe"], **DEEPER)
    return write_gguf_from_hf(path / "hf", path / "m.gguf", tensor_type="Q8_0")


@pytest.mark.parametrize("spread", [False, True])
@pytest.mark.parametrize("tier", ["slots", "rows"])
def test_a_prefill_spreads_what_it_caches_over_the_layers(q8_gguf, tier, spread, monkeypatch):
    on = {"stream-short-chunks", "ahead-batches"} | ({"prefill-spread"} if spread else set())
    monkeypatch.setattr(prefill.gpu_paths, "enabled", lambda name: name in on)
    resident = load_model(q8_gguf, progress=False, dtype=torch.float32)
    spec = resident.moe_spec
    per = spec.bytes_per_expert(torch.float32) if tier == "slots" else spec.bytes_per_expert("Q8_0")
    capacity = 12  # of 3 layers × 8 experts: an even share is 4 a layer
    lm = load_model(q8_gguf, progress=False, dtype=torch.float32, expert_cache=capacity * per, prefill_ahead=True,
                    block_share=0.0 if tier == "slots" else 1.0)
    ex = lm.experts
    ex.miss_path = "copy"
    cache = ex.cache if tier == "slots" else ex.copier.store.cache
    assert cache.capacity == capacity
    ids = torch.randint(0, resident.args.decoder.vocab_size, (2 * ex.num_experts * ex.AHEAD_TOKENS_PER_EXPERT,),
                        generator=torch.Generator().manual_seed(4)).tolist()
    torch.testing.assert_close(lm.prefill_logits(ids), resident.prefill_logits(ids), atol=1e-4, rtol=0)
    held = [cache.per_layer[layer] for layer in spec.moe_layers]
    assert sum(held) == capacity and cache.counters.evictions == 0
    assert held == ([4, 4, 4] if spread else [8, 4, 0])  # in layer order, the first layer takes all it routes to
