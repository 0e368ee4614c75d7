"""Claude Code: the `env` block of its settings.json (`$CLAUDE_CONFIG_DIR/settings.json`, else
~/.claude/settings.json), or the same variables in its environment only (`--no-persist`).

It speaks Anthropic Messages (`POST /v1/messages?beta=true`). Besides the endpoint and the model for every role,
the variables keep it offline (no telemetry, error reports or updates), tell it the server's context window and
output budget (for a model it does not know it assumes a far larger window and 32k-token replies), and drop the
per-request attribution header, whose hash at the top of the system prompt would defeat prefix reuse every turn.
"""

from __future__ import annotations

from pathlib import Path

from freetoken.launchers.agent import Agent, LaunchPlan, NpmPackage, Options, Target, unset_cloud_keys
from freetoken.launchers.config_files import ConfigFile

PACKAGE = NpmPackage("@anthropic-ai/claude-code", "2.1.332", "claude")


def settings_path(options: Options) -> Path:
    config_dir = options.environ.get("CLAUDE_CONFIG_DIR")
    return (Path(config_dir).expanduser() if config_dir else options.home / ".claude") / "settings.json"


def variables(target: Target) -> dict[str, str]:
    model = target.model
    return {
        "ANTHROPIC_BASE_URL": target.url,
        "ANTHROPIC_AUTH_TOKEN": target.agent_key,
        "ANTHROPIC_MODEL": model,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
        "CLAUDE_CODE_SUBAGENT_MODEL": model,
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(target.output),
        "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(target.context),
        "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_AUTOUPDATER": "1",
    }


def plan(target: Target, options: Options) -> LaunchPlan:
    env = variables(target)
    files = ()
    if options.persist:
        settings = tuple((("env", name), value) for name, value in env.items())
        files = (ConfigFile(settings_path(options), "json", settings, private=target.api_key is not None),)
    # the variables go to the process too: they win over a settings file another tool may have changed
    return LaunchPlan(files, env, unset_cloud_keys(*env), tuple(options.args))


AGENT = Agent("claude", "Claude Code", PACKAGE, plan, protocol="anthropic")
