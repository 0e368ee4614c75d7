"""Codex: a profile of its own, `$CODEX_HOME/freetoken.config.toml` (else ~/.codex/), selected by `--profile
freetoken` on the run, so a plain `codex` keeps the user's own default and their config.toml is never written.

Codex 0.171 reads a profile from that file only: it refuses `--profile NAME` while config.toml still holds a legacy
`[profiles.NAME]` table or `profile = "NAME"`, so the launch checks for that first and says how to fix it. The
profile holds the provider (`wire_api = "responses"`: Codex speaks nothing else), the model and its context
window; Codex has no output-budget setting. The file is edited with tomlkit, so comments a user adds to it stay.
The switches that keep Codex offline (analytics, feedback, plugin sync, update check, web search) are overrides
of this run (`-c`), not settings written for later ones.
"""

from __future__ import annotations

from pathlib import Path

from freetoken.errors import FreeTokenError
from freetoken.launchers.agent import PROVIDER, Agent, LaunchPlan, NpmPackage, Options, Target, unset_cloud_keys
from freetoken.launchers.config_files import ConfigFile, read_settings, read_text

PACKAGE = NpmPackage("@openai/codex", "0.171.0", "codex")
KEY_VARIABLE = "FREETOKEN_API_KEY"
OFFLINE = ("analytics.enabled=false", "feedback.enabled=false", "features.plugins=false",
           "check_for_update_on_startup=false", 'web_search="disabled"')


def codex_home(options: Options) -> Path:
    explicit = options.environ.get("CODEX_HOME")
    return Path(explicit).expanduser() if explicit else options.home / ".codex"


def _check_no_legacy_profile(config: Path) -> None:
    text = read_text(config)
    if not text:
        return
    try:
        settings = read_settings(text, "toml")
    except Exception:  # noqa: BLE001 - Codex reports its own config.toml's syntax; only the conflict is ours
        return
    if settings.get("profile") == PROVIDER or PROVIDER in (settings.get("profiles") or {}):
        raise FreeTokenError(f"{config} holds a legacy `[profiles.{PROVIDER}]` or `profile = \"{PROVIDER}\"`, "
                             f"which stops Codex from reading the {PROVIDER} profile file; remove it, then run this "
                             "again (nothing was changed)")


def plan(target: Target, options: Options) -> LaunchPlan:
    home = codex_home(options)
    _check_no_legacy_profile(home / "config.toml")
    provider = {"name": "freetoken", "base_url": f"{target.url}/v1", "wire_api": "responses"}
    if target.api_key:
        provider["env_key"] = KEY_VARIABLE  # the key stays out of the file; the launch passes it in the environment
    settings = ((("model",), target.model), (("model_provider",), PROVIDER),
                (("model_context_window",), target.context)) + \
        tuple((("model_providers", PROVIDER, k), v) for k, v in provider.items())
    env = {KEY_VARIABLE: target.api_key} if target.api_key else {}
    argv = ("--profile", PROVIDER, *(arg for o in OFFLINE for arg in ("-c", o)), *options.args)
    profile = ConfigFile(home / f"{PROVIDER}.config.toml", "toml", settings)
    return LaunchPlan((profile,), env, unset_cloud_keys(), argv)


AGENT = Agent("codex", "Codex", PACKAGE, plan, protocol="responses")
