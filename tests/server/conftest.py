"""Server fixtures: the embedded SmolLM2 behind a real uvicorn."""

from __future__ import annotations

import pytest

from support.servers import start_server


@pytest.fixture(scope="module")
def smollm2_server(smollm2_gguf):
    from freetoken.engine.loader import load_model

    running = start_server(load_model(smollm2_gguf, progress=False), "smollm2", model_aliases=frozenset({"alias"}))
    yield running
    running.stop()
