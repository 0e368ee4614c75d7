"""`ft bench <what>`: dispatch to the benchmark that owns it."""

from __future__ import annotations

from freetoken.errors import FreeTokenError

BENCHMARKS = {"decode": "freetoken.bench.decode", "prefill": "freetoken.bench.prefill",
              "cache": "freetoken.bench.cache_sim", "export": "freetoken.bench.export",
              "serve": "freetoken.bench.serve", "reuse": "freetoken.bench.reuse",
              "speculative": "freetoken.bench.speculative"}


def main(verb: str, argv: list[str]) -> int:
    if not argv or argv[0] not in BENCHMARKS:
        raise FreeTokenError(f"ft bench needs one of: {', '.join(BENCHMARKS)} (e.g. ft bench decode --help)")
    import importlib

    return importlib.import_module(BENCHMARKS[argv[0]]).main(argv[1:])
