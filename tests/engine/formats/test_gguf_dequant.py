"""The plain-torch dequantisers against gguf.quants.dequantize (ggml's layouts, re-implemented in numpy)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from freetoken.kernels.gguf_dequant.reference import BLOCK_SIZES, OWN_FORMATS, dequantize

QUANT_TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "MXFP4"]
# byte offsets of each block's fp16 scale fields (d, and m / dmin where the type has one)
SCALE_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
                "MXFP4": ()}


def _random_blocks(type_name: str, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes (every quant bit pattern) with small finite fp16 scales, as [n_blocks, bytes_per_block]."""
    blocks = rng.integers(0, 256, (n_blocks, BLOCK_SIZES[type_name][1]), dtype=np.uint8)
    for at in SCALE_FIELDS[type_name]:
        scales = rng.uniform(-2.0, 2.0, (n_blocks, 1)).astype(np.float16)
        blocks[:, at : at + 2] = scales.view(np.uint8)
    if type_name == "MXFP4":  # E8M0 scale bytes around 2^0, the two smallest (subnormal halves) included
        blocks[:, 0] = rng.integers(110, 146, n_blocks, dtype=np.uint8)
        blocks[:2, 0] = (0, 1)
    return blocks


def _ours(blocks: np.ndarray, type_name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    n_elements = blocks.shape[0] * BLOCK_SIZES[type_name][0]
    return dequantize(torch.from_numpy(blocks.reshape(-1).copy()), type_name, n_elements, dtype)


def _assert_matches(blocks: np.ndarray, type_name: str) -> None:
    expected = gguf.quants.dequantize(blocks, Q[type_name]).reshape(-1).astype(np.float32)
    got = _ours(blocks, type_name).numpy()
    assert got.shape == expected.shape
    tol = 1e-6 * max(1.0, float(np.abs(expected).max()))
    assert np.array_equal(got, expected) or np.abs(got - expected).max() <= tol


def test_block_sizes_match_ggml() -> None:
    for name, sizes in BLOCK_SIZES.items():
        if name not in OWN_FORMATS:
            assert gguf.GGML_QUANT_SIZES[Q[name]] == sizes


@pytest.mark.parametrize("type_name", QUANT_TYPES)
def test_random_blocks_match_gguf(type_name: str) -> None:
    _assert_matches(_random_blocks(type_name, 97, np.random.default_rng(7)), type_name)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1"])
def test_quantized_weights_match_gguf(type_name: str) -> None:
    x = np.random.default_rng(3).standard_normal((5, 256)).astype(np.float32)
    blocks = gguf.quants.quantize(x, Q[type_name]).reshape(-1, BLOCK_SIZES[type_name][1])
    _assert_matches(blocks, type_name)
    # and the round trip lands near the original weights
    assert np.abs(_ours(blocks, type_name).numpy().reshape(x.shape) - x).max() < 0.5


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_quantize_when_available(type_name: str) -> None:
    x = np.random.default_rng(5).standard_normal((2, 512)).astype(np.float32)
    try:
        blocks = gguf.quants.quantize(x, Q[type_name])
    except NotImplementedError:
        pytest.skip(f"gguf {type_name} has no quantize(); random blocks cover it")
    _assert_matches(blocks.reshape(-1, BLOCK_SIZES[type_name][1]), type_name)


@pytest.mark.parametrize(("type_name", "np_dtype"), [("F32", np.float32), ("F16", np.float16)])
def test_float_types(type_name: str, np_dtype: type) -> None:
    x = np.random.default_rng(0).standard_normal(40).astype(np_dtype)
    raw = torch.from_numpy(np.frombuffer(x.tobytes(), dtype=np.uint8).copy())
    assert np.array_equal(dequantize(raw, type_name, 40).numpy(), x.astype(np.float32))
    # a 1-byte misaligned slice still decodes (one copy instead of a dtype view)
    shifted = torch.cat((torch.zeros(1, dtype=torch.uint8), raw))[1:]
    assert np.array_equal(dequantize(shifted, type_name, 40).numpy(), x.astype(np.float32))


def test_bf16() -> None:
    x = np.random.default_rng(0).standard_normal(64).astype(np.float32)
    raw = gguf.quants.quantize(x, Q.BF16).reshape(-1)
    expected = gguf.quants.dequantize(raw, Q.BF16).reshape(-1)
    got = dequantize(torch.from_numpy(raw.copy()), "BF16", 64)
    assert np.array_equal(got.numpy(), expected)


@pytest.mark.parametrize("type_name", QUANT_TYPES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_output_dtype_is_a_cast_of_fp32(type_name: str, dtype: torch.dtype) -> None:
    blocks = _random_blocks(type_name, 4, np.random.default_rng(11))
    got = _ours(blocks, type_name, dtype)
    assert got.dtype == dtype and torch.equal(got, _ours(blocks, type_name).to(dtype))


def test_rejects_bad_arguments() -> None:
    raw = torch.zeros(34, dtype=torch.uint8)
    with pytest.raises(ValueError, match="unsupported ggml type 'IQ4_NL'"):
        dequantize(raw, "IQ4_NL", 32)
    with pytest.raises(ValueError, match="multiple of the Q8_0 block size 32"):
        dequantize(raw, "Q8_0", 33)
    with pytest.raises(ValueError, match="needs 68 bytes, got 34"):
        dequantize(raw, "Q8_0", 64)
    with pytest.raises(ValueError, match="1-D uint8"):
        dequantize(raw.view(2, 17), "Q8_0", 32)
