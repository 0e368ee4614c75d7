"""Measured GPU paths are on unless named in FREETOKEN_DISABLE; unmeasured ones stay off unless named in
FREETOKEN_EXPERIMENTAL."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from freetoken.engine import gpu_paths

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def fresh_switches():
    gpu_paths.enabled.cache_clear()
    gpu_paths._named.cache_clear()
    yield
    gpu_paths.enabled.cache_clear()
    gpu_paths._named.cache_clear()


def test_measured_paths_are_on_by_default(monkeypatch):
    monkeypatch.delenv("FREETOKEN_DISABLE", raising=False)
    assert all(gpu_paths.enabled(path) for path in gpu_paths.MEASURED)


def test_disabled_paths_are_off_and_unknown_names_are_reported(monkeypatch, caplog):
    monkeypatch.setenv("FREETOKEN_DISABLE", " paged-decode, warp-drive ")
    with caplog.at_level(logging.WARNING, logger="freetoken.engine.gpu_paths"):
        assert not gpu_paths.enabled("paged-decode") and gpu_paths.enabled("grouped-mm")
    assert "warp-drive" in caplog.text


def test_experimental_paths_need_naming(monkeypatch):
    monkeypatch.setitem(gpu_paths.EXPERIMENTAL, "warp-drive", "a path under test")
    monkeypatch.delenv("FREETOKEN_EXPERIMENTAL", raising=False)
    assert not gpu_paths.enabled("warp-drive")
    gpu_paths.enabled.cache_clear()
    gpu_paths._named.cache_clear()
    monkeypatch.setenv("FREETOKEN_EXPERIMENTAL", "warp-drive")
    assert gpu_paths.enabled("warp-drive")


def test_each_measured_path_names_a_committed_result():
    for path, (_, result) in gpu_paths.MEASURED.items():
        assert (REPO / result).is_file(), f"{path}: {result} is missing"


def test_asking_for_an_unknown_path_is_a_bug():
    with pytest.raises(ValueError, match="unknown GPU path 'fast'"):
        gpu_paths.enabled("fast")
