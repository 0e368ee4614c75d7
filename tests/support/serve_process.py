"""A real `ft serve` subprocess for tests that drive it as users do (agent CLIs, `ft eval`): a free loopback
port, its log in a file, stopped at the end."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from support.launching import FT


@dataclass
class ServeProcess:
    url: str
    log_path: Path
    proc: subprocess.Popen


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_process(model: Path, folder: Path, *args: str, wait_s: float = 120) -> Iterator[ServeProcess]:
    """`ft serve --model MODEL ARGS...`, yielded once its log says it serves."""
    port, log_path = free_port(), folder / "serve.log"
    env = {**os.environ, "FREETOKEN_HOME": str(folder / "ft-home")}
    with open(log_path, "w") as log:
        proc = subprocess.Popen([FT, "serve", "--model", str(model), "--port", str(port), *args], stdout=log,
                                stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + wait_s
            while "serving " not in log_path.read_text():
                assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
                time.sleep(0.2)
            yield ServeProcess(f"http://127.0.0.1:{port}", log_path, proc)
        finally:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)
