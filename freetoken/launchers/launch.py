"""One launch, from its plan: the changes it makes (each file's old and new text), their preview (a unified diff
and the environment), the write (backup first, then atomic), and the agent's run."""

from __future__ import annotations

import difflib
import os
import signal
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from freetoken.launchers.agent import LaunchPlan
from freetoken.launchers.backups import Backups
from freetoken.launchers.config_files import ConfigFile, read_text, write_atomic


@dataclass(frozen=True, slots=True)
class Change:
    file: ConfigFile
    old: str | None  # None: the file does not exist yet
    new: str

    @property
    def changed(self) -> bool:
        return self.old != self.new


def changes(plan: LaunchPlan) -> list[Change]:
    """What writing `plan` would do to each of its files; raises `ConfigFileError` (nothing written) for a file
    that cannot be parsed."""
    out = []
    for file in plan.files:
        old = read_text(file.path)
        out.append(Change(file, old, file.render(old or "")))
    return out


def _shown(path: Path, home: Path) -> str:
    try:
        return "~/" + str(path.relative_to(home))
    except ValueError:
        return str(path)


def preview(plan: LaunchPlan, planned: list[Change], command: str, home: Path, environ: Mapping[str, str]) -> str:
    """The dry run: a unified diff of every file that would change, then the environment and the command."""
    lines = []
    for change in planned:
        name = _shown(change.file.path, home)
        if not change.changed:
            lines.append(f"# {name}: already up to date")
            continue
        old = (change.old or "").splitlines(keepends=True)
        diff = difflib.unified_diff(old, change.new.splitlines(keepends=True),
                                    "/dev/null" if change.old is None else f"a/{name}", f"b/{name}")
        lines.append("".join(d if d.endswith("\n") else d + "\n\\ No newline at end of file\n" for d in diff))
    for name, value in plan.env.items():
        lines.append(f"set   {name}={value}")
    present = [name for name in plan.unset if name in environ]
    lines.append(f"unset {' '.join(present)}" if present else
                 f"unset nothing: none of the {len(plan.unset)} cloud-key variables it removes is set here")
    lines.append("run   " + " ".join([command, *plan.argv]))
    return "\n".join(line.rstrip("\n") for line in lines) + "\n"


def write(agent: str, planned: list[Change], backups: Backups | None = None) -> list[Path]:
    """Writes the files that change, each backed up before its first change; returns the paths written."""
    backups = backups or Backups(agent)
    written = []
    for change in planned:
        if not change.changed:
            continue
        path = change.file.path
        backups.keep(path, None if change.old is None else change.old.encode())
        data = change.new.encode()
        write_atomic(path, data, private=change.file.private)
        backups.wrote(path, data)
        written.append(path)
    return written


def child_environment(plan: LaunchPlan, environ: Mapping[str, str], extra: Mapping[str, str]) -> dict[str, str]:
    env = {k: v for k, v in environ.items() if k not in plan.unset}
    return {**env, **extra, **plan.env}


def run(command: Path, plan: LaunchPlan, env: Mapping[str, str]) -> int:
    """Runs the agent in this terminal and returns its exit status. Ctrl-C belongs to the agent while it runs."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        proc = subprocess.Popen([str(command), *plan.argv], env=dict(env),
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        return proc.wait()
    except OSError as e:
        from freetoken.errors import FreeTokenError

        raise FreeTokenError(f"could not start {command}: {e.strerror}") from None
    finally:
        signal.signal(signal.SIGINT, previous)


def is_interactive() -> bool:
    return os.isatty(0) and os.isatty(1)
