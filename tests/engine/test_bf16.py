"""bf16 execution on every device we can reach (CPU always, CUDA where present): each family and the real
default model against the fp32 truth, held to the error transformers' own bf16 path makes on the same device.

bf16 cannot match fp32 bit for bit, so the bar is relative: our worst logit error must be within twice
transformers' bf16 error (plus a small floor), and greedy tokens may part from transformers' only where the
fp32 model itself had a near-tie that bf16 noise can flip.
"""

from __future__ import annotations

import copy

import pytest
import torch

from freetoken.engine.generator import Generator
from freetoken.engine.loader import load_model
from freetoken.engine.sampling import SamplingParams
from support.checkpoints import PARITY_CASES, hf_logits, prompt_ids, write_hf_checkpoint

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]
N_TOKENS = 16


def _max_err(logits: torch.Tensor, truth: torch.Tensor) -> float:
    return (logits.float().cpu() - truth).abs().max().item()


def _assert_greedy_agrees(ours: list[int], theirs: list[int], fp32_model, prompt: list[int], noise: float):
    """Equal, or first parting at a step where the fp32 top-2 margin is within the bf16 noise."""
    if ours == theirs:
        return
    k = next(i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b)
    with torch.no_grad():
        last = hf_logits(fp32_model, prompt + ours[:k])[-1]
    top2 = torch.topk(last, 2).values
    margin = (top2[0] - top2[1]).item()
    assert margin <= 2 * noise, f"greedy parted at step {k} although fp32's top-2 margin is {margin:.4f}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["llama", "qwen3_moe", "qwen2_moe", "mixtral"])
def test_family_in_bf16_is_as_close_to_fp32_as_transformers(case, device, tmp_path):
    fp32_ref = write_hf_checkpoint(path=tmp_path, **PARITY_CASES[case])
    ids = prompt_ids()
    truth = hf_logits(fp32_ref, ids)
    bf16_ref = write_hf_checkpoint(path=tmp_path / "copy", **PARITY_CASES[case]).to(device, torch.bfloat16)
    lm = load_model(tmp_path, device=device, dtype=torch.bfloat16)
    assert lm.dtype == torch.bfloat16 and lm.device.type == device

    ours_err = _max_err(lm.prefill_logits(ids), truth)
    with torch.no_grad():
        theirs_err = _max_err(bf16_ref(torch.tensor([ids], device=device)).logits[0], truth)
    assert ours_err <= 2 * theirs_err + 0.02, (ours_err, theirs_err)

    ours = Generator(lm).generate_ids(ids, SamplingParams(temperature=0, max_tokens=N_TOKENS, ignore_eos=True))
    theirs = _hf_greedy_on(bf16_ref, ids, device)
    _assert_greedy_agrees(ours, theirs, fp32_ref, ids, max(ours_err, theirs_err))


def _hf_greedy_on(model, ids: list[int], device: str) -> list[int]:
    prompt = torch.tensor([ids], device=device)
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                             max_new_tokens=N_TOKENS, eos_token_id=[], pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_default_model_in_bf16_is_as_close_to_fp32_as_transformers(smollm2_gguf, smollm2_reference, device):
    _, fp32_model, ids = smollm2_reference
    truth = hf_logits(fp32_model, ids)
    lm = load_model(smollm2_gguf, device=device, dtype=torch.bfloat16)
    bf16_ref = copy.deepcopy(fp32_model).to(device, torch.bfloat16)
    ours_err = _max_err(lm.prefill_logits(ids), truth)
    with torch.no_grad():
        theirs_err = _max_err(bf16_ref(torch.tensor([ids], device=device)).logits[0], truth)
    assert ours_err <= 2 * theirs_err + 0.05, (ours_err, theirs_err)
    ours = Generator(lm).generate_ids(ids, SamplingParams(temperature=0, max_tokens=N_TOKENS, ignore_eos=True))
    _assert_greedy_agrees(ours, _hf_greedy_on(bf16_ref, ids, device), fp32_model, ids, max(ours_err, theirs_err))
