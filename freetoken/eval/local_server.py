"""The `ft serve` an eval starts when it is given no endpoint: a subprocess on a free loopback port, its log in
the run's folder, stopped when the eval ends."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from freetoken.errors import FreeTokenError

log = logging.getLogger("freetoken.eval")


class LocalServer:
    def __init__(self, serve_args: list[str], log_path: Path, wait_s: float = 1800.0):
        self.args, self.log_path, self.wait_s = serve_args, log_path, wait_s
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def __enter__(self) -> LocalServer:
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")
        cmd = [*_ft_command(), "serve", "--port", str(port), *self.args]
        log.info("starting ft serve %s (log: %s)", " ".join(self.args) or "(the default model)", self.log_path)
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self._wait()
        return self

    def _wait(self) -> None:
        deadline, said = time.monotonic() + self.wait_s, -1.0
        while True:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace").strip().splitlines()[-3:]
                raise FreeTokenError("the ft serve this eval started exited before serving: " + " | ".join(tail))
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    json.load(r)
                    return
            except urllib.error.HTTPError as e:  # 503 while loading
                share = _json(e).get("progress")
                if isinstance(share, int | float) and share - said >= 0.25:
                    log.info("loading the model: %.0f%% of the weights", 100 * share)
                    said = share
            except (OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise FreeTokenError(f"ft serve did not come up within {self.wait_s:.0f}s; see {self.log_path}")
            time.sleep(0.3)

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def _ft_command() -> list[str]:
    """This installation's `ft`: the script beside the interpreter where there is one (`python -m` would put the
    working directory first on the path, and a source checkout there would shadow the installed package)."""
    script = Path(sys.executable).parent / "ft"
    return [str(script)] if script.exists() else [sys.executable, "-m", "freetoken.cli"]


def _json(e: urllib.error.HTTPError) -> dict:
    try:
        data = json.loads(e.read())
        return data if isinstance(data, dict) else {}
    except (ValueError, OSError):
        return {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
