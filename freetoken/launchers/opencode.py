"""OpenCode: a provider (`@ai-sdk/openai-compatible`, bundled with OpenCode) and the default model in its
opencode.json (`$OPENCODE_CONFIG`, else `$XDG_CONFIG_HOME/opencode/`, else ~/.config/opencode/; an existing
opencode.jsonc is edited in place). The file may hold comments (JSONC); they stay.

It speaks OpenAI Chat Completions (two requests a turn: a title, then the turn). The environment keeps it from
fetching model lists, updates, default plugins and language servers from the internet.
"""

from __future__ import annotations

from pathlib import Path

from freetoken.launchers.agent import PROVIDER, Agent, LaunchPlan, NpmPackage, Options, Target, unset_cloud_keys
from freetoken.launchers.config_files import ConfigFile

PACKAGE = NpmPackage("opencode-ai", "1.18.33", "opencode")
OFFLINE = {"OPENCODE_DISABLE_MODELS_FETCH": "1", "OPENCODE_DISABLE_AUTOUPDATE": "1",
           "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1", "OPENCODE_DISABLE_LSP_DOWNLOAD": "1", "OPENCODE_DISABLE_SHARE": "1"}


def config_path(options: Options) -> Path:
    if explicit := options.environ.get("OPENCODE_CONFIG"):
        return Path(explicit).expanduser()
    xdg = options.environ.get("XDG_CONFIG_HOME")
    folder = (Path(xdg).expanduser() if xdg else options.home / ".config") / "opencode"
    jsonc = folder / "opencode.jsonc"
    return jsonc if jsonc.exists() and not (folder / "opencode.json").exists() else folder / "opencode.json"


def plan(target: Target, options: Options) -> LaunchPlan:
    provider = {"npm": "@ai-sdk/openai-compatible", "name": "freetoken",
                "options": {"baseURL": f"{target.url}/v1", "apiKey": target.agent_key},
                "models": {target.model: {"name": target.model,
                                          "limit": {"context": target.context, "output": target.output}}}}
    model = f"{PROVIDER}/{target.model}"
    settings = ((("provider", PROVIDER), provider), (("model",), model), (("small_model",), model))
    file = ConfigFile(config_path(options), "jsonc", settings, private=target.api_key is not None)
    return LaunchPlan((file,), dict(OFFLINE), unset_cloud_keys(), tuple(options.args))


AGENT = Agent("opencode", "OpenCode", PACKAGE, plan, protocol="chat")
