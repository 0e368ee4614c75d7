"""The README's SDK example runs as written, on the embedded model; the package ships marked as typed."""

from __future__ import annotations

import runpy
from pathlib import Path

EXAMPLE = Path(__file__).parents[2] / "examples" / "fork_two_strategies.py"


def test_the_fork_two_strategies_example_runs(smollm2_gguf, capsys):
    """Each branch calls its own tool (forced by tool_choice), the search's findings win, and the winner goes on
    after its tool result, from the history the fork shared."""
    example = runpy.run_path(str(EXAMPLE))
    assert example["main"](str(smollm2_gguf)) == "search_source"
    out = capsys.readouterr().out
    assert "kept 'search_source'" in out and "app/cli.py:1: from app.text import parse" in out
    reused = int(out.split("reused ")[1].split()[0])
    assert reused > 100  # the branch's call started on the history it shares with its parent
    assert "the winning branch goes on: " in out and out.split("the winning branch goes on: ")[1].strip()


def test_the_installed_package_is_marked_typed():
    """The SDK's annotations reach users' type checkers: the wheel ships the PEP 561 marker."""
    from importlib.resources import files

    assert files("freetoken").joinpath("py.typed").is_file()
