"""GLM-4.5 (`glm4_moe`) from GGUF, as llama.cpp's converter writes it (the family's parity with transformers is
in test_grouped_routing.py)."""

from __future__ import annotations

import pytest
import torch

from freetoken.engine.generator import Generator
from freetoken.engine.loader import load_model
from freetoken.engine.sampling import SamplingParams
from support.checkpoints import hf_logits, prompt_ids, write_hf_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("glm4_moe")
    return path, write_hf_checkpoint("glm4_moe", path), None


@pytest.mark.parametrize("tensor_type", ["F32", "Q8_0"])
def test_a_gguf_of_the_checkpoint_loads_to_the_same_model(checkpoint, tensor_type, tmp_path):
    """GGUF architecture glm4moe as llama.cpp's converter writes it (its tensor names and routing keys, an MTP
    block counted in block_count): F32 gives transformers' logits; Q8_0, offloaded, its greedy tokens."""
    from support.checkpoints import write_gguf_from_hf

    path, reference, expected = checkpoint
    gguf_path = write_gguf_from_hf(path, tmp_path / "glm.gguf", tensor_type=tensor_type)
    ids = prompt_ids()
    if tensor_type == "F32":
        lm = load_model(gguf_path, device="cpu", dtype=torch.float32, progress=False)
        assert lm.args.decoder.n_layers == 3 and lm.moe_spec.num_shared_experts == 1
        torch.testing.assert_close(lm.prefill_logits(ids), hf_logits(reference, ids), atol=1e-4, rtol=0)
        return
    probe = load_model(gguf_path, device="cpu", dtype=torch.float32, progress=False)
    budget = 3 * probe.moe_spec.bytes_per_expert(torch.float32)
    lm = load_model(gguf_path, device="cpu", dtype=torch.float32, progress=False, expert_cache=budget)
    ours = Generator(lm).generate_ids(ids, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert ours == Generator(probe).generate_ids(ids, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
