"""`ft launch`: one small declarative module per coding agent (claude, codex, opencode, openclaw), each rendering
its files, environment and argv from the running server; `launch.py` previews, writes, runs and restores them."""

from __future__ import annotations

from freetoken.launchers import claude, codex, openclaw, opencode

AGENTS = {agent.name: agent for agent in (claude.AGENT, codex.AGENT, opencode.AGENT, openclaw.AGENT)}
