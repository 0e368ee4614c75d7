"""Where the dashboard's numbers come from: a running server's `/v1/stats` (and its admin routes for the resize
keys), or recorded stats (snapshot tests, demos). Only this module speaks HTTP; the app sees dicts and errors."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Sequence


class Unreachable(Exception):
    """The server did not answer (down, restarting, or not a freetoken server)."""


class ActionFailed(Exception):
    """The server refused an action; the message is its own."""


class HttpStats:
    def __init__(self, url: str, api_key: str | None = None, timeout: float = 2.0):
        self.url, self.api_key, self.timeout = url.rstrip("/"), api_key, timeout

    def _request(self, path: str, body: dict | None = None) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data, headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                reply = json.load(r)
        except urllib.error.HTTPError as e:
            try:
                message = json.loads(e.read()).get("error", {}).get("message") or str(e)
            except (json.JSONDecodeError, AttributeError, ValueError):
                message = str(e)
            if body is None:
                raise Unreachable(f"{self.url} answered {e.code}: {message}") from None
            raise ActionFailed(message) from None
        except (urllib.error.URLError, OSError, json.JSONDecodeError, ValueError) as e:
            raise Unreachable(f"no answer from {self.url} ({getattr(e, 'reason', e)})") from None
        if not isinstance(reply, dict):
            raise Unreachable(f"{self.url}{path} did not answer with a JSON object")
        return reply

    def fetch(self) -> dict:
        return self._request("/v1/stats")

    def resize_experts(self, nbytes: int) -> dict:
        return self._request("/admin/expert-cache", {"size": f"{max(0, int(nbytes))}B"})

    def resize_kv(self, nbytes: int) -> dict:
        return self._request("/admin/kv-cache", {"size": f"{max(0, int(nbytes))}B"})

    def pin(self, layer: int, pinned: bool) -> dict:
        return self._request("/admin/expert-pin", {"layer": layer, "pinned": pinned})


class RecordedStats:
    """Replays recorded `/v1/stats` answers, one per fetch, the last one repeated; actions are refused."""

    def __init__(self, frames: Sequence[dict], url: str = "recorded"):
        self.frames, self.url, self._next = list(frames), url, 0

    def fetch(self) -> dict:
        frame = self.frames[min(self._next, len(self.frames) - 1)]
        self._next += 1
        if isinstance(frame, Exception):
            raise frame
        return frame

    def resize_experts(self, nbytes: int) -> dict:
        raise ActionFailed("recorded stats: nothing to resize")

    resize_kv = resize_experts

    def pin(self, layer: int, pinned: bool) -> dict:
        raise ActionFailed("recorded stats: nothing to pin")
