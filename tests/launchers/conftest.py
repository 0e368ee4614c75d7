"""Launcher fixtures: a temporary HOME (the user's real one is never touched) and the embedded SmolLM2 behind a real
uvicorn for launches that ask a server what to configure."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.servers import start_server


@pytest.fixture(scope="module")
def launch_server(smollm2_gguf):
    from freetoken.engine.loader import load_model

    running = start_server(load_model(smollm2_gguf, progress=False), "smollm2")
    yield running
    running.stop()


@pytest.fixture
def home(tmp_path) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    return home
