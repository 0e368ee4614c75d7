"""`ft top [--url URL] [--api-key K]`: the dashboard of a running server (`ft serve --dashboard` runs the same app
in the serving terminal)."""

from __future__ import annotations

import argparse
import os
import sys

from freetoken.server.cli import _DEFAULT_URL


def main(verb: str, argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="ft top", description="Live memory, expert-cache, traffic and request state "
                                "of a running freetoken server.")
    p.add_argument("--url", default=os.environ.get("FREETOKEN_URL", _DEFAULT_URL),
                   help=f"the server (default {_DEFAULT_URL}, or $FREETOKEN_URL)")
    p.add_argument("--api-key", default=os.environ.get("FREETOKEN_API_KEY"),
                   help="the server's --api-key, if it has one (default: $FREETOKEN_API_KEY)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between updates (default 1)")
    a = p.parse_args(argv)
    from freetoken.tui.app import TopApp
    from freetoken.tui.source import HttpStats

    TopApp(HttpStats(a.url, a.api_key), interval=max(0.2, a.interval)).run()
    return 0


if __name__ == "__main__":
    sys.exit(main("top", sys.argv[1:]))
