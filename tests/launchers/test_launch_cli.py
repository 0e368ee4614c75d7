"""`ft launch` as a user runs it (a real `ft` subprocess, a real server, a temporary HOME): dry runs change nothing,
launches back up, write and run the agent with the right environment and arguments, and `--restore` puts every
byte back. The agent here is a stand-in executable that records how it was started (the real CLIs run in
test_real_agents.py); everything of the launcher itself is real."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from support.launching import clean_env, run_ft

STAND_IN = f"""#!{sys.executable}
import json, os, sys
record = {{"argv": sys.argv[1:], "env": {{k: v for k, v in os.environ.items()}}}}
open(os.environ["STAND_IN_RECORD"], "w").write(json.dumps(record))
sys.exit(int(os.environ.get("STAND_IN_EXIT", "0")))
"""


def _stand_in(folder: Path, command: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / command
    path.write_text(STAND_IN)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def _env(home: Path, tmp_path: Path, **extra: str) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    for command in ("claude", "codex", "opencode", "openclaw"):
        _stand_in(bin_dir, command)
    env = clean_env(home, STAND_IN_RECORD=str(tmp_path / "record.json"), **extra)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    return env


def _record(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "record.json").read_text())


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_dry_run_prints_the_diff_and_environment_and_changes_nothing(launch_server, home, tmp_path):
    settings = home / ".claude" / "settings.json"
    settings.parent.mkdir()
    settings.write_text('{\n  "model": "opus"\n}\n')
    before = _tree(home)
    r = run_ft("launch", "claude", "--server", launch_server.url, "--dry-run",
               env=_env(home, tmp_path, ANTHROPIC_API_KEY="sk-cloud"))
    assert r.returncode == 0, r.stderr
    assert "--- a/~/.claude/settings.json" in r.stdout
    assert f'+    "ANTHROPIC_BASE_URL": "{launch_server.url}"' in r.stdout
    assert "set   ANTHROPIC_MODEL=smollm2" in r.stdout and "unset ANTHROPIC_API_KEY" in r.stdout
    assert _tree(home) == before and not (tmp_path / "record.json").exists()


def test_dry_run_with_no_server_works_when_the_model_is_named(home, tmp_path):
    env = _env(home, tmp_path)
    r = run_ft("launch", "codex", "--server", "http://127.0.0.1:9", "--dry-run", "--model", "m1", "--context",
               "65536", env=env)
    assert r.returncode == 0, r.stderr
    assert "+model_context_window = 65536" in r.stdout and "no server at" in r.stderr
    assert _tree(home) == {}
    r = run_ft("launch", "codex", "--server", "http://127.0.0.1:9", env=env)
    assert r.returncode == 2 and "start one with `ft serve`" in r.stderr and len(r.stderr.splitlines()) == 1


@pytest.mark.parametrize("agent, config", [
    ("claude", ".claude/settings.json"), ("codex", ".codex/freetoken.config.toml"),
    ("opencode", ".config/opencode/opencode.json"), ("openclaw", ".openclaw/openclaw.json"),
])
def test_launch_writes_runs_and_restore_puts_every_byte_back(agent, config, launch_server, home, tmp_path):
    path = home / config
    path.parent.mkdir(parents=True)
    original = b"{\n  // mine\n  \"keep\": 1,\n}\n" if agent in ("opencode", "openclaw") else \
        (b"# mine\nkeep = 1\n" if agent == "codex" else b'{\n  "keep": 1\n}\n')
    path.write_bytes(original)
    path.chmod(0o640)
    env = _env(home, tmp_path, OPENAI_API_KEY="sk-cloud", ANTHROPIC_API_KEY="sk-cloud")
    r = run_ft("launch", agent, "--server", launch_server.url, "-y", "--", "say", "hi", env=env)
    assert r.returncode == 0, r.stderr
    written = path.read_bytes()
    assert written != original and launch_server.url.encode() in written
    assert written.startswith(original.split(b"\n")[0]) and (b'"keep": 1' in written or b"keep = 1" in written)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    record = _record(tmp_path)
    assert record["argv"][-2:] == ["say", "hi"]
    assert "OPENAI_API_KEY" not in record["env"] and "ANTHROPIC_API_KEY" not in record["env"]
    if agent == "claude":
        assert record["env"]["ANTHROPIC_BASE_URL"] == launch_server.url
        assert record["env"]["CLAUDE_CODE_ATTRIBUTION_HEADER"] == "0"
    if agent == "codex":
        assert record["argv"][:2] == ["--profile", "freetoken"]

    again = run_ft("launch", agent, "--server", launch_server.url, "-y", env=env)  # nothing new to write
    assert again.returncode == 0 and "wrote" not in again.stderr and path.read_bytes() == written

    r = run_ft("launch", "--restore", agent, env=env)
    assert r.returncode == 0, r.stderr
    assert path.read_bytes() == original and stat.S_IMODE(path.stat().st_mode) == 0o640
    r = run_ft("launch", "--restore", agent, env=env)
    assert r.returncode == 2 and "nothing to restore" in r.stderr


def test_restore_removes_a_file_the_launch_created_and_keeps_later_hand_edits(launch_server, home, tmp_path):
    env = _env(home, tmp_path)
    assert run_ft("launch", "opencode", "--server", launch_server.url, "-y", env=env).returncode == 0
    path = home / ".config" / "opencode" / "opencode.json"
    assert path.exists()
    path.write_text(path.read_text().replace('"small_model"', '"theme": "x",\n  "small_model"'))  # a hand edit
    r = run_ft("launch", "--restore", "opencode", env=env)
    assert r.returncode == 0 and not path.exists()
    kept = [line for line in r.stdout.splitlines() if "is kept as" in line]
    assert kept and '"theme": "x"' in Path(kept[0].rsplit(" ", 1)[1]).read_text()


def test_a_corrupt_config_is_refused_and_left_alone(launch_server, home, tmp_path):
    path = home / ".codex" / "freetoken.config.toml"
    path.parent.mkdir()
    path.write_text("model = \n[broken\n")
    r = run_ft("launch", "codex", "--server", launch_server.url, "-y", env=_env(home, tmp_path))
    assert r.returncode == 2 and "not valid TOML" in r.stderr and "nothing was changed" in r.stderr
    assert path.read_text() == "model = \n[broken\n" and not (tmp_path / "record.json").exists()


def test_without_a_terminal_a_change_needs_yes(launch_server, home, tmp_path):
    r = run_ft("launch", "openclaw", "--server", launch_server.url, env=_env(home, tmp_path), stdin="")
    assert r.returncode == 2 and "give -y" in r.stderr and not (home / ".openclaw").exists()


def test_config_location_variables_are_respected(launch_server, home, tmp_path):
    where = tmp_path / "elsewhere"
    env = _env(home, tmp_path, CLAUDE_CONFIG_DIR=str(where / "claude"), CODEX_HOME=str(where / "codex"),
               OPENCODE_CONFIG=str(where / "oc.json"), OPENCLAW_CONFIG_PATH=str(where / "claw.json"))
    for agent in ("claude", "codex", "opencode", "openclaw"):
        assert run_ft("launch", agent, "--server", launch_server.url, "-y", env=env).returncode == 0
    assert sorted(p.name for p in where.rglob("*") if p.is_file()) == \
        ["claw.json", "freetoken.config.toml", "oc.json", "settings.json"]
    assert not any(p.is_file() for p in home.rglob("*") if "launch-backups" not in str(p))


def test_a_symlinked_config_stays_a_link_to_the_users_file(launch_server, home, tmp_path):
    dotfiles = tmp_path / "dotfiles" / "settings.json"
    dotfiles.parent.mkdir()
    dotfiles.write_text("{}\n")
    (home / ".claude").mkdir()
    (home / ".claude" / "settings.json").symlink_to(dotfiles)
    assert run_ft("launch", "claude", "--server", launch_server.url, "-y", env=_env(home, tmp_path)).returncode == 0
    assert (home / ".claude" / "settings.json").is_symlink() and "ANTHROPIC_BASE_URL" in dotfiles.read_text()


def test_no_persist_changes_no_file_and_passes_everything_in_the_environment(launch_server, home, tmp_path):
    r = run_ft("launch", "claude", "--server", launch_server.url, "--no-persist", env=_env(home, tmp_path))
    assert r.returncode == 0, r.stderr
    assert not (home / ".claude").exists() and _record(tmp_path)["env"]["ANTHROPIC_MODEL"] == "smollm2"


def test_the_agents_exit_status_is_launchs_and_a_missing_agent_names_the_fix(launch_server, home, tmp_path):
    env = _env(home, tmp_path, STAND_IN_EXIT="3")
    assert run_ft("launch", "claude", "--server", launch_server.url, "--no-persist", env=env).returncode == 3
    r = run_ft("launch", "codex", "--server", launch_server.url, "-y", env={**env, "PATH": "/usr/bin:/bin"})
    assert r.returncode == 2 and "ft launch codex --install" in r.stderr


def test_unknown_agent_and_bad_combinations_get_one_line(home, tmp_path):
    env = _env(home, tmp_path)
    for args, expected in ((["aider"], "unknown agent"), (["codex", "--no-persist"], "claude only"),
                           ([], "name an agent"), (["claude", "codex"], "one agent at a time")):
        r = run_ft("launch", *args, "--server", "http://127.0.0.1:9", env=env)
        assert r.returncode == 2 and expected in r.stderr and len(r.stderr.splitlines()) == 1, (args, r.stderr)


def test_codex_never_writes_config_toml_and_refuses_a_legacy_profile_there(launch_server, home, tmp_path):
    config = home / ".codex" / "config.toml"
    config.parent.mkdir()
    config.write_text('# mine\nmodel = "gpt-5.5"\n')
    env = _env(home, tmp_path)
    assert run_ft("launch", "codex", "--server", launch_server.url, "-y", env=env).returncode == 0
    assert config.read_text() == '# mine\nmodel = "gpt-5.5"\n'
    profile = (home / ".codex" / "freetoken.config.toml").read_text()
    assert 'model_provider = "freetoken"' in profile and 'wire_api = "responses"' in profile
    config.write_text('# mine\n[profiles.freetoken]\nmodel = "x"\n')  # what older Codex versions read
    r = run_ft("launch", "codex", "--server", launch_server.url, "-y", env=env)
    assert r.returncode == 2 and "legacy" in r.stderr and "nothing was changed" in r.stderr
    assert (home / ".codex" / "freetoken.config.toml").read_text() == profile


def test_a_server_with_an_api_key_gets_it_through_each_agents_own_route(smollm2_gguf, home, tmp_path):
    from freetoken.engine.loader import load_model
    from support.servers import start_server

    keyed = start_server(load_model(smollm2_gguf, progress=False), "smollm2", api_key="sekrit")
    try:
        env = _env(home, tmp_path)
        r = run_ft("launch", "codex", "--server", keyed.url, "-y", env=env)
        assert r.returncode == 2 and "--api-key" in r.stderr
        assert run_ft("launch", "codex", "--server", keyed.url, "--api-key", "sekrit", "-y", env=env).returncode == 0
        profile = (home / ".codex" / "freetoken.config.toml").read_text()
        assert 'env_key = "FREETOKEN_API_KEY"' in profile and "sekrit" not in profile  # the key stays out of it
        assert _record(tmp_path)["env"]["FREETOKEN_API_KEY"] == "sekrit"
        env["FREETOKEN_API_KEY"] = "sekrit"
        assert run_ft("launch", "claude", "--server", keyed.url, "-y", env=env).returncode == 0
        settings = home / ".claude" / "settings.json"
        assert '"ANTHROPIC_AUTH_TOKEN": "sekrit"' in settings.read_text()
        assert stat.S_IMODE(settings.stat().st_mode) == 0o600  # created holding a key: its owner's only
    finally:
        keyed.stop()
