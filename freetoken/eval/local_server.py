"""The `ft serve` an eval starts when it is given no endpoint: a subprocess on a free loopback port, its log in
the run's folder, stopped when the eval ends."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
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
        from freetoken.server.cli import wait_healthy

        def exited() -> None:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace").strip().splitlines()[-3:]
                raise FreeTokenError("the ft serve this eval started exited before serving: " + " | ".join(tail))

        try:
            wait_healthy(self.url, self.wait_s, exited)
        except FreeTokenError as e:
            raise FreeTokenError(f"{e} (its log: {self.log_path})") from None

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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
