"""Helpers shared by the decode and kernel tests. Some checks run in a fresh interpreter (Triton's interpreter
mode must be set before any kernel is defined), so they live here, importable from there, not in a test module."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest
import torch

from freetoken.engine.attention import StaticBatchAttention, StaticDecodeAttention
from support.checkpoints import prompt_ids


def static_window_equals_eager(lm, window: int, steps: int, tol: float) -> StaticDecodeAttention:
    """Decodes `steps` greedy tokens after the test prompt through a static window of `window` slots and through
    the eager path, asserting equal logits at every step; returns the static context."""
    eager_cache, static_cache = lm.new_cache(page_size=4), lm.new_cache(page_size=4, initial_tokens=128)
    eager_seq, static_seq = eager_cache.new_sequence(), static_cache.new_sequence()
    prompt = torch.tensor(prompt_ids())
    lm.forward(prompt, eager_cache, eager_seq)
    lm.forward(prompt, static_cache, static_seq)
    ctx = StaticDecodeAttention(static_cache, window=window)
    token = torch.tensor([7])
    with torch.inference_mode():
        for _ in range(steps):
            expected = lm.forward(token, eager_cache, eager_seq, "last")[0]
            static_cache.reserve(static_seq, 1)
            ctx.prepare(static_seq)
            got = lm.model(token, ctx, "last")[0]
            static_cache.commit(static_seq, 1)
            ctx.commit_state(static_seq)  # (recurrent layers: the state the step left in the static buffers)
            torch.testing.assert_close(got, expected, atol=tol, rtol=tol)
            token = expected.argmax().view(1)
    return ctx


def static_batch_equals_alone(lm, prompts: list[list[int]], steps: int = 6, pad: int = 2, window: int = 64,
                              tol: float = 1e-5) -> StaticBatchAttention:
    """Decodes the prompts together through a static batch of len(prompts) + `pad` rows (what a captured batched
    step runs; the padding rows on a scratch page) and each one alone, eagerly: equal logits at every step.
    Returns the static context."""
    eager_cache, static_cache = lm.new_cache(page_size=4), lm.new_cache(page_size=4, initial_tokens=256)
    eager = [eager_cache.new_sequence() for _ in prompts]
    static = [static_cache.new_sequence() for _ in prompts]
    with torch.inference_mode():
        for p, e, s in zip(prompts, eager, static, strict=True):
            lm.forward(torch.tensor(p), eager_cache, e)
            lm.forward(torch.tensor(p), static_cache, s)
        ctx = StaticBatchAttention(static_cache, len(prompts) + pad, window)
        scratch = static_cache.allocator.allocate(1)[0] * static_cache.page_size
        tokens = [7] * len(prompts)
        for _ in range(steps):
            expected = [lm.forward(torch.tensor([t]), eager_cache, e, "last")[0] for t, e in zip(tokens, eager,
                                                                                               strict=True)]
            for s in static:
                static_cache.reserve(s, 1)
            ctx.prepare(static, scratch)
            got = lm.model(torch.tensor(tokens + [0] * pad), ctx, "all")
            for s in static:
                static_cache.commit(s, 1)
            assert got.shape[0] == len(prompts) + pad
            for g, want in zip(got, expected, strict=False):
                torch.testing.assert_close(g, want, atol=tol, rtol=tol)
            tokens = [int(e.argmax()) for e in expected]
    return ctx


def batched_equals_alone(lm, prompts: list[list[int]], tol: float = 1e-5) -> None:
    """The prompts in one batched forward (continuous batching): each one's last logits equal its own run's."""
    alone = [lm.prefill_logits(p)[-1] for p in prompts]
    cache = lm.new_cache(page_size=4)
    seqs = [cache.new_sequence() for _ in prompts]
    with torch.inference_mode():
        logits = lm.forward_batch(torch.tensor([t for p in prompts for t in p]), cache, seqs,
                                  [len(p) for p in prompts])
    for got, want in zip(logits, alone, strict=True):
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def run_fresh(script: str, *args: str, interpret: bool, env: dict | None = None) -> None:
    """Runs `script` in a fresh interpreter (Triton's interpreter on when `interpret`) with the tests' support
    package importable, from a directory outside the source tree (so the installed package is what imports);
    asserts it printed "ok" last."""
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    full_env = dict(os.environ, TRITON_INTERPRET="1" if interpret else "0", **(env or {}))
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (tests, full_env.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, "-c", script, *args], env=full_env, capture_output=True, text=True,
                          timeout=600, cwd=tempfile.gettempdir())
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr


# Triton's interpreter stands in for the GPU where there is none (CI). With a GPU the compiled kernels are tested
# instead, and the interpreter of some Triton releases cannot run these kernels (3.6 with numpy 2 rejects a
# runtime loop bound: "only 0-dimensional arrays can be converted to Python scalars", seen on the H200 machine).
interpreter_only = pytest.mark.skipif(torch.cuda.is_available(),
                                      reason="a GPU is present: the compiled kernel's tests run instead")
# (device, interpret) of a kernel check: under the interpreter without a GPU, compiled on CUDA with one
KERNEL_RUNS = [pytest.param("cpu", True, marks=interpreter_only, id="interpreter"),
               pytest.param("cuda", False, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
                            id="compiled-cuda")]



def gguf_matches_transformers(path, reference, tokens: int = 24):
    """The GGUF at `path` gives transformers' fp32 logits (within 1e-4) and `tokens` greedy tokens, resident and
    with its routed experts offloaded below the pool; returns the resident model."""
    from freetoken.engine.generator import Generator
    from freetoken.engine.loader import load_model
    from freetoken.engine.sampling import SamplingParams
    from support.checkpoints import divergence_report, hf_greedy, hf_logits, prompt_ids

    lm = load_model(path, device="cpu", dtype=torch.float32, progress=False)
    ids = prompt_ids()
    torch.testing.assert_close(lm.prefill_logits(ids), hf_logits(reference, ids), atol=1e-4, rtol=0)
    expected = hf_greedy(reference, ids, tokens)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    offloaded = load_model(path, device="cpu", dtype=torch.float32, progress=False,
                           expert_cache=3 * lm.moe_spec.bytes_per_expert(torch.float32))
    for model in (lm, offloaded):
        ours = Generator(model).generate_ids(ids, params)
        assert ours == expected, divergence_report(reference, ids, ours, expected)
    return lm
