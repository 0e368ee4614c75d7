"""The four real agent CLIs from npm, each launched by `ft launch` against a real `ft serve` and completing a turn.

The server is a real `ft serve` subprocess with the tiny agent model (support/agent_model.py: SmolLM2's tokenizer
and template, a 64k context, replies "Hello"). Each agent runs non-interactively with a fresh HOME, no cloud keys,
under a timeout (Codex never exits while its server is unreachable). A turn passes when the agent exits 0, prints
the model's reply, and the server's log shows the agent's requests on its own protocol.

The CLIs are those `ft launch --install-only` put in `$FREETOKEN_AGENTS_DIR` (.ci/run does it, pinned versions).
Where they are missing the tests skip, unless `FREETOKEN_REQUIRE_AGENTS` is set (as .ci/run sets it): then they
fail.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from freetoken.launchers import AGENTS
from freetoken.launchers.install import find_command
from support.agent_model import write_agent_model
from support.launching import clean_env, run_ft
from support.serve_process import serve_process

# agent → (its non-interactive turn, the request path its protocol uses)
TURNS = {
    "claude": (["-p", "say hi", "--output-format", "json"], "POST /v1/messages?beta=true 200"),
    "codex": (["exec", "--skip-git-repo-check", "--ephemeral", "say hi"], "POST /v1/responses 200"),
    "opencode": (["run", "--format", "json", "say hi"], "POST /v1/chat/completions 200"),
    "openclaw": (["agent", "exec", "--json", "say hi"], "POST /v1/chat/completions 200"),
}
TURN_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def agent_server(tmp_path_factory, smollm2_gguf):
    folder = tmp_path_factory.mktemp("agent-server")
    with serve_process(write_agent_model(folder / "agent-model.gguf", smollm2_gguf), folder) as server:
        yield server.url, server.log_path


def _installed(agent: str) -> Path:
    found = find_command(AGENTS[agent].package, agent)
    if found is None or not str(found[0]).startswith(os.environ.get("FREETOKEN_AGENTS_DIR", "\0")):
        message = f"{agent} is not installed in $FREETOKEN_AGENTS_DIR (ft launch --install-only {agent})"
        if os.environ.get("FREETOKEN_REQUIRE_AGENTS"):
            pytest.fail(message)
        pytest.skip(message)
    return found[0]


@pytest.mark.parametrize("agent", TURNS)
def test_the_real_agent_completes_a_turn_through_ft_launch(agent, agent_server, tmp_path):
    _installed(agent)
    url, log_path = agent_server
    home = tmp_path / "home"
    home.mkdir()
    work = tmp_path / "work"  # the agent's working directory: an empty project
    work.mkdir()
    env = clean_env(home, FREETOKEN_AGENTS_DIR=os.environ["FREETOKEN_AGENTS_DIR"], TERM="dumb",
                    CLAUDE_CODE_MAX_RETRIES="0", OPENAI_API_KEY="sk-cloud-must-not-leak")
    logged_before = len(log_path.read_text())
    args, request_line = TURNS[agent]
    try:
        r = run_ft("launch", agent, "--server", url, "-y", "--", *args, env=env, timeout=TURN_TIMEOUT_S, stdin="",
                   cwd=work)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{agent} did not finish its turn in {TURN_TIMEOUT_S} s; server log:\n{log_path.read_text()}"
                    f"\nits output:\n{e.stdout}\n{e.stderr}")
    detail = f"exit {r.returncode}\nstdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"
    assert r.returncode == 0, detail
    assert "Hello" in r.stdout, detail
    served = log_path.read_text()[logged_before:]
    assert request_line in served, f"no {request_line!r} in the server's log of this turn:\n{served}"
    assert not re.search(r" [45]\d\d in ", served), f"the server refused some of {agent}'s requests:\n{served}"
