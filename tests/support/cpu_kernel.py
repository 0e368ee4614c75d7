"""Shared by the CPU expert kernel's tests: random expert matrices in every format the kernel reads."""

from __future__ import annotations

import contextlib

import torch

from freetoken.kernels.cpu_experts.bench import random_q8_0
from freetoken.kernels.cpu_experts.reference import ExpertMatrix
from freetoken.kernels.fp8_block.reference import to_row_blocks
from freetoken.kernels.mxfp4.reference import to_gguf_blocks


def expert_matrix(fmt: str, experts: int, out: int, inp: int, gen: torch.Generator) -> ExpertMatrix:
    """`experts` random [out, inp] matrices in format `fmt` (Q8_0, FP8_B32, MXFP4, F32 or BF16), values ~0.1."""
    if fmt == "Q8_0":
        return ExpertMatrix(random_q8_0(experts, out, inp, 0.1, gen), "Q8_0", (out, inp))
    if fmt == "FP8_B32":  # every e4m3 byte but the NaNs, scales of 2-D 16 x 32 blocks
        codes = torch.randint(0, 256, (experts, out, inp), dtype=torch.uint8, generator=gen)
        codes[(codes & 0x7F) == 0x7F] = 0
        scale_inv = torch.rand(experts, -(-out // 16), inp // 32, generator=gen) * 0.002
        rows = [to_row_blocks(codes[e].view(torch.float8_e4m3fn), scale_inv[e], (16, 32)) for e in range(experts)]
        return ExpertMatrix(torch.stack(rows).reshape(experts, -1), "FP8_B32", (out, inp))
    if fmt == "MXFP4":  # random codes, scales near 2^-4 (values up to 0.75) and a few tiny (subnormal) ones
        blocks = torch.randint(0, 256, (experts, out, inp // 32, 16), dtype=torch.uint8, generator=gen)
        scales = torch.randint(121, 125, (experts, out, inp // 32), dtype=torch.uint8, generator=gen)
        scales[0, 0, 0], scales[-1, -1, -1] = 0, 1
        return ExpertMatrix(to_gguf_blocks(blocks, scales).reshape(experts, -1), "MXFP4", (out, inp))
    dtype = {"F32": torch.float32, "BF16": torch.bfloat16}[fmt]
    return ExpertMatrix.of((torch.randn(experts, out, inp, generator=gen) * 0.1).to(dtype))


@contextlib.contextmanager
def without_q16_rows(kernel):
    """Q8_0 experts of a bf16 model at 2-5 tokens per expert off the 16-row int16 path (q16_rows.h), for tests of
    the paths it takes precedence over; a no-op where the build has no such path."""
    before = kernel.lib.ft_set_q16_rows(1)
    try:
        yield
    finally:
        if before >= 0:
            kernel.lib.ft_set_q16_rows(before)


NEVER = 1 << 30  # a token count no expert reaches: ft_set_block_bf16(NEVER) keeps the fp32 path


@contextlib.contextmanager
def block_bf16_from(kernel, tokens: int):
    """Block-format experts of a bf16 model on the bf16 dot path from `tokens` per expert on (NEVER: fp32 path);
    yields the threshold it replaced (the kernel's default)."""
    before = kernel.lib.ft_set_block_bf16(tokens)
    try:
        yield before
    finally:
        kernel.lib.ft_set_block_bf16(before)


def random_routing(tokens: int, experts: int, k: int, gen: torch.Generator):
    """Top-k routing of every token, grouped by expert (CSR), with one expert listed but given no tokens."""
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    listed = sorted(set(ids.flatten().tolist()) | {experts - 1})
    offsets, pair_tokens = [0], []
    for e in listed:
        mine = (ids == e).any(dim=1).nonzero().flatten().tolist()
        pair_tokens += mine
        offsets.append(len(pair_tokens))
    return (torch.tensor(listed, dtype=torch.int32), torch.tensor(offsets, dtype=torch.int32),
            torch.tensor(pair_tokens, dtype=torch.int32), torch.rand(len(pair_tokens), generator=gen))
