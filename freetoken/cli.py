"""`ft <verb>`: dispatches each verb to the `main(argv)` of the package that owns it.

Every deliberate error is a `FreeTokenError` whose message already names the problem and the fix: it is printed
as one line on stderr and the process exits with status 2. Output meant for pipes goes to stdout only.
"""

from __future__ import annotations

import importlib
import logging
import sys

from freetoken import __version__
from freetoken.errors import FreeTokenError

# verb → (module with main(argv), one-line help)
VERBS: dict[str, tuple[str, str]] = {
    "generate": ("freetoken.engine.commands", "complete one prompt and print the completion"),
    "chat": ("freetoken.engine.commands", "interactive chat with streaming output"),
    "info": ("freetoken.engine.commands", "describe a model: architecture, parameters, experts"),
    "serve": ("freetoken.server.cli", "serve the OpenAI and Anthropic APIs on 127.0.0.1:1919"),
    "ask": ("freetoken.server.cli", "ask a running server one question"),
    "calibrate": ("freetoken.engine.offload.calibrate", "measure PCIe, DRAM and expert throughput; store a profile"),
    "bench": ("freetoken.bench.cli", "benchmarks on synthetic real-shape models (ft bench decode)"),
    "top": ("freetoken.tui.cli", "live dashboard of a running server: memory, expert cache, traffic, requests"),
    "eval": ("freetoken.eval.cli", "replay agent traces against an endpoint: TTFT, throughput, report, compare"),
    "launch": ("freetoken.launchers.cli", "configure a coding agent (claude, codex, opencode, openclaw) and run it"),
}

USAGE = "usage: ft <verb> [options]   (ft <verb> --help for a verb's options)\n\nverbs:\n" + "\n".join(
    f"  {verb:<10} {help_}" for verb, (_, help_) in VERBS.items()
)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if argv[0] in ("-V", "--version"):
        print(f"freetoken {__version__}")
        return 0
    verb = argv[0]
    if verb not in VERBS:
        print(f"ft: unknown verb {verb!r}; verbs: {', '.join(VERBS)}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="freetoken: %(message)s", stream=sys.stderr)
    module = importlib.import_module(VERBS[verb][0])
    try:
        return module.main(verb, argv[1:])
    except FreeTokenError as e:
        print(f"ft {verb}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
