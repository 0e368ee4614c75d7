"""What each agent's launcher writes, as golden files: into no config at all, and into a config a person already
has (comments, their own providers and settings), which must survive byte for byte outside the managed keys.

FREETOKEN_UPDATE_GOLDEN=1 rewrites the golden files (then read the diff before committing it).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from freetoken.launchers import AGENTS
from freetoken.launchers.agent import Options, Target
from freetoken.launchers.config_files import read_settings

GOLDEN = Path(__file__).parent / "golden"
TARGET = Target("http://127.0.0.1:1919", "qwen3-coder", 65536, 16384)
SUFFIX = {"json": "json", "jsonc": "jsonc", "json5": "json5", "toml": "toml"}

# a config each agent's user might already have
EXISTING = {
    "claude": """{
  "model": "opus",
  "permissions": {
    "allow": ["Bash(git status)"]
  },
  "env": {
    "MY_OWN": "1"
  },
  "statusLine": {"type": "command", "command": "~/bin/status"}
}
""",
    "codex": """# my notes on this profile
model = "old-model"  # replaced by the launch
approval_policy = "on-request"

[model_providers.freetoken]
name = "freetoken"
base_url = "http://127.0.0.1:9999/v1"
wire_api = "responses"

[mcp_servers.docs]
command = "docs-mcp"
""",
    "opencode": """{
  "$schema": "https://opencode.ai/config.json",
  // my providers
  "provider": {
    "work": { "npm": "@ai-sdk/openai-compatible", "options": { "baseURL": "https://gateway.example/v1" } },
  },
  "model": "work/big", // the usual one
  "keybinds": { "leader": "ctrl+x" },
}
""",
    "openclaw": """// OpenClaw
{
  agents: {
    defaults: {
      workspace: '~/agents', // where it works
      model: { primary: 'work/big', fallbacks: ['work/small'] },
    },
  },
  models: {
    mode: 'merge',
    providers: {
      work: { baseUrl: 'https://gateway.example/v1', api: 'openai-completions', models: [], },
    },
  },
}
""",
}


# the lines of EXISTING that hold a managed key's old value: the only ones a launch may change
MANAGED_LINES = {
    "codex": {'model = "old-model"  # replaced by the launch', 'base_url = "http://127.0.0.1:9999/v1"'},
    "opencode": {'  "model": "work/big", // the usual one'},
    "openclaw": {"      model: { primary: 'work/big', fallbacks: ['work/small'] },"},
}


def _plan(name: str, tmp_path: Path):
    return AGENTS[name].plan(TARGET, Options(home=tmp_path, environ={}))


def _check_golden(path: Path, text: str) -> None:
    if os.environ.get("FREETOKEN_UPDATE_GOLDEN"):
        path.write_text(text)
    assert path.exists(), f"{path} is missing; run with FREETOKEN_UPDATE_GOLDEN=1"
    assert text == path.read_text(), f"{path.name} changed; FREETOKEN_UPDATE_GOLDEN=1 rewrites it"


@pytest.mark.parametrize("name", AGENTS)
def test_a_fresh_config_is_the_golden_one(name, tmp_path):
    (file,) = _plan(name, tmp_path).files
    _check_golden(GOLDEN / f"{name}-fresh.{SUFFIX[file.format]}", file.render(""))


@pytest.mark.parametrize("name", AGENTS)
def test_an_existing_config_keeps_every_byte_outside_the_managed_keys(name, tmp_path):
    (file,) = _plan(name, tmp_path).files
    old = EXISTING[name]
    new = file.render(old)
    _check_golden(GOLDEN / f"{name}-existing.{SUFFIX[file.format]}", new)
    kept = iter(new.splitlines())
    for line in old.splitlines():  # in order; a line the launch completes (a comma added) may end differently
        if line not in MANAGED_LINES.get(name, ()):
            assert any(c == line or c == line + "," for c in kept), f"{name}: the line {line!r} did not survive"
    assert file.render(new) == new  # a second launch changes nothing


@pytest.mark.parametrize("name", AGENTS)
def test_the_written_config_reads_back_with_the_servers_values(name, tmp_path):
    (file,) = _plan(name, tmp_path).files
    doc = read_settings(file.render(EXISTING[name]), file.format)
    flat = repr(doc)
    assert "127.0.0.1:1919" in flat and "qwen3-coder" in flat
    if name == "codex":  # Codex has no output-budget setting
        assert doc["model_context_window"] == 65536 and doc["mcp_servers"]["docs"]["command"] == "docs-mcp"
    elif name != "claude":
        assert "65536" in flat and "16384" in flat
    else:
        assert doc["env"]["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "16384" and doc["env"]["MY_OWN"] == "1"
