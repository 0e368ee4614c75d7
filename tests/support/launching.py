"""Running `ft launch` as a user does: a real `ft` subprocess with a temporary HOME and nothing of the real user's
configuration in its environment."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

FT = shutil.which("ft", path=str(Path(sys.executable).parent)) or shutil.which("ft")


def clean_env(home: Path, **extra: str) -> dict[str, str]:
    """The environment of a user whose HOME is `home`: no config-location variables, no freetoken state elsewhere."""
    drop = ("CLAUDE_CONFIG_DIR", "CODEX_HOME", "OPENCODE_CONFIG", "OPENCLAW_CONFIG_PATH", "XDG_CONFIG_HOME",
            "XDG_STATE_HOME", "FREETOKEN_HOME", "FREETOKEN_URL", "FREETOKEN_API_KEY")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    return {**env, "HOME": str(home), "FREETOKEN_AGENTS_DIR": str(home / "no-agents"), **extra}


def run_ft(*args: str, env: dict[str, str], timeout: int = 120, stdin: str | None = None, cwd: Path | None = None):
    return subprocess.run([FT, *args], capture_output=True, text=True, timeout=timeout, env=env, input=stdin, cwd=cwd)
