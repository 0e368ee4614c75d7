"""What a launcher declares: the agent's npm package, and a plan (files, environment, argv) rendered from the
server it will talk to. One plan drives `--dry-run` (a diff), the write, the run and `--restore`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from freetoken.launchers.config_files import ConfigFile

PROVIDER = "freetoken"  # the provider / profile name written into each agent's config

# Keys of cloud providers: a local session must not carry them to the agent, which could send them anywhere.
CLOUD_KEYS = (
    "ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN", "OPENAI_API_KEY", "OPENAI_BASE_URL", "CODEX_API_KEY",
    "OPENROUTER_API_KEY", "GEMINI_API_KEY", "GOOGLE_API_KEY", "GROQ_API_KEY", "MISTRAL_API_KEY", "DEEPSEEK_API_KEY",
    "XAI_API_KEY", "TOGETHER_API_KEY", "FIREWORKS_API_KEY", "AZURE_OPENAI_API_KEY", "AWS_BEARER_TOKEN_BEDROCK",
    "CLAUDE_CODE_USE_BEDROCK", "CLAUDE_CODE_USE_VERTEX", "CLAUDE_CODE_USE_FOUNDRY",
)


@dataclass(frozen=True, slots=True)
class Target:
    """The server an agent is pointed at, as the running server describes itself."""

    url: str  # its root, e.g. http://127.0.0.1:1919
    model: str
    context: int  # tokens one request may hold (prompt and reply)
    output: int  # tokens one reply may use
    api_key: str | None = None

    @property
    def agent_key(self) -> str:
        """The key the agent sends: the server's --api-key, else a fixed non-secret token. Every agent refuses to
        start without some key, and a server without --api-key accepts any (it binds loopback only)."""
        return self.api_key or "freetoken-local"


@dataclass(frozen=True, slots=True)
class NpmPackage:
    name: str
    version: str  # pinned: the version these launchers were tested with
    command: str  # the executable it installs
    node: tuple[int, int] | None = None  # the least Node.js it needs to run; None: any (a native binary)

    @property
    def spec(self) -> str:
        return f"{self.name}@{self.version}"


@dataclass(frozen=True, slots=True)
class LaunchPlan:
    files: tuple[ConfigFile, ...]
    env: Mapping[str, str]  # set for the agent's process
    unset: tuple[str, ...]  # removed from its environment
    argv: tuple[str, ...]  # after the command: ours first, then the user's


@dataclass(frozen=True, slots=True)
class Options:
    home: Path  # the user's home (tests give a temporary one)
    environ: Mapping[str, str]  # where config-location variables (CODEX_HOME, …) are read
    args: tuple[str, ...] = ()  # the user's own arguments for the agent (after `--`)
    persist: bool = True  # False: environment only, where the agent allows it


@dataclass(frozen=True, slots=True)
class Agent:
    name: str
    title: str
    package: NpmPackage
    plan: Callable[[Target, Options], LaunchPlan]
    protocol: str  # the API it speaks: "anthropic", "responses" or "chat"
    notes: tuple[str, ...] = field(default=())  # shown before the run: what the user should know


def unset_cloud_keys(*keep: str) -> tuple[str, ...]:
    return tuple(k for k in CLOUD_KEYS if k not in keep)
