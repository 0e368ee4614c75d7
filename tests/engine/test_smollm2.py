"""The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers reading the very same file.

transformers dequantises the Q4_1 blocks to fp32 itself, so both sides run identical numbers: the greedy answer to
a chat-templated question must match token for token, and it must name Paris.
"""

from __future__ import annotations

import pytest
import torch

from freetoken.engine.generator import Generator
from freetoken.engine.loader import load_model
from freetoken.engine.sampling import SamplingParams
from support.checkpoints import divergence_report, hf_greedy, hf_logits

N_TOKENS = 24


@pytest.fixture(scope="module")
def reference(smollm2_reference):
    return smollm2_reference


@pytest.fixture(scope="module")
def ours(smollm2_gguf):
    return load_model(smollm2_gguf, device="cpu", dtype=torch.float32)


def test_prefill_logits_match_transformers(reference, ours):
    _, model, ids = reference
    # 30 layers of fp32 on logits of magnitude ~20: agreement to 1e-3 leaves no room for a wrong weight.
    torch.testing.assert_close(ours.prefill_logits(ids), hf_logits(model, ids), atol=1e-3, rtol=0)


def test_greedy_answer_matches_transformers_and_names_paris(reference, ours):
    tokenizer, model, ids = reference
    got = Generator(ours).generate_ids(ids, SamplingParams(temperature=0.0, max_tokens=N_TOKENS, ignore_eos=True))
    expected = hf_greedy(model, ids, N_TOKENS)
    assert got == expected, divergence_report(model, ids, got, expected)
    answer = tokenizer.decode(got, skip_special_tokens=True)
    assert "Paris" in answer, answer
