"""Backups of the files a launch changes, and `ft launch --restore`.

Before a launch first changes a file, its bytes (or the fact that it did not exist) are kept under
`<state>/launch-backups/<agent>/`. Later launches keep that first backup, so a restore puts every file back as it was
before the *first* launch, byte for byte; a file the launch created is removed. The backups go once restored.
A file edited by hand since the last launch wrote it is copied beside the backups before it is replaced, and the
restore says where: restoring loses nothing either.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from freetoken.errors import FreeTokenError
from freetoken.launchers.config_files import write_atomic


def state_dir() -> Path:
    """freetoken's own state (backups, installed agents): `$FREETOKEN_HOME`, else `$XDG_STATE_HOME/freetoken`, else
    ~/.local/state/freetoken. Not the cache: a cache may be wiped, a backup must not be."""
    if home := os.environ.get("FREETOKEN_HOME"):
        return Path(home).expanduser()
    if xdg := os.environ.get("XDG_STATE_HOME"):
        return Path(xdg).expanduser() / "freetoken"
    return Path.home() / ".local" / "state" / "freetoken"


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Backups:
    """One agent's backups: a manifest (path → whether it existed, its backup's name, what the launch wrote)."""

    def __init__(self, agent: str, root: Path | None = None) -> None:
        self.dir = (root or state_dir()) / "launch-backups" / agent
        self.agent = agent
        self._manifest_path = self.dir / "manifest.json"

    def _load(self) -> dict:
        try:
            return json.loads(self._manifest_path.read_text())
        except FileNotFoundError:
            return {"files": {}}
        except (OSError, json.JSONDecodeError) as e:
            raise FreeTokenError(f"the backup manifest {self._manifest_path} is unreadable ({e}); the backups "
                                 f"beside it are the originals, copy them back by hand") from None

    def _save(self, manifest: dict) -> None:
        write_atomic(self._manifest_path, json.dumps(manifest, indent=2).encode(), private=True)

    def has(self, path: Path) -> bool:
        return str(path) in self._load()["files"]

    def keep(self, path: Path, original: bytes | None) -> None:
        """Backs `path` up before its first change (`original` None: it does not exist); later calls keep the
        first backup."""
        manifest = self._load()
        if str(path) in manifest["files"]:
            return
        entry: dict = {"existed": original is not None}
        if original is not None:
            entry["mode"] = path.stat().st_mode & 0o7777
            entry["backup"] = f"{len(manifest['files'])}-{path.name}.orig"
            write_atomic(self.dir / entry["backup"], original, private=True)
        manifest["files"][str(path)] = entry
        self._save(manifest)

    def wrote(self, path: Path, data: bytes) -> None:
        manifest = self._load()
        manifest["files"][str(path)]["written"] = _digest(data)
        self._save(manifest)

    def restore(self) -> list[str]:
        """Puts every backed-up file back; one line per file saying what was done."""
        manifest = self._load()
        if not manifest["files"]:
            raise FreeTokenError(f"nothing to restore for {self.agent}: `ft launch {self.agent}` has not changed "
                                 "its files since the last restore")
        said = []
        for number, (name, entry) in enumerate(manifest["files"].items()):
            path = Path(name)
            current = path.read_bytes() if path.exists() else None
            if current is not None and _digest(current) != entry.get("written"):  # edited since: kept
                kept = self.dir.parent / f"{self.agent}-replaced-{number}-{path.name}"
                write_atomic(kept, current, private=True)
                said.append(f"{path}: it changed after the launch; that version is kept as {kept}")
            if entry["existed"]:
                write_atomic(path, (self.dir / entry["backup"]).read_bytes())
                os.chmod(path, entry["mode"])
                said.append(f"restored {path}")
            elif current is not None:
                path.unlink()
                said.append(f"removed {path} (the launch created it)")
        for entry in manifest["files"].values():
            if "backup" in entry:
                (self.dir / entry["backup"]).unlink(missing_ok=True)
        self._manifest_path.unlink()
        return said
