"""Every family, loaded from a GGUF of the same weights, against the HF-directory load and transformers.

The GGUF is laid out as llama.cpp's converter writes it (tests/support/checkpoints.py): llama and mixtral share
architecture "llama" with permuted Q/K rows, experts are stacked, Llama 3 RoPE is a `rope_freqs` tensor and YaRN
is `rope.scaling.*` metadata. F32 files must give the HF path's logits (1e-4) and transformers' greedy tokens.
F16 and Q8_0 files are compared with transformers reading the very same file (its dequantised weights), which is
the reference for what the quantised numbers mean.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from freetoken.engine.generator import Generator
from freetoken.engine.loader import load_model
from freetoken.engine.sampling import SamplingParams
from support.checkpoints import (
    PARITY_CASES,
    PROMPT_TEXT,
    build_tokenizer,
    divergence_report,
    hf_greedy,
    hf_logits,
    prompt_ids,
    write_gguf_from_hf,
    write_hf_checkpoint,
)

GREEDY_32 = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module", params=list(PARITY_CASES))
def case(request, tmp_path_factory):
    """(transformers model, our HF-directory load, our F32 GGUF load, transformers' 32 greedy tokens)."""
    path = tmp_path_factory.mktemp(request.param)
    reference = write_hf_checkpoint(path=path, **PARITY_CASES[request.param])
    gguf_path = write_gguf_from_hf(path, path / "model-F32.gguf", tensor_type="F32")
    from_dir = load_model(path, device="cpu", dtype=torch.float32)
    from_gguf = load_model(gguf_path, device="cpu", dtype=torch.float32)
    return reference, from_dir, from_gguf, hf_greedy(reference, prompt_ids(), 32)


def test_gguf_logits_match_hf_directory_and_transformers(case):
    reference, from_dir, from_gguf, _ = case
    ids = prompt_ids()
    ours = from_gguf.prefill_logits(ids)
    torch.testing.assert_close(ours, from_dir.prefill_logits(ids), atol=1e-4, rtol=0)
    torch.testing.assert_close(ours, hf_logits(reference, ids), atol=1e-4, rtol=0)


def test_gguf_greedy_tokens_match_transformers(case):
    reference, _, from_gguf, expected = case
    ids = prompt_ids()
    ours = Generator(from_gguf).generate_ids(ids, GREEDY_32)
    assert ours == expected, divergence_report(reference, ids, ours, expected)


def test_gguf_moe_spec_matches_hf_directory(case):
    _, from_dir, from_gguf, _ = case
    assert from_gguf.moe_spec == from_dir.moe_spec


TEXTS = [PROMPT_TEXT, "Héllo wörld 1234 — naïve café\n\n  x\ty <|im_end|>z", "it's WE'LL 99!!"]


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_vocabulary_encodes_like_tokenizer_json(case, text):
    _, from_dir, from_gguf, _ = case
    expected = build_tokenizer().encode(text).ids
    assert from_gguf.tokenizer.encode(text) == expected
    assert from_dir.tokenizer.encode(text) == expected
    assert from_gguf.tokenizer.decode(expected) == text


# transformers can read these back: llama fully from GGUF metadata, qwen2moe given its config (transformers' GGUF
# config mapping lacks the expert widths). It cannot map mixtral-as-llama experts or qwen3moe's dense layer.
QUANTISED = [("llama", "F16"), ("llama", "Q8_0"), ("qwen2_moe", "Q8_0")]


@pytest.mark.parametrize(("family", "tensor_type"), QUANTISED, ids=[f"{f}-{t}" for f, t in QUANTISED])
def test_quantised_gguf_matches_transformers_reading_the_same_file(family, tensor_type, tmp_path):
    write_hf_checkpoint(family, tmp_path)
    gguf_path = write_gguf_from_hf(tmp_path, tmp_path / f"model-{tensor_type}.gguf", tensor_type=tensor_type)
    config = {} if family == "llama" else {"config": AutoConfig.from_pretrained(tmp_path)}
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=gguf_path.name, dtype=torch.float32,
                                                     **config).eval()
    lm = load_model(gguf_path, device="cpu", dtype=torch.float32)
    ids = prompt_ids()
    torch.testing.assert_close(lm.prefill_logits(ids), hf_logits(reference, ids), atol=1e-4, rtol=0)
    ours = Generator(lm).generate_ids(ids, GREEDY_32)
    expected = hf_greedy(reference, ids, 32)
    assert ours == expected, divergence_report(reference, ids, ours, expected)
