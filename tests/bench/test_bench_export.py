"""`ft bench export` writes the synthetic model as files other engines load: an HF directory `transformers`
reads to the same logits, and a Q8_0 GGUF that parses with the reference `gguf` reader; freetoken loading either
file computes what the in-memory benchmark model computes."""

from __future__ import annotations

import gguf
import pytest
import torch

from freetoken.bench.export import build_for_export, main
from freetoken.engine.loader import load_model

IDS = [1, 504, 3_000, 17, 42, 9_000, 311, 5]


@pytest.fixture(scope="module")
def exported(tmp_path_factory, smollm2_gguf):
    out = tmp_path_factory.mktemp("export")
    assert main(["--shape", "tiny-moe", "--layers", "2", "--format", "safetensors", "--out", str(out / "hf")]) == 0
    assert main(["--shape", "tiny-moe", "--layers", "2", "--format", "gguf-q8_0", "--out", str(out / "m.gguf")]) == 0
    return out


def test_safetensors_export_loads_in_transformers_with_the_same_logits(exported):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ours = load_model(exported / "hf", dtype=torch.float32, progress=False)
    theirs = AutoModelForCausalLM.from_pretrained(exported / "hf", dtype=torch.float32)
    with torch.no_grad():
        want = theirs(torch.tensor([IDS])).logits[0]
    torch.testing.assert_close(ours.prefill_logits(IDS), want, atol=1e-4, rtol=1e-4)
    text = "Hello world, this is a test."
    assert AutoTokenizer.from_pretrained(exported / "hf").encode(text) == ours.tokenizer.encode(text)
    assert ours.config["vocab_size"] == 49152  # tiny-moe's vocabulary grown to the real tokenizer's


def test_safetensors_export_equals_the_in_memory_model(exported):
    """Same weights; the in-memory model runs its experts offloaded, the loaded one resident (bf16 rounding)."""
    memory = build_for_export("tiny-moe", "safetensors", layers=2)
    ours = load_model(exported / "hf", dtype=torch.bfloat16, progress=False)
    want = memory.prefill_logits(IDS).float()
    assert (ours.prefill_logits(IDS).float() - want).norm() / want.norm() < 1e-2
    assert torch.equal(ours.model.model.embed_tokens.weight, memory.model.model.embed_tokens.weight)


def test_gguf_export_is_q8_0_experts_and_equals_the_in_memory_model(exported):
    reader = gguf.GGUFReader(exported / "m.gguf")
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["blk.1.ffn_down_exps.weight"] == gguf.GGMLQuantizationType.Q8_0
    assert types["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.BF16
    assert types["blk.0.attn_norm.weight"] == gguf.GGMLQuantizationType.F32
    tokens = reader.fields["tokenizer.ggml.tokens"]
    assert len(tokens.data) == 49152  # SmolLM2's vocabulary: tiny-moe's grew to it
    memory = build_for_export("tiny-moe", "gguf-q8_0", layers=2)
    loaded = load_model(exported / "m.gguf", dtype=torch.bfloat16, progress=False)
    want = memory.prefill_logits(IDS).float()
    assert (loaded.prefill_logits(IDS).float() - want).norm() / want.norm() < 1e-2


def test_a_larger_vocabulary_is_padded_with_unused_tokens(smollm2_gguf):
    from freetoken.bench.export import UNUSED_TOKEN, tokenizer_metadata
    from freetoken.engine.gguf_vocab import build_gguf_vocab

    md = tokenizer_metadata(49152 + 8)
    assert len(md["tokenizer.ggml.tokens"]) == len(md["tokenizer.ggml.token_type"]) == 49160
    assert md["tokenizer.ggml.tokens"][-1] == "<|ft_unused_7|>" and md["tokenizer.ggml.token_type"][-1] == UNUSED_TOKEN
    vocab = build_gguf_vocab(md)
    assert vocab.backend.encode("Hello world").ids == build_gguf_vocab(tokenizer_metadata(49152)).backend.encode(
        "Hello world").ids
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        tokenizer_metadata(1000)


def test_a_gguf_with_a_padded_vocabulary_writes_and_loads(tmp_path, smollm2_gguf):
    from freetoken.bench.export import write_gguf_q8_0
    from freetoken.bench.synthetic import build_synthetic

    lm = build_synthetic("tiny-moe", device="cpu", dtype=torch.bfloat16, expert_cache=0, layers=1,
                         expert_format="Q8_0", vocab_size=49152 + 8)
    path = write_gguf_q8_0(lm, tmp_path / "padded.gguf")
    assert len(gguf.GGUFReader(path).fields["tokenizer.ggml.tokens"].data) == 49160
    assert load_model(path, progress=False).config["vocab_size"] == 49160


def test_a_hybrid_shape_exports_to_safetensors_that_transformers_reads(tmp_path, smollm2_gguf):
    """Qwen3-Next's layers (DeltaNet beside attention) as an HF directory: transformers computes the same logits
    as freetoken loading it; the Q8_0 GGUF writer, which has no names for DeltaNet tensors, refuses in one line and
    leaves no file."""
    from transformers import AutoModelForCausalLM

    assert main(["--shape", "tiny-hybrid", "--format", "safetensors", "--out", str(tmp_path / "hf")]) == 0
    ours = load_model(tmp_path / "hf", dtype=torch.float32, progress=False)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    with torch.no_grad():
        want = theirs(torch.tensor([IDS])).logits[0]
    torch.testing.assert_close(ours.prefill_logits(IDS), want, atol=1e-4, rtol=1e-4)
    with pytest.raises(SystemExit, match="no name for model.layers.0.linear_attn.*--format safetensors"):
        main(["--shape", "tiny-hybrid", "--format", "gguf-q8_0", "--out", str(tmp_path / "m.gguf")])
    assert not (tmp_path / "m.gguf").exists()
