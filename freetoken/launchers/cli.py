"""`ft launch AGENT`: points a coding agent at the running `ft serve`, then runs it.

    ft launch AGENT [--server URL] [--model ID] [--dry-run] [-y] [--install] [--no-persist] [-- AGENT ARGS]
    ft launch --restore AGENT
    ft launch --install-only AGENT [AGENT ...]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from freetoken.errors import FreeTokenError
from freetoken.launchers import AGENTS
from freetoken.launchers.agent import Agent, Options
from freetoken.launchers.backups import Backups
from freetoken.launchers.install import find_command, install
from freetoken.launchers.launch import changes, child_environment, is_interactive, preview, run, write
from freetoken.launchers.server_probe import DEFAULT_URL, ServerDown, describe_server, offline_target


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ft launch", description="Configure a coding agent for the local server and "
                                "run it. Every file is backed up before its first change; --restore puts it back.",
                                epilog="agents: " + ", ".join(f"{a.name} ({a.title})" for a in AGENTS.values()))
    p.add_argument("agent", nargs="*", metavar="AGENT", help="|".join(AGENTS))
    p.add_argument("--server", default=os.environ.get("FREETOKEN_URL", DEFAULT_URL),
                   help=f"the freetoken server (default {DEFAULT_URL}, or $FREETOKEN_URL)")
    p.add_argument("--model", help="the model name to configure (default: the one the server serves)")
    p.add_argument("--api-key", default=os.environ.get("FREETOKEN_API_KEY"),
                   help="the server's --api-key, if it has one (default: $FREETOKEN_API_KEY)")
    p.add_argument("--context", type=int, help="for --dry-run with no server: the context window to show")
    p.add_argument("--dry-run", action="store_true", help="print the diff of every file and the environment; "
                   "change nothing, run nothing")
    p.add_argument("-y", "--yes", action="store_true", help="write the config without asking")
    p.add_argument("--install", action="store_true", help="install the agent from npm if it is missing")
    p.add_argument("--install-only", action="store_true", help="install (or pin) the agents from npm, then exit")
    p.add_argument("--no-persist", action="store_true", help="change no file: the environment only (claude)")
    p.add_argument("--restore", action="store_true", help="put the agent's files back as they were before the "
                   "first launch")
    return p


def _agent(name: str) -> Agent:
    if name not in AGENTS:
        raise FreeTokenError(f"unknown agent {name!r}; choose one of {', '.join(AGENTS)}")
    return AGENTS[name]


def main(verb: str, argv: list[str]) -> int:
    argv = list(argv)
    agent_args = argv[argv.index("--") + 1:] if "--" in argv else []
    a = _parser().parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if not a.agent:
        raise FreeTokenError(f"name an agent: ft launch {'|'.join(AGENTS)}")
    if a.install_only:
        for name in a.agent:
            agent = _agent(name)
            print(f"{name}: {install(agent.package, name)}")
        return 0
    if len(a.agent) > 1:
        raise FreeTokenError(f"launch one agent at a time (got {', '.join(a.agent)})")
    agent = _agent(a.agent[0])
    if a.restore:
        for line in Backups(agent.name).restore():
            print(line)
        return 0
    return _launch(agent, a, tuple(agent_args))


def _launch(agent: Agent, a: argparse.Namespace, agent_args: tuple[str, ...]) -> int:
    if a.no_persist and agent.name != "claude":
        raise FreeTokenError(f"--no-persist works for claude only: {agent.title} reads its provider from a file")
    try:
        target = describe_server(a.server, a.api_key, model=a.model)
    except ServerDown:
        if not (a.dry_run and a.model):
            raise
        target = offline_target(a.server, a.model, a.api_key, a.context)
        print(f"# no server at {a.server}: showing the config for {a.model} with a {target.context}-token context",
              file=sys.stderr)
    options = Options(home=Path.home(), environ=os.environ, args=agent_args, persist=not a.no_persist)
    plan = agent.plan(target, options)
    planned = changes(plan)
    if a.dry_run:
        sys.stdout.write(preview(plan, planned, agent.package.command, options.home, os.environ))
        return 0
    found = find_command(agent.package, agent.name)
    if found is None:
        if not a.install:
            raise FreeTokenError(f"{agent.package.command} is not installed; run `ft launch {agent.name} --install` "
                                 f"(npm install {agent.package.spec}) or put it on PATH")
        found = (install(agent.package, agent.name), {})
        found = find_command(agent.package, agent.name) or found
    pending = [c for c in planned if c.changed]
    if pending and not a.yes:
        names = ", ".join(str(c.file.path) for c in pending)
        if not is_interactive():
            raise FreeTokenError(f"this launch changes {names}; give -y to write it (backed up first; "
                                 f"`ft launch --restore {agent.name}` undoes it), or --dry-run to see the diff")
        reply = input(f"write {names}? (backed up first; `ft launch --restore {agent.name}` undoes it) [Y/n] ")
        if reply.strip().lower() not in ("", "y", "yes"):
            print("nothing was changed", file=sys.stderr)
            return 1
    for path in write(agent.name, planned):
        print(f"ft launch: wrote {path}", file=sys.stderr)
    command, extra = found
    print(f"ft launch: {agent.title} → {target.url} ({target.model}, {target.context}-token context)",
          file=sys.stderr, flush=True)
    return run(command, plan, child_environment(plan, os.environ, extra))


if __name__ == "__main__":
    sys.exit(main("launch", sys.argv[1:]))
