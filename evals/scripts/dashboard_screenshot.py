"""Takes the README's dashboard screenshot from a real run: a tiny random MoE model with offloaded experts behind a
real server, one request generating, `ft top` attached to it; saved as SVG (Textual) and PNG (rsvg-convert).

    python evals/scripts/dashboard_screenshot.py docs/dashboard.png
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from support.checkpoints import PARITY_CASES, write_hf_checkpoint  # noqa: E402
from support.servers import start_server  # noqa: E402


def main(out: str) -> None:
    import torch

    from freetoken.engine.loader import load_model
    from freetoken.tui.app import TopApp
    from freetoken.tui.source import HttpStats

    folder = Path(tempfile.mkdtemp())
    case = dict(PARITY_CASES["qwen3_moe"])
    write_hf_checkpoint(path=folder, **case, num_experts=32, num_hidden_layers=6)
    probe = load_model(folder, progress=False)
    budget = 48 * probe.moe_spec.bytes_per_expert(torch.float32)
    server = start_server(load_model(folder, progress=False, expert_cache=budget), "tiny-moe")

    def chat(n: int) -> None:
        body = {"model": "tiny-moe", "messages": [{"role": "user", "content": "Write a haiku about GPUs."}],
                "max_tokens": n, "temperature": 0.8, "ignore_eos": True}
        req = urllib.request.Request(f"{server.url}/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=600).read()

    async def shoot() -> None:
        app = TopApp(HttpStats(server.url), interval=0.5)
        async with app.run_test(size=(110, 34)) as pilot:
            stop = threading.Event()

            def keep_asking() -> None:  # requests one after another, so one is always running
                while not stop.is_set():
                    chat(200)

            threading.Thread(target=keep_asking, daemon=True).start()
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not (
                    len(app.rates.series["decode"]) >= 16 and app.stats.get("running") and app.rates.now("decode")):
                await pilot.pause(0.25)
            stop.set()
            svg = Path(out).with_suffix(".svg")
            app.save_screenshot(filename=svg.name, path=str(svg.parent))
    asyncio.run(shoot())
    subprocess.run(["rsvg-convert", "-w", "1400", str(Path(out).with_suffix(".svg")), "-o", out], check=True)
    print(out)
    server.stop()


if __name__ == "__main__":
    main(sys.argv[1])
