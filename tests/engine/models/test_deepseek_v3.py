"""DeepSeek-V3 (`deepseek_v3`: multi-head latent attention cached as its latent, grouped sigmoid routing with a
selection bias and scaling, shared experts, interleaved RoPE, a leading dense layer) against transformers on a
tiny random checkpoint written with transformers' own config class: fp32 logits within 1e-4, 32 greedy tokens
equal to `generate`, across prefill chunks, offloaded below the pool and batched with another request. The
multi-token-prediction layer the Hub's checkpoints carry past the last layer is left out."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from freetoken.engine.batching import BatchRequest, BatchScheduler
from freetoken.engine.generator import Generator
from freetoken.engine.loader import load_model
from freetoken.engine.models.moe import GroupedSigmoidRouter
from freetoken.engine.sampling import SamplingParams
from support.checkpoints import divergence_report, hf_greedy, hf_logits, prompt_ids, write_hf_checkpoint

GREEDY_32 = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek_v3")
    reference = write_hf_checkpoint("deepseek_v3", path)
    return path, reference, hf_greedy(reference, prompt_ids(), 32)


@pytest.fixture(scope="module")
def lm(checkpoint):
    return load_model(checkpoint[0], device="cpu", dtype=torch.float32, progress=False)


def test_the_router_matches_transformers(checkpoint, lm):
    """Same experts and weights as transformers' router for random activations: the bias moves the choice,
    groups limit it, the scale multiplies the weights."""
    reference = checkpoint[1].model.layers[1].mlp.gate
    ours = lm.model.model.layers[1].mlp.gate
    assert isinstance(ours, GroupedSigmoidRouter) and reference.e_score_correction_bias.abs().sum() > 0
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    _, want_w, want_ids = reference(x)
    weights, ids = ours(x)
    order, want_order = ids.sort(dim=-1), want_ids.sort(dim=-1)
    assert torch.equal(order.values, want_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices), want_w.gather(1, want_order.indices))


def test_prefill_logits_match_transformers(checkpoint, lm):
    ids = prompt_ids()
    torch.testing.assert_close(lm.prefill_logits(ids), hf_logits(checkpoint[1], ids), atol=1e-4, rtol=0)


def test_greedy_tokens_match_transformers(checkpoint, lm):
    path, reference, expected = checkpoint
    ids = prompt_ids()
    for gen in (Generator(lm), Generator(lm, prefill_chunk=7, page_size=4)):
        ours = gen.generate_ids(ids, GREEDY_32)
        assert ours == expected, divergence_report(reference, ids, ours, expected)


def test_offloaded_and_batched_greedy_tokens_are_the_same(checkpoint, lm):
    path, reference, expected = checkpoint
    spec = lm.moe_spec
    assert (spec.moe_layers, spec.num_experts, spec.num_shared_experts) == ((1, 2), 8, 2)
    offloaded = load_model(path, device="cpu", dtype=torch.float32, progress=False,
                           expert_cache=3 * spec.bytes_per_expert(torch.float32))
    assert Generator(offloaded).generate_ids(prompt_ids(), GREEDY_32) == expected
    assert offloaded.experts.counters.evictions > 0
    scheduler = BatchScheduler(lm)
    out: dict[int, list[int]] = {0: [], 1: []}
    other = prompt_ids("A second prompt beside the first")
    for i, ids in enumerate((prompt_ids(), other)):
        scheduler.add(BatchRequest(ids, GREEDY_32, emit=lambda ev, i=i: out[i].extend(ev.token_ids)))
    while scheduler.active:
        scheduler.step()
    assert out[0] == expected and out[1] == Generator(lm).generate_ids(other, GREEDY_32)


def test_the_multi_token_prediction_layer_is_left_out(checkpoint, tmp_path):
    """The Hub's GLM-4.5 checkpoints hold one more layer (index num_hidden_layers) for multi-token prediction,
    experts and all; it loads as if it were not there."""
    import shutil

    path, reference, _ = checkpoint
    for f in path.iterdir():
        shutil.copy(f, tmp_path / f.name)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    tensors = load_file(tmp_path / shard)
    extra = {name.replace("model.layers.2.", "model.layers.3."): t.clone()
             for name, t in load_file(path / index["weight_map"]["model.layers.2.mlp.gate.weight"]).items()
             if name.startswith("model.layers.2.")}
    save_file({**tensors, **extra}, tmp_path / shard)
    index["weight_map"].update({name: shard for name in extra})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    loaded = load_model(tmp_path, device="cpu", dtype=torch.float32, progress=False)
    ids = prompt_ids()
    torch.testing.assert_close(loaded.prefill_logits(ids), hf_logits(reference, ids), atol=1e-4, rtol=0)


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
