"""Finding an agent's executable, and `--install`: the agent's pinned npm package in a folder of its own
(`$FREETOKEN_AGENTS_DIR`, else `<state>/agents/<agent>`), with a Node.js from npm (`node@N`) when the machine's is too
old for it. npm's registry is the only source: no `curl | sh`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from freetoken.errors import FreeTokenError
from freetoken.launchers.agent import NpmPackage
from freetoken.launchers.backups import state_dir


def agents_dir() -> Path:
    if root := os.environ.get("FREETOKEN_AGENTS_DIR"):
        return Path(root).expanduser()
    return state_dir() / "agents"


def node_version(node: str | None = None) -> tuple[int, int] | None:
    node = node or shutil.which("node")
    if not node:
        return None
    try:
        out = subprocess.run([node, "--version"], capture_output=True, text=True, timeout=30).stdout
    except OSError:
        return None
    m = re.match(r"v(\d+)\.(\d+)", out.strip())
    return (int(m.group(1)), int(m.group(2))) if m else None


def _own_node_bin(package: NpmPackage) -> Path:
    return agents_dir() / f"node{package.node[0]}" / "node_modules" / "node" / "bin"


def find_command(package: NpmPackage, agent: str) -> tuple[Path, dict[str, str]] | None:
    """The agent's executable and the environment it needs (PATH with our Node first), or None: ours (installed by
    `--install`) first, then the one on PATH."""
    extra: dict[str, str] = {}
    if package.node and _own_node_bin(package).is_dir():
        extra["PATH"] = f"{_own_node_bin(package)}{os.pathsep}{os.environ.get('PATH', '')}"
    ours = agents_dir() / agent / "node_modules" / ".bin" / package.command
    if ours.exists():
        return ours, extra
    found = shutil.which(package.command)
    return (Path(found), extra) if found else None


def install(package: NpmPackage, agent: str) -> Path:
    """Installs the pinned package (npm's progress on stderr) and returns its executable."""
    npm = shutil.which("npm")
    if not npm:
        raise FreeTokenError(f"installing {package.spec} needs npm; install Node.js 20 or newer with npm (e.g. "
                             "`sudo apt install nodejs npm`), then run this again")
    env = dict(os.environ)
    if package.node and (node_version() or (0, 0)) < package.node:
        env = _with_own_node(package, npm, env)
    folder = agents_dir() / agent
    folder.mkdir(parents=True, exist_ok=True)
    # a package.json and a bare `npm install`: Node 24's npm drops the package argument of `--prefix DIR PKG`
    (folder / "package.json").write_text(json.dumps({"private": True, "dependencies": {package.name:
                                                                                       package.version}}) + "\n")
    print(f"installing {package.spec} into {folder} (npm) …", file=sys.stderr, flush=True)
    _npm(["install", "--no-audit", "--no-fund", "--loglevel=error"], folder, env)
    found = folder / "node_modules" / ".bin" / package.command
    if not found.exists():
        raise FreeTokenError(f"npm installed {package.spec} but {found} is missing; see npm's output above")
    return found


def _with_own_node(package: NpmPackage, npm: str, env: dict[str, str]) -> dict[str, str]:
    """Node `package.node` or newer from npm's `node@MAJOR`, first on PATH; npm under that Node no longer finds the
    system's global npmrc (where a proxy or CA file may be), so it is named."""
    major = package.node[0]
    folder = agents_dir() / f"node{major}"
    if (node_version(str(_own_node_bin(package) / "node")) or (0, 0)) < package.node:
        print(f"{package.spec} needs Node.js {major}.{package.node[1]}+; installing node@{major} into {folder} (npm) …",
              file=sys.stderr, flush=True)
        folder.mkdir(parents=True, exist_ok=True)
        _npm(["install", "--no-audit", "--no-fund", "--loglevel=error", "--prefix", str(folder), f"node@{major}"],
             folder, env)
    globalconfig = subprocess.run([npm, "config", "get", "globalconfig"], capture_output=True, text=True,
                                  env=env).stdout.strip()
    env = {**env, "PATH": f"{_own_node_bin(package)}{os.pathsep}{env.get('PATH', '')}"}
    if globalconfig:
        env["NPM_CONFIG_GLOBALCONFIG"] = globalconfig
    return env


def _npm(args: list[str], cwd: Path, env: dict[str, str]) -> None:
    npm = shutil.which("npm", path=env.get("PATH"))
    result = subprocess.run([npm, *args], cwd=cwd, env=env, stdout=sys.stderr)
    if result.returncode != 0:
        raise FreeTokenError(f"`npm {' '.join(args)}` failed (exit {result.returncode}); see npm's output above")
