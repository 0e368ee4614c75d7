"""OpenClaw: a provider and the default agent model in its openclaw.json (`$OPENCLAW_CONFIG_PATH`, else
~/.openclaw/openclaw.json), a JSON5 file: unquoted keys, comments and trailing commas stay as they are.

It speaks OpenAI Chat Completions (`api: "openai-completions"`) and runs on Node.js 24.16 or newer, which
`--install` brings from npm (`node@24`) when the machine's Node is older.
"""

from __future__ import annotations

from pathlib import Path

from freetoken.launchers.agent import PROVIDER, Agent, LaunchPlan, NpmPackage, Options, Target, unset_cloud_keys
from freetoken.launchers.config_files import ConfigFile

PACKAGE = NpmPackage("openclaw", "2026.9.6", "openclaw", node=(24, 16))


def config_path(options: Options) -> Path:
    explicit = options.environ.get("OPENCLAW_CONFIG_PATH")
    return Path(explicit).expanduser() if explicit else options.home / ".openclaw" / "openclaw.json"


def plan(target: Target, options: Options) -> LaunchPlan:
    provider = {"baseUrl": f"{target.url}/v1", "apiKey": target.agent_key, "api": "openai-completions",
                "models": [{"id": target.model, "name": target.model, "contextWindow": target.context,
                            "maxTokens": target.output}]}
    settings = ((("models", "providers", PROVIDER), provider),
                (("agents", "defaults", "model", "primary"), f"{PROVIDER}/{target.model}"))
    file = ConfigFile(config_path(options), "json5", settings, private=target.api_key is not None)
    return LaunchPlan((file,), {}, unset_cloud_keys(), tuple(options.args))


AGENT = Agent("openclaw", "OpenClaw", PACKAGE, plan, protocol="chat")
