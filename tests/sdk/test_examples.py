"""The README's SDK example runs as written, on the embedded model; the package ships marked as typed."""

from __future__ import annotations

import runpy
from pathlib import Path

EXAMPLE = Path(__file__).parents[2] / "examples" / "fork_two_strategies.py"


def test_the_fork_two_strategies_example_runs(smollm2_gguf, capsys):
    example = runpy.run_path(str(EXAMPLE))
    assert example["main"](str(smollm2_gguf)) in ("search", "reinstall")
    out = capsys.readouterr().out
    assert "kept '" in out and "reused" in out and "the winning branch goes on:" in out


def test_the_installed_package_is_marked_typed():
    """The SDK's annotations reach users' type checkers: the wheel ships the PEP 561 marker."""
    from importlib.resources import files

    assert files("freetoken").joinpath("py.typed").is_file()
