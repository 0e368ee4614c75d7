"""DeepSeek-V4 as the hub ships it (DeepSeek-V4-Flash): attention and shared-expert projections in block FP8
with E8M0 scales named `X.scale`, routed experts in FP4 (int8, two e2m1 values a byte, the low nibble first, an
E8M0 scale per 32 values of a row), under `quantization_config` fp8. Checked against transformers' own
dequantizer (`Fp8Dequantize`) feeding its model: the logits; the greedy tokens resident and offloaded, the FP4
experts then kept as MXFP4 blocks in host memory (a quarter of fp32's bytes and a bit) on both miss paths."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from freetoken.engine.generator import Generator
from freetoken.engine.loader import load_model
from freetoken.engine.sampling import SamplingParams
from freetoken.kernels.mxfp4.reference import E2M1_VALUES
from support.checkpoints import hf_greedy, hf_logits, prompt_ids, write_hf_checkpoint

FP8 = re.compile(r".*\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|shared_experts\.w[123])\.weight")
FP4 = re.compile(r".*\.experts\.\d+\.w[123]\.weight")
BLOCK = (128, 128)  # the released checkpoints' FP8 blocks (the tiny matrices are one partial block each)


def quantize_fp8_e8m0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] → e4m3 values and power-of-two scales [⌈N/128⌉, ⌈K/128⌉] (E8M0), the largest value ≤ 448."""
    n, k = w.shape
    bn, bk = BLOCK
    padded = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk)
    padded[:n, :k] = w
    amax = padded.abs().view(padded.shape[0] // bn, bn, -1, bk).amax(dim=(1, 3)).clamp(min=1e-12)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448)))
    full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (w / full).to(torch.float8_e4m3fn), scale.to(torch.float8_e8m0fnu)


def quantize_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] → int8 [N, K/2] (value 2j in the low nibble of byte j) and E8M0 scales [N, K/32]: each value the
    nearest e2m1 code times its block's power-of-two scale (the block's largest ≤ 6 of it)."""
    n, k = w.shape
    blocks = w.view(n, k // 32, 32)
    scale = torch.exp2(torch.ceil(torch.log2(blocks.abs().amax(dim=-1).clamp(min=1e-12) / 6)))
    table = torch.tensor(E2M1_VALUES)
    codes = ((blocks / scale[..., None])[..., None] - table).abs().argmin(dim=-1).view(n, k).to(torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.view(torch.int8), scale.to(torch.float8_e8m0fnu)


@pytest.fixture(scope="module")
def hub_checkpoint(tmp_path_factory):
    """The tiny V4 checkpoint rewritten in the hub's format, and transformers' model loaded from a copy holding
    the weights transformers' FP8 integration dequantizes them to."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    dequantize = Fp8Dequantize(None)._dequantize_one
    path, dequantized = tmp_path_factory.mktemp("v4-hub"), tmp_path_factory.mktemp("v4-hub-dequantized")
    write_hf_checkpoint("deepseek_v4", path)
    for f in path.iterdir():
        shutil.copy(f, dequantized / f.name)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    for shard in sorted(set(index["weight_map"].values())):
        quantized, plain = {}, {}
        for name, t in load_file(path / shard).items():
            quantize = quantize_fp4 if FP4.fullmatch(name) else quantize_fp8_e8m0 if FP8.fullmatch(name) else None
            if quantize is None:
                quantized[name] = plain[name] = t
                continue
            q, scale = quantize(t)
            scale_name = name.removesuffix(".weight") + ".scale"
            quantized[name], quantized[scale_name] = q, scale
            index["weight_map"][scale_name] = shard
            plain[name] = dequantize(q, scale, torch.float32)
        save_file(quantized, path / shard)
        save_file(plain, dequantized / shard)
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(BLOCK),
                                     "scale_fmt": "ue8m0"}
    (path / "config.json").write_text(json.dumps(config))
    reference = AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32).eval()
    return path, reference


def test_the_hub_format_loads_to_the_dequantized_models_logits(hub_checkpoint):
    path, reference = hub_checkpoint
    lm = load_model(path, device="cpu", dtype=torch.float32, progress=False)
    torch.testing.assert_close(lm.prefill_logits(prompt_ids()), hf_logits(reference, prompt_ids()), atol=1e-4,
                               rtol=0)


def test_offloaded_fp4_experts_stay_mxfp4_and_decode_the_same_tokens(hub_checkpoint):
    path, reference = hub_checkpoint
    expected = hf_greedy(reference, prompt_ids(), 16)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    lm = load_model(path, device="cpu", dtype=torch.float32, progress=False)
    assert Generator(lm).generate_ids(prompt_ids(), greedy) == expected
    per_expert = lm.moe_spec.bytes_per_expert(torch.float32)
    offloaded = load_model(path, device="cpu", dtype=torch.float32, progress=False, expert_cache=3 * per_expert)
    host = offloaded.experts.host[0]
    assert set(host.type_names.values()) == {"MXFP4"}
    assert host.raw["gate_proj"].shape == (8, 32 * 64 // 32 * 17)  # 17 bytes a block of 32, not 128 (fp32)
    for miss_path in ("copy", "cpu"):
        offloaded.experts.miss_path = miss_path
        assert Generator(offloaded).generate_ids(prompt_ids(), greedy) == expected, miss_path
        assert offloaded.experts.counters.misses > 0


def test_ft_info_counts_the_fp4_experts_bytes(hub_checkpoint):
    """17 bytes a block of 32 weights (as they are kept), not one byte a weight (the int8 they ship in)."""
    from freetoken.engine.model_info import describe

    text = describe(str(hub_checkpoint[0]))
    assert "3.19 KiB per expert (FP4, kept as MXFP4 blocks when offloaded)" in text, text
