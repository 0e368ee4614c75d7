"""The graph-capturable decode path: fixed-shape attention over a masked window, sync-free expert execution,
and (on CUDA) replayed CUDA graphs — each must reproduce the eager path."""

from __future__ import annotations

import pytest
import torch

from freetoken.engine.attention import causal_attention, static_decode_attention
from freetoken.engine.experts import LayerExperts, gathered_expert_forward, grouped_expert_forward
from freetoken.engine.generator import Generator
from freetoken.engine.loader import load_model
from freetoken.engine.sampling import SamplingParams
from support.checkpoints import PARITY_CASES, prompt_ids, write_hf_checkpoint
from support.decode_checks import interpreter_only, run_fresh, static_batch_equals_alone, static_window_equals_eager


def test_gathered_experts_equal_grouped_experts():
    g = torch.Generator().manual_seed(0)
    e, h, i, n, k = 6, 16, 24, 5, 2
    experts = LayerExperts(*(torch.randn(shape, generator=g) for shape in ((e, i, h), (e, i, h), (e, h, i))))
    hidden = torch.randn(n, h, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    weights = torch.rand(n, k, generator=g)
    torch.testing.assert_close(gathered_expert_forward(experts, hidden, ids, weights),
                               grouped_expert_forward(experts, hidden, ids, weights), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (6, 6), (4, 1)])
def test_static_decode_attention_equals_causal_attention_over_the_valid_keys(heads, kv_heads):
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    window, n, d = 40, 29, 16
    q = torch.randn(1, heads, d, generator=g)
    keys, values = torch.randn(window, kv_heads, d, generator=g), torch.randn(window, kv_heads, d, generator=g)
    keys[n:] = 1e4  # masked slots hold garbage: it must not leak into the result
    valid = torch.arange(window) < n
    expected = causal_attention(q, keys[:n], values[:n], past=n - 1)
    torch.testing.assert_close(static_decode_attention(q, keys, values, valid), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ["llama", "qwen3_moe", "qwen2_moe", "mixtral"])
def test_static_window_decode_equals_eager_decode(case, tmp_path):
    write_hf_checkpoint(path=tmp_path, **PARITY_CASES[case])
    lm = load_model(tmp_path, device="cpu", dtype=torch.float32)
    static_window_equals_eager(lm, window=64, steps=12, tol=1e-5)


@pytest.mark.parametrize("case", ["llama", "qwen3_moe", "qwen2_moe", "mixtral"])
def test_a_static_batch_step_with_padding_rows_equals_each_sequence_alone(case, tmp_path):
    """What a captured batched decode step runs, eagerly: three sequences of different lengths and one padding row."""
    write_hf_checkpoint(path=tmp_path, **PARITY_CASES[case])
    lm = load_model(tmp_path, device="cpu", dtype=torch.float32)
    static_batch_equals_alone(lm, [prompt_ids(), prompt_ids("Hi"), prompt_ids("A longer prompt, with more words")],
                              pad=1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("paged", [True, False], ids=["paged", "gathered"])
@pytest.mark.parametrize("case", ["llama", "qwen3_moe", "qwen2_moe", "mixtral"])
def test_cuda_graph_decode_equals_eager_decode_across_windows(case, paged, tmp_path, monkeypatch):
    """Attending through the paged kernel, one step is captured, over the cache's whole capacity; gathering the
    keys, the first capture (at the capacity) shows it, and the sequence then crosses two power-of-two windows."""
    from freetoken.engine import cuda_graphs, gpu_paths

    if not paged:
        enabled = gpu_paths.enabled
        monkeypatch.setattr(gpu_paths, "enabled", lambda name: name != "paged-decode" and enabled(name))
    monkeypatch.setattr(cuda_graphs, "MIN_WINDOW", 64)  # the tiny models' context is only 256
    write_hf_checkpoint(path=tmp_path, **PARITY_CASES[case])
    lm = load_model(tmp_path, device="cuda", dtype=torch.float32)
    ids = (prompt_ids() * 20)[:100]  # 100 + 40 tokens crosses the 128-slot window into the 256 one
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    graphed = Generator(lm, cuda_graphs=True, max_seq_len=1024)
    eager = Generator(lm, cuda_graphs=False)
    expected = eager.generate_ids(ids, params)
    assert graphed.generate_ids(ids, params) == expected
    assert graphed.generate_ids(ids, params) == expected  # replays the graphs captured by the first call
    decoder = graphed._graphs
    if paged:
        assert decoder.in_place and set(decoder.captured) == {(1, decoder.capacity)}
    else:
        assert decoder.in_place is False
        assert set(decoder.captured) == {(1, decoder.capacity), (1, 128), (1, 256)}


BATCH_TEXTS = [f"Sequence number {i} says" + " more" * i for i in range(10)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("dtype, offload, paged", [(torch.float32, False, False), (torch.float32, True, False),
                                                   (torch.bfloat16, False, False), (torch.float32, False, True)],
                         ids=["fp32", "fp32-offloaded", "bf16", "fp32-batch-paged-decode"])
def test_on_cuda_a_captured_batched_step_equals_the_eager_one(dtype, offload, paged, tmp_path, monkeypatch):
    """Ten sequences replay the captured step of 16 (six padding rows on a borrowed page): the logits of the eager
    batched step at each of 8 steps. bf16 on sm90 captures the grouped expert matmuls (20 pairs: past gathering);
    offloaded, the step is captured in segments with the expert calls between them, on the real rows only; with
    "batch-paged-decode" its attention is the paged Triton kernel over all 16 rows (in fp32: in bf16 its fp32
    arithmetic, not the eager SDPA's, flips a near-tied routing choice of the random model on the H200)."""
    from freetoken.engine import gpu_paths
    from freetoken.engine.cuda_graphs import GraphedDecoder

    if paged:
        pytest.importorskip("triton")
    else:  # the gathering form (the paged kernel's fp32 arithmetic would flip bf16's near-tied routing)
        enabled = gpu_paths.enabled
        monkeypatch.setattr(gpu_paths, "enabled", lambda name: name != "batch-paged-decode" and enabled(name))

    write_hf_checkpoint(path=tmp_path, **PARITY_CASES["qwen3_moe"])
    lm = load_model(tmp_path, device="cuda", dtype=dtype, progress=False)
    if offload:
        lm = load_model(tmp_path, device="cuda", dtype=dtype, progress=False,
                        expert_cache=3 * lm.moe_spec.bytes_per_expert(dtype))
    eager_cache = lm.new_cache(16, initial_tokens=1024)
    graph_cache = lm.new_cache(16, initial_tokens=1024, max_tokens=1024)
    prompts = [prompt_ids(t) for t in BATCH_TEXTS]
    eager, graphed = [eager_cache.new_sequence() for _ in prompts], [graph_cache.new_sequence() for _ in prompts]
    decoder = GraphedDecoder(lm, graph_cache)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    with torch.inference_mode():
        for p, e, g in zip(prompts, eager, graphed, strict=True):
            lm.forward(torch.tensor(p, device="cuda"), eager_cache, e)
            lm.forward(torch.tensor(p, device="cuda"), graph_cache, g)
        tokens = [7] * len(prompts)
        for _ in range(8):
            want = lm.forward_batch(torch.tensor(tokens, device="cuda"), eager_cache, eager, [1] * len(prompts))
            got = decoder.step_batch(graphed, tokens)
            torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
            tokens = want.argmax(-1).tolist()
    assert set(decoder.captured) == {(16, 256)}
    assert (decoder.captured[(16, 256)].ctx._paged is not None) == paged
    for seq in graphed:
        graph_cache.release(seq)
    assert graph_cache.allocator.num_free == graph_cache.allocator.num_pages  # the padding rows' page came back


PAGED_CHECK = """
import sys
import torch
from freetoken.engine.loader import load_model
from freetoken.kernels.paged_decode import kernel
from support.checkpoints import PARITY_CASES, prompt_ids, write_hf_checkpoint
from support.decode_checks import static_batch_equals_alone, static_window_equals_eager

kernel.available = lambda device: True  # Triton's interpreter stands in for the GPU
for case in ("llama", "qwen3_moe"):
    path = f"{sys.argv[1]}/{case}"
    write_hf_checkpoint(path=path, **PARITY_CASES[case])
    lm = load_model(path, device="cpu", dtype=torch.float32, progress=False)
    ctx = static_window_equals_eager(lm, window=96, steps=4, tol=1e-4)
    assert ctx._paged is not None and ctx._paged.splits > 1, case
    ctx = static_batch_equals_alone(lm, [prompt_ids(), prompt_ids("Hi")], window=96, tol=1e-4)  # + 2 padding rows
    assert ctx._paged is not None and ctx._paged.batch == 4, case
print("ok")
"""


@interpreter_only
def test_paged_decode_kernel_in_the_static_window_equals_eager_decode(tmp_path):
    """With the "paged-decode" GPU path (on by default), the captured step's attention is the split-KV Triton kernel,
    and with "batch-paged-decode" (on by default too) a captured batched step's (here under Triton's interpreter, in a
    fresh process: TRITON_INTERPRET must be set before it is defined)."""
    pytest.importorskip("triton")
    run_fresh(PAGED_CHECK, str(tmp_path), interpret=True)
