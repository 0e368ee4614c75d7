"""Asks a running `ft serve` what an agent must be told: its model, the context one request may hold, and the output
budget (GET /health, then GET /v1/models). A server still loading its model is waited for, with its progress."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from freetoken.errors import FreeTokenError
from freetoken.launchers.agent import Target
from freetoken.server.cli import _DEFAULT_URL
from freetoken.server.limits import reply_budget

DEFAULT_URL = _DEFAULT_URL
OFFLINE_CONTEXT = 32768  # for a --dry-run with no server: what the preview assumes, and says so


class ServerDown(FreeTokenError):
    pass


def _get(url: str, api_key: str | None, timeout: float = 5) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout) as r:
        return json.load(r)


def describe_server(url: str, api_key: str | None, *, model: str | None = None, wait_s: float = 600) -> Target:
    """The target for an agent: the server's own model (or `model`), its context and its reply budget."""
    from freetoken.server.cli import wait_healthy

    url = url.rstrip("/")
    try:
        _get(f"{url}/health", None)
    except urllib.error.HTTPError as e:
        if e.code != 503:
            raise ServerDown(f"{url} answered {e.code} to /health: it is not a freetoken server? Give --server URL"
                             ) from None
        wait_healthy(url, wait_s)  # 503: loading its model; says how far it is
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, json.JSONDecodeError):
        raise ServerDown(f"no freetoken server answers at {url}; start one with `ft serve` (in another terminal), "
                         "then run this again, or give --server URL") from None
    try:
        listing = _get(f"{url}/v1/models", api_key)
    except urllib.error.HTTPError as e:
        if e.code == 401:
            raise FreeTokenError(f"the server at {url} wants an API key; give --api-key KEY (or set "
                                 "FREETOKEN_API_KEY)") from None
        raise FreeTokenError(f"{url}/v1/models answered {e.code}") from None
    entry = listing["data"][0]
    context = int(entry.get("context_length") or OFFLINE_CONTEXT)
    output = int(entry.get("max_output_tokens") or reply_budget(context))
    return Target(url, model or entry["id"], context, output, api_key)


def offline_target(url: str, model: str, api_key: str | None, context: int | None) -> Target:
    """For `--dry-run --model M` with no server up: the context given, or an assumed one."""
    context = context or OFFLINE_CONTEXT
    return Target(url.rstrip("/"), model, context, reply_budget(context), api_key)
