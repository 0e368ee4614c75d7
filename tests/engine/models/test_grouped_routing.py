"""The DeepSeek-style families — GLM-4.5 (`glm4_moe`: GQA with q/k norm, qkv biases, partial RoPE),
DeepSeek-V3 (`deepseek_v3`: multi-head latent attention, interleaved RoPE) and GLM-5 (`glm_moe_dsa`: MLA with
DeepSeek Sparse Attention, each query seeing 8 keys of a longer prompt) — share grouped sigmoid routing with
a selection bias and scaling, shared experts and a leading dense layer. Each against transformers on a tiny
random checkpoint written with transformers' own config class: the router, fp32 logits within 1e-4, 32 greedy
tokens equal to `generate` (also across prefill chunks), offloaded below the pool and batched with another
request; the multi-token-prediction layer the Hub's checkpoints carry past the last layer is left out."""

from __future__ import annotations

import json

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


SHARED_EXPERTS = {"glm4_moe": 1, "deepseek_v3": 2, "glm_moe_dsa": 1}  # the tiny configs' (tests/support/checkpoints.py)


@pytest.fixture(scope="module", params=list(SHARED_EXPERTS))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    reference = write_hf_checkpoint(request.param, path)
    return path, reference, hf_greedy(reference, prompt_ids(), 32), request.param


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
    path, reference, expected, family = checkpoint
    ids = prompt_ids()
    for gen in (Generator(lm), Generator(lm, prefill_chunk=7, page_size=4)):
        ours = gen.generate_ids(ids, GREEDY_32)
        assert ours == expected, divergence_report(reference, ids, ours, expected)


def test_offloaded_and_batched_greedy_tokens_are_the_same(checkpoint, lm):
    path, reference, expected, family = checkpoint
    spec = lm.moe_spec
    assert (spec.moe_layers, spec.num_experts, spec.num_shared_experts) == ((1, 2), 8, SHARED_EXPERTS[family])
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

    path, reference, _, _ = checkpoint
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
