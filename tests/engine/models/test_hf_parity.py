"""Every family, loaded from an HF directory, against transformers on the same tiny random checkpoint.

fp32 prefill logits agree to 1e-4; 32 greedy tokens through the paged KV cache are identical to transformers'
`generate` (EOS does not stop either, and the tiny models do emit it). Cases: llama with default, llama3 and
yarn RoPE and with tied embeddings, qwen3_moe (one dense layer between MoE layers), qwen2_moe (shared expert),
mixtral.
"""

from __future__ import annotations

import pytest
import torch

from freetoken.engine.generator import Generator
from freetoken.engine.loader import load_model
from freetoken.engine.sampling import SamplingParams
from support.checkpoints import (
    PARITY_CASES,
    divergence_report,
    hf_greedy,
    hf_logits,
    prompt_ids,
    write_hf_checkpoint,
)

GREEDY_32 = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)

# What `moe_spec` must say about each tiny MoE config (tests/support/checkpoints.py:tiny_config).
EXPECTED_MOE = {
    "qwen3_moe": dict(moe_layers=(0, 2), num_experts=8, top_k=2, num_shared_experts=0,
                      expert_intermediate_size=32, hidden_size=64),
    "qwen2_moe": dict(moe_layers=(0, 1), num_experts=8, top_k=2, num_shared_experts=1,
                      expert_intermediate_size=32, hidden_size=64),
    "mixtral": dict(moe_layers=(0, 1), num_experts=8, top_k=2, num_shared_experts=0,
                    expert_intermediate_size=64, hidden_size=64),
}


@pytest.fixture(scope="module", params=list(PARITY_CASES))
def case(request, tmp_path_factory):
    """(case name, transformers model, our LoadedModel, transformers' 32 greedy tokens) of one checkpoint."""
    path = tmp_path_factory.mktemp(request.param)
    reference = write_hf_checkpoint(path=path, **PARITY_CASES[request.param])
    lm = load_model(path, device="cpu", dtype=torch.float32)
    return request.param, reference, lm, hf_greedy(reference, prompt_ids(), 32)


def test_prefill_logits_match_transformers(case):
    _, reference, lm, _ = case
    ids = prompt_ids()
    ours = lm.prefill_logits(ids)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, hf_logits(reference, ids), atol=1e-4, rtol=0)


def test_prefill_logits_of_a_single_token(case):
    _, reference, lm, _ = case
    torch.testing.assert_close(lm.prefill_logits([5]), hf_logits(reference, [5]), atol=1e-4, rtol=0)


def test_greedy_tokens_match_transformers(case):
    _, reference, lm, expected = case
    ids = prompt_ids()
    ours = Generator(lm).generate_ids(ids, GREEDY_32)
    assert ours == expected, divergence_report(reference, ids, ours, expected)


def test_greedy_across_prefill_chunks_and_pages(case):
    """Prefilling in chunks of 7 into pages of 4 (both straddle each other) changes nothing."""
    _, reference, lm, expected = case
    ids = prompt_ids()
    ours = Generator(lm, prefill_chunk=7, page_size=4).generate_ids(ids, GREEDY_32)
    assert ours == expected, divergence_report(reference, ids, ours, expected)


def test_moe_spec_describes_the_experts(case):
    name, _, lm, _ = case
    if name not in EXPECTED_MOE:
        assert lm.moe_spec is None
        return
    spec = lm.moe_spec
    got = {field: getattr(spec, field) for field in EXPECTED_MOE[name]}
    assert got == EXPECTED_MOE[name]
    per_expert = 3 * spec.hidden_size * spec.expert_intermediate_size
    assert spec.bytes_per_expert(torch.float32) == 4 * per_expert
    assert spec.bytes_per_expert(torch.bfloat16) == 2 * per_expert


def test_loaded_model_reports_device_and_dtype(case):
    _, _, lm, _ = case
    assert lm.device == torch.device("cpu")
    assert lm.dtype == torch.float32
