"""gpt-oss against transformers on a tiny random checkpoint written with transformers' own config class: attention
sinks, sliding-window layers (a window shorter than the prompt), biases on every projection, a biased router, the
clamped SwiGLU with expert biases, YaRN without truncation. fp32 logits within 1e-4, 32 greedy tokens equal to
`generate`, across prefill chunks, with the experts offloaded below the pool, batched, and from the static decode
window. The MXFP4 layout OpenAI ships (blocks + scales) loads to the same model."""

from __future__ import annotations

import pytest
import torch

from freetoken.engine.generator import Generator
from freetoken.engine.loader import load_model
from freetoken.engine.sampling import SamplingParams
from support.checkpoints import divergence_report, hf_greedy, hf_logits, prompt_ids, write_hf_checkpoint

GREEDY_32 = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss")
    reference = write_hf_checkpoint("gpt_oss", path)
    return path, reference, hf_greedy(reference, prompt_ids(), 32)


@pytest.fixture(scope="module")
def lm(checkpoint):
    return load_model(checkpoint[0], device="cpu", dtype=torch.float32, progress=False)


def test_the_model_reads_its_layers_and_experts(lm):
    layers = lm.model.model.layers
    assert [layer.self_attn.window for layer in layers] == [8, None, 8, None]
    assert lm.moe_spec.moe_layers == (0, 1, 2, 3) and lm.moe_spec.top_k == 2
    form = lm.experts.layers[0].form
    assert form.clamped and form.limit == 1.5 and form.gate_bias.shape == (8, 32) and form.down_bias.shape == (8, 64)


def test_prefill_logits_match_transformers(checkpoint, lm):
    ids = prompt_ids()
    assert len(ids) > 3 * 8  # well past the sliding window
    torch.testing.assert_close(lm.prefill_logits(ids), hf_logits(checkpoint[1], ids), atol=1e-4, rtol=0)
    torch.testing.assert_close(lm.prefill_logits([5]), hf_logits(checkpoint[1], [5]), atol=1e-4, rtol=0)


def test_greedy_tokens_match_transformers(checkpoint, lm):
    _, reference, expected = checkpoint
    ours = Generator(lm).generate_ids(prompt_ids(), GREEDY_32)
    assert ours == expected, divergence_report(reference, prompt_ids(), ours, expected)


def test_greedy_across_prefill_chunks_and_pages(checkpoint, lm):
    """Chunks of 5 into pages of 4: each chunk's window reaches back into the previous chunks."""
    _, reference, expected = checkpoint
    ours = Generator(lm, prefill_chunk=5, page_size=4).generate_ids(prompt_ids(), GREEDY_32)
    assert ours == expected, divergence_report(reference, prompt_ids(), ours, expected)


def test_offloaded_experts_give_the_same_greedy_tokens(checkpoint):
    """A cache of 5 slots for 32 routed experts, misses computed on the CPU kernel (biases, clamped SwiGLU)."""
    path, reference, expected = checkpoint
    probe = load_model(path, device="cpu", dtype=torch.float32, progress=False)
    per_expert = probe.moe_spec.bytes_per_expert(torch.float32)
    for miss_path in ("copy", "cpu"):
        lm = load_model(path, device="cpu", dtype=torch.float32, progress=False, expert_cache=5 * per_expert)
        lm.experts.miss_path = miss_path
        ours = Generator(lm).generate_ids(prompt_ids(), GREEDY_32)
        assert ours == expected, f"{miss_path}: " + divergence_report(reference, prompt_ids(), ours, expected)
        counters = lm.experts.counters
        assert counters.misses > 0 and (counters.evictions > 0 or miss_path == "cpu")


def test_batched_sequences_match_their_single_runs(lm):
    """Two prompts of different lengths in one forward (continuous batching): each one's last logits equal its
    own run's, windows and sinks applied per sequence."""
    from support.decode_checks import batched_equals_alone

    batched_equals_alone(lm, [prompt_ids(), prompt_ids("<|im_start|>user\nHow many trees grow by the river?"
                                                       "<|im_end|>\n")])


def test_the_static_decode_window_equals_eager_decode(lm):
    """What a captured decode step runs (sinks and the sliding window masked in the static window), eagerly."""
    from support.decode_checks import static_window_equals_eager

    static_window_equals_eager(lm, window=64, steps=6, tol=1e-5)


def test_a_static_batch_step_equals_each_sequence_alone(lm):
    """What a captured batched decode step runs (sinks and windows per row, padding rows), eagerly."""
    from support.decode_checks import static_batch_equals_alone

    static_batch_equals_alone(lm, [prompt_ids(), prompt_ids("<|im_start|>user\nHow many trees?<|im_end|>\n")])


def _mxfp4_copy(path, reference, out):
    """OpenAI's layout: experts as MXFP4 blocks [E, out, in/32, 16] and scales [E, out, in/32], out-by-in, gate
    and up rows interleaved. Random codes are written that way into a copy of the checkpoint at `path` and,
    dequantized, into a copy of its transformers model (the reference, returned)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from freetoken.kernels.mxfp4.reference import dequantize_mxfp4

    gen = torch.Generator().manual_seed(7)
    tensors = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(f))
    model = reference.__class__(reference.config).eval()
    model.load_state_dict(reference.state_dict())
    for mine, theirs in zip(model.model.layers, reference.model.layers, strict=True):  # (see write_hf_checkpoint)
        mine.mlp.experts.limit = theirs.mlp.experts.limit
    for i, layer in enumerate(model.model.layers):
        experts = layer.mlp.experts
        for name in ("gate_up_proj", "down_proj"):
            param = getattr(experts, name)  # [E, in, out]
            e, inp, width = param.shape
            blocks = torch.randint(0, 256, (e, width, inp // 32, 16), dtype=torch.uint8, generator=gen)
            scales = torch.randint(124, 128, (e, width, inp // 32), dtype=torch.uint8, generator=gen)
            with torch.no_grad():
                param.copy_(dequantize_mxfp4(blocks, scales).transpose(1, 2))
            key = f"model.layers.{i}.mlp.experts.{name}"
            del tensors[key]
            tensors[key + "_blocks"], tensors[key + "_scales"] = blocks, scales
    save_file(tensors, out / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                         "model.layers.*.mlp.router"]}
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(path / name, out / name)
    return model


@pytest.fixture(scope="module")
def mxfp4_checkpoint(checkpoint, tmp_path_factory):
    path, reference, _ = checkpoint
    out = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    return out, _mxfp4_copy(path, reference, out)


def test_mxfp4_checkpoints_load_to_the_same_model(mxfp4_checkpoint):
    """Resident: the MXFP4 experts dequantized at load give the reference's logits; `ft info` tells their
    format and bytes (17 per 32 weights)."""
    from freetoken.engine.model_info import describe

    path, model = mxfp4_checkpoint
    assert "3.19 KiB per expert (MXFP4)" in describe(str(path))  # 3 × 32 × 64 weights × 17 / 32 bytes
    loaded = load_model(path, device="cpu", dtype=torch.float32, progress=False)
    ids = prompt_ids()
    # these MXFP4 scales give logits up to ~6.6 (mean 1.3), so fp32 summation order (another CPU's BLAS: 1.4e-4 on
    # an AMD EPYC) is allowed its relative share too; the relative error of the whole is ~5e-6
    torch.testing.assert_close(loaded.prefill_logits(ids), hf_logits(model, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_graphs_and_offloaded_experts_give_the_greedy_tokens(checkpoint):
    """On the GPU: decode captured in CUDA graphs (sinks and windows in the static window, the gathered experts'
    biases), and offloaded with the misses split between copies and the CPU kernel, both as transformers."""
    path, reference, expected = checkpoint
    lm = load_model(path, device="cuda", dtype=torch.float32, progress=False)
    assert Generator(lm, cuda_graphs=True).generate_ids(prompt_ids(), GREEDY_32) == expected
    per_expert = lm.moe_spec.bytes_per_expert(torch.float32)
    offloaded = load_model(path, device="cuda", dtype=torch.float32, progress=False, expert_cache=5 * per_expert)
    for graphs in (False, True):
        ours = Generator(offloaded, cuda_graphs=graphs).generate_ids(prompt_ids(), GREEDY_32)
        assert ours == expected, f"graphs={graphs}: " + divergence_report(reference, prompt_ids(), ours, expected)


def test_offloaded_mxfp4_experts_stay_mxfp4_in_host_memory(mxfp4_checkpoint):
    """With experts offloaded, the MXFP4 release stays MXFP4 in the host store (ggml blocks, 17 bytes per 32
    weights: what crosses PCIe and what the CPU kernel reads), and decodes the tokens transformers decodes."""
    path, reference = mxfp4_checkpoint
    expected = hf_greedy(reference, prompt_ids(), 32)
    lm = load_model(path, device="cpu", dtype=torch.float32, progress=False, expert_cache=1 << 20)
    host = lm.experts.host[0]
    assert set(host.type_names.values()) == {"MXFP4"} and host.form is not None
    assert host.raw["gate_proj"].shape == (8, 32 * 64 // 32 * 17)
    for miss_path in ("copy", "cpu"):
        lm.experts.miss_path = miss_path
        ours = Generator(lm).generate_ids(prompt_ids(), GREEDY_32)
        assert ours == expected, f"{miss_path}: " + divergence_report(reference, prompt_ids(), ours, expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_offloaded_mxfp4_experts_dequantize_in_one_launch(mxfp4_checkpoint):
    """On the GPU the MXFP4 experts cross PCIe as ggml blocks and one fused Triton launch per batch dequantizes
    them into their slots (kernels/gguf_dequant/fused.py); greedy tokens as transformers, copies and CPU alike."""
    path, reference = mxfp4_checkpoint
    expected = hf_greedy(reference, prompt_ids(), 32)
    lm = load_model(path, device="cuda", dtype=torch.float32, progress=False, expert_cache=1 << 20)
    assert lm.experts.copier.fused
    for miss_path in ("copy", "cpu", "auto"):
        lm.experts.miss_path = miss_path
        ours = Generator(lm).generate_ids(prompt_ids(), GREEDY_32)
        assert ours == expected, f"{miss_path}: " + divergence_report(reference, prompt_ids(), ours, expected)

# -- GGUF, as llama.cpp's converter writes gpt-oss (tests/support/gguf_gpt_oss.py) --


@pytest.fixture(scope="module")
def clamp7(tmp_path_factory):
    """A checkpoint with the SwiGLU clamp every release uses (7.0): GGUF files do not state it."""
    path = tmp_path_factory.mktemp("gpt_oss_clamp7")
    return path, write_hf_checkpoint("gpt_oss", path, swiglu_limit=7.0)


def test_a_gguf_of_the_checkpoint_loads_to_the_same_model(clamp7, tmp_path):
    from support.gguf_gpt_oss import write_gpt_oss_gguf

    path, reference = clamp7
    gguf_path = write_gpt_oss_gguf(path, tmp_path / "gpt-oss.gguf")
    lm = load_model(gguf_path, device="cpu", dtype=torch.float32, progress=False)
    args = lm.args
    assert args.sliding_layers == (0, 2) and args.sliding_window == 8 and args.swiglu_limit == 7.0
    ids = prompt_ids()
    torch.testing.assert_close(lm.prefill_logits(ids), hf_logits(reference, ids), atol=1e-4, rtol=0)
    expected = hf_greedy(reference, ids, 32)
    ours = Generator(lm).generate_ids(ids, GREEDY_32)
    assert ours == expected, divergence_report(reference, ids, ours, expected)


def test_an_mxfp4_gguf_keeps_its_experts_mxfp4_and_gives_the_same_model(clamp7, tmp_path):
    """OpenAI's MXFP4 experts as ggml blocks (checked against gguf-py's own dequantizer): resident they give the
    reference's logits; offloaded they stay MXFP4 in the host store, for the copies and the CPU kernel."""
    import gguf

    from freetoken.kernels.mxfp4.reference import dequantize_mxfp4
    from support.gguf_gpt_oss import mxfp4_to_ggml_blocks, write_gpt_oss_gguf

    path, base = clamp7
    (tmp_path / "hf").mkdir()
    reference = _mxfp4_copy(path, base, tmp_path / "hf")
    blocks = torch.randint(0, 256, (2, 3, 2, 16), dtype=torch.uint8)
    scales = torch.randint(120, 130, (2, 3, 2), dtype=torch.uint8)
    theirs = gguf.quants.dequantize(mxfp4_to_ggml_blocks(blocks, scales), gguf.GGMLQuantizationType.MXFP4)
    torch.testing.assert_close(torch.from_numpy(theirs), dequantize_mxfp4(blocks, scales).float(), atol=0, rtol=0)
    gguf_path = write_gpt_oss_gguf(tmp_path / "hf", tmp_path / "gpt-oss-mxfp4.gguf")
    ids = prompt_ids()
    resident = load_model(gguf_path, device="cpu", dtype=torch.float32, progress=False)
    torch.testing.assert_close(resident.prefill_logits(ids), hf_logits(reference, ids), atol=1e-4, rtol=0)
    expected = hf_greedy(reference, ids, 32)
    lm = load_model(gguf_path, device="cpu", dtype=torch.float32, progress=False, expert_cache=1 << 20)
    host = lm.experts.host[0]
    assert set(host.type_names.values()) == {"MXFP4"} and host.form is not None
    for miss_path in ("copy", "cpu"):
        lm.experts.miss_path = miss_path
        ours = Generator(lm).generate_ids(ids, GREEDY_32)
        assert ours == expected, f"{miss_path}: " + divergence_report(reference, ids, ours, expected)


def test_the_gguf_writer_uses_gguf_pys_names_for_gpt_oss():
    """The test writer's names are those gguf-py's own map gives the HF names (the sinks get `.weight` first, as
    in the converter); the split experts' names too."""
    import gguf

    from support.gguf_gpt_oss import _LAYER

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, 4)
    for hf, ours in _LAYER.items():
        hf = hf if hf.endswith((".weight", ".bias")) else hf + ".weight"
        assert names.get_name(f"model.layers.1.{hf}", try_suffixes=(".weight", ".bias")) == f"blk.1.{ours}"
    for part in ("gate", "up", "down"):
        for kind in ("weight", "bias"):
            got = names.get_name(f"model.layers.1.mlp.experts.{part}_proj.{kind}", try_suffixes=(".weight", ".bias"))
            assert got == f"blk.1.ffn_{part}_exps.{kind}"
