"""The config files a launch edits: an agent's settings, as (key path, value) pairs, applied to a file's own text in
its own format, and the write that puts the result on disk.

Only the managed keys change; everything else in the file (comments, order, unknown keys) is kept byte for byte,
through `jsonish` for the JSON family and tomlkit for TOML. A file that does not parse is refused, never
overwritten. Writes are atomic (a temporary file beside the target, then a rename), so an interrupted launch leaves
either the old file or the new one.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from freetoken.errors import FreeTokenError
from freetoken.launchers import jsonish

FORMATS = ("json", "jsonc", "json5", "toml")
Setting = tuple[tuple[str, ...], object]  # (key path, value)


class ConfigFileError(FreeTokenError):
    """A config file cannot be read or parsed; nothing was written."""


@dataclass(frozen=True, slots=True)
class ConfigFile:
    """One file a launch manages: where it is, its format, and the values it must hold."""

    path: Path
    format: str
    settings: tuple[Setting, ...]
    private: bool = False  # it holds a key: a file created for it is readable by its owner only

    def render(self, old: str) -> str:
        """The file's new text, from its current text ("" when it does not exist)."""
        try:
            return apply_settings(old, self.format, self.settings)
        except jsonish.ConfigSyntaxError as e:
            raise ConfigFileError(f"{self.path} is not valid {self.format.upper()} ({e}); fix it or move it aside, "
                                  "then run this again (nothing was changed)") from None


def apply_settings(text: str, fmt: str, settings: tuple[Setting, ...]) -> str:
    if fmt == "toml":
        return _apply_toml(text, settings)
    if fmt not in jsonish.DIALECTS:
        raise ValueError(f"unknown config format {fmt!r}")
    for path, value in settings:
        text = jsonish.set_value(text, path, value, fmt)
    return text


def read_settings(text: str, fmt: str) -> dict:
    """The parsed file (for tests and previews); {} for an empty text."""
    if not text.strip():
        return {}
    if fmt == "toml":
        import tomlkit

        return tomlkit.parse(text).unwrap()
    return jsonish.loads(text, fmt)


def _apply_toml(text: str, settings: tuple[Setting, ...]) -> str:
    import tomlkit
    from tomlkit.exceptions import ParseError

    try:
        doc = tomlkit.parse(text)
    except ParseError as e:
        raise jsonish.ConfigSyntaxError(str(e)) from None
    created: dict[int, bool] = {}  # id of each new table → whether it needs a blank line after it
    for path, value in settings:
        table = doc
        for depth, key in enumerate(path[:-1]):
            if key not in table:
                # tomlkit separates new top-level tables itself, not a table added among an old one's children
                among_old = depth > 0 and id(table) not in created
                table[key] = tomlkit.table(is_super_table=depth < len(path) - 2)
                created[id(table[key])] = among_old and depth == len(path) - 2
            elif not isinstance(table[key], dict):
                raise jsonish.ConfigSyntaxError(f"{'.'.join(path[:depth + 1])} is a value, not a table")
            table = table[key]
        if table.get(path[-1]) != value or type(table.get(path[-1])) is not type(value):
            table[path[-1]] = value
    for path, _ in settings:  # a blank line after a new table, as people write them
        table = doc
        for key in path[:-1]:
            table = table[key]
        if created.pop(id(table), False):
            table.add(tomlkit.nl())
    new = tomlkit.dumps(doc)
    if text == "" or (text.endswith("\n") and not text.endswith("\n\n")):
        new = new.rstrip("\n") + "\n"  # no blank line at the end that the file did not have
    return text if new == text else new


def read_text(path: Path) -> str | None:
    """The file's text; None when it does not exist."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ConfigFileError(f"cannot read {path}: {e.strerror}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigFileError(f"{path} is not UTF-8 text; fix it or move it aside, then run this again "
                              "(nothing was changed)") from None


def write_atomic(path: Path, data: bytes, *, private: bool = False) -> None:
    """`data` at `path` by rename: the old file's mode is kept; a new file gets 0600 when `private`. A symlink
    (dotfiles kept in a repository) stays a link: its target is written."""
    if path.is_symlink():
        path = path.resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = path.stat().st_mode & 0o7777
    except FileNotFoundError:
        mode = 0o600 if private else 0o666 & ~_umask()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".ft-tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
