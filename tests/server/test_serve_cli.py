"""`ft serve` and `ft ask` as processes, the way the README's main job runs them (from a directory other than the
repository root, where `-m freetoken.cli` would import the source tree instead of the installed package)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_then_ask_answers_and_stops_cleanly(smollm2_gguf, tmp_path):
    port = _free_port()
    ft = [sys.executable, "-m", "freetoken.cli"]
    server = subprocess.Popen([*ft, "serve", "--port", str(port), "--model", str(smollm2_gguf)],
                              stderr=subprocess.PIPE, text=True, env=os.environ, cwd=tmp_path)
    try:
        ask = subprocess.run([*ft, "ask", "--url", f"http://127.0.0.1:{port}", "--wait", "120",
                              "What is the capital of France?"], capture_output=True, text=True, timeout=300,
                             cwd=tmp_path)
        assert ask.returncode == 0, ask.stderr
        assert "Paris" in ask.stdout
    finally:
        server.send_signal(signal.SIGINT)
        _, err = server.communicate(timeout=60)
    assert server.returncode == 0, err
    assert f"on http://127.0.0.1:{port}" in err  # the ready line


def test_ask_without_a_server_says_how_to_start_one(tmp_path):
    port = _free_port()
    ask = subprocess.run([sys.executable, "-m", "freetoken.cli", "ask", "--url", f"http://127.0.0.1:{port}",
                          "--wait", "1", "hi"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert ask.returncode == 2 and "ft serve" in ask.stderr and len(ask.stderr.strip().splitlines()) == 1


def test_an_unwritable_record_folder_is_refused_before_loading(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    serve = subprocess.run([sys.executable, "-m", "freetoken.cli", "serve", "--port", str(_free_port()), "--record",
                            str(blocker / "traces")], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert serve.returncode == 2 and len(serve.stderr.strip().splitlines()) == 1
    assert serve.stderr.startswith(f"ft serve: error: --record {blocker / 'traces'}: cannot write there")
