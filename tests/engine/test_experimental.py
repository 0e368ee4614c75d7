"""Unmeasured GPU paths stay off unless named in FREETOKEN_EXPERIMENTAL."""

from __future__ import annotations

import logging

import pytest

from freetoken.engine import experimental


@pytest.fixture(autouse=True)
def fresh_switches():
    experimental.enabled.cache_clear()
    experimental._named.cache_clear()
    yield
    experimental.enabled.cache_clear()
    experimental._named.cache_clear()


def test_paths_are_off_by_default(monkeypatch):
    monkeypatch.delenv("FREETOKEN_EXPERIMENTAL", raising=False)
    assert not any(experimental.enabled(path) for path in experimental.PATHS)


def test_named_paths_are_on_and_unknown_names_are_reported(monkeypatch, caplog):
    monkeypatch.setenv("FREETOKEN_EXPERIMENTAL", " paged-decode, warp-drive ")
    with caplog.at_level(logging.WARNING, logger="freetoken.engine.experimental"):
        assert experimental.enabled("paged-decode") and not experimental.enabled("grouped-mm")
    assert "warp-drive" in caplog.text


def test_asking_for_an_unknown_path_is_a_bug():
    with pytest.raises(ValueError, match="unknown experimental path 'fast'"):
        experimental.enabled("fast")
