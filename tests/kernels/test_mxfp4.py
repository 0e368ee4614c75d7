"""MXFP4 dequantization (plain torch) against transformers' own gpt-oss converter on random blocks and scales."""

from __future__ import annotations

import pytest
import torch

from freetoken.kernels.mxfp4.reference import dequantize_mxfp4


def test_dequantization_equals_transformers_on_random_data():
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), generator=gen, dtype=torch.int64).to(torch.uint8)
    scales = torch.randint(110, 140, (3, 10, 4), generator=gen, dtype=torch.int64).to(torch.uint8)
    ours = dequantize_mxfp4(blocks, scales)  # [3, 10, 128]
    theirs = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # gpt-oss layout: transposed
    torch.testing.assert_close(ours, theirs.transpose(1, 2).reshape(ours.shape), atol=0, rtol=0)


def test_known_values_and_shape_errors():
    blocks = torch.tensor([[[0x21] + [0] * 15]], dtype=torch.uint8)  # low nibble 1 (0.5), high 2 (1.0)
    got = dequantize_mxfp4(blocks, torch.tensor([[128]], dtype=torch.uint8))  # scale 2^1
    assert got[0, :2].tolist() == [1.0, 2.0] and not got[0, 2:].any()
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4(blocks, torch.tensor([[1, 2]], dtype=torch.uint8))
