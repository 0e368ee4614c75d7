"""Block-wise FP8 checkpoints (DeepSeek-V3 / Qwen3-FP8 style: float8_e4m3fn weights with a `weight_scale_inv`
per 128 × 128 block): the plain-torch dequantization, and a tiny checkpoint rewritten in that format loading to
the logits of the model whose weights are the dequantized ones."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from freetoken.engine.experts import LayerExperts
from freetoken.engine.generator import Generator
from freetoken.engine.loader import load_model
from freetoken.engine.sampling import SamplingParams
from freetoken.errors import ModelLoadError
from freetoken.kernels.fp8_block.reference import dequantize_fp8_blocks, quantize_fp8_blocks
from support.checkpoints import PARITY_CASES, hf_greedy, hf_logits, prompt_ids, write_hf_checkpoint

BLOCK = (16, 16)  # the tiny model's weights are 32-128 wide: several blocks each, some partial


def test_dequantization_inverts_quantization_to_e4m3_precision():
    w = torch.randn(40, 70, generator=torch.Generator().manual_seed(0)) * 3
    q, scale_inv = quantize_fp8_blocks(w, BLOCK)
    assert q.dtype == torch.float8_e4m3fn and scale_inv.shape == (3, 5)  # partial blocks at both edges
    back = dequantize_fp8_blocks(q, scale_inv, BLOCK)
    assert ((back - w).abs() <= w.abs() * 2 ** -4 + scale_inv.max() * 2 ** -9).all()  # 3 mantissa bits
    with pytest.raises(ValueError, match="do not tile"):
        dequantize_fp8_blocks(q, scale_inv[:2], BLOCK)


@pytest.mark.parametrize("block", [(16, 32), (128, 128), (16, 64)])
def test_row_blocks_hold_the_same_weights(block):
    """FP8_B32, the host layout of offloaded FP8 experts: every 32 values of a row with their 2-D block's scale;
    dequantized, exactly the checkpoint's weights."""
    from freetoken.kernels.fp8_block.reference import to_row_blocks
    from freetoken.kernels.gguf_dequant.reference import dequantize

    w = torch.randn(40, 128, generator=torch.Generator().manual_seed(1)) * 3
    q, scale_inv = quantize_fp8_blocks(w, block)
    rows = to_row_blocks(q, scale_inv, block)
    assert rows.shape == (40, 128 // 32 * 36)
    assert torch.equal(dequantize(rows.reshape(-1), "FP8_B32", w.numel()).view(w.shape),
                       dequantize_fp8_blocks(q, scale_inv, block))
    with pytest.raises(ValueError, match="rows of 32-value blocks"):
        to_row_blocks(q[:, :120], quantize_fp8_blocks(w[:, :120], (16, 40))[1], (16, 40))


@pytest.fixture(scope="module", params=[BLOCK, (16, 32)], ids=["16x16", "16x32"])
def fp8_checkpoint(request, tmp_path_factory):
    """The tiny qwen3_moe checkpoint with every projection (experts included) in block FP8, and transformers'
    model loaded from a copy holding the dequantized weights. Scale blocks 16 wide (experts dequantized at load)
    or 32 wide (offloaded experts stay FP8: rows of 32-value blocks)."""
    block = request.param
    import shutil

    from transformers import AutoModelForCausalLM

    path, dequantized = tmp_path_factory.mktemp("fp8"), tmp_path_factory.mktemp("fp8-dequantized")
    write_hf_checkpoint(path=path, **PARITY_CASES["qwen3_moe"])
    for f in path.iterdir():
        shutil.copy(f, dequantized / f.name)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    for shard in sorted(set(index["weight_map"].values())):
        fp8, plain = {}, {}
        for name, t in load_file(path / shard).items():
            if name.endswith("proj.weight") and t.dim() == 2:
                q, scale_inv = quantize_fp8_blocks(t, block)
                fp8[name], fp8[name + "_scale_inv"] = q, scale_inv
                index["weight_map"][name + "_scale_inv"] = shard
                plain[name] = dequantize_fp8_blocks(q, scale_inv, block)
            else:
                fp8[name] = plain[name] = t
        save_file(fp8, path / shard)
        save_file(plain, dequantized / shard)
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block)}
    (path / "config.json").write_text(json.dumps(config))
    reference = AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32).eval()
    return path, reference, block


def test_an_fp8_checkpoint_loads_to_the_dequantized_models_logits(fp8_checkpoint):
    """Resident: dequantized at load. Offloaded: the experts stay FP8 in host memory where their scale blocks
    cut into 32-value row blocks (the copier dequantizes them on the device, the CPU kernel reads them as
    they are), and either miss path decodes transformers' tokens."""
    path, reference, block = fp8_checkpoint
    lm = load_model(path, device="cpu", dtype=torch.float32, progress=False)
    ids = prompt_ids()
    torch.testing.assert_close(lm.prefill_logits(ids), hf_logits(reference, ids), atol=1e-4, rtol=0)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    per_expert = lm.moe_spec.bytes_per_expert(torch.float32)
    offloaded = load_model(path, device="cpu", dtype=torch.float32, progress=False, expert_cache=3 * per_expert)
    host = offloaded.experts.host[0]
    if block[1] % 32 == 0:
        assert set(host.type_names.values()) == {"FP8_B32"}  # 1.125 bytes a weight, not 4 (fp32) or 2 (bf16)
        assert host.raw["gate_proj"].shape == (8, 32 * 64 // 32 * 36)
    else:
        assert isinstance(host, LayerExperts)
    for miss_path in ("copy", "cpu"):
        offloaded.experts.miss_path = miss_path
        assert Generator(offloaded).generate_ids(ids, greedy) == hf_greedy(reference, ids, 16), miss_path


def test_an_fp8_checkpoint_without_a_block_size_is_refused(fp8_checkpoint, tmp_path):
    path, _, _ = fp8_checkpoint
    for f in path.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="weight_block_size"):
        load_model(tmp_path, device="cpu", dtype=torch.float32, progress=False)
