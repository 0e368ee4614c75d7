"""Runs several `ft bench decode|prefill` commands in one process on one build of their synthetic model: the
48-layer Qwen3-30B-A3B shape takes ~4 minutes to build on the H200 host, so a device command (10 minutes at
most) fits one build and several benches, not several builds. Commands that name other model options build
their own.

  python evals/scripts/bench_one_model.py decode ARGS... -- prefill ARGS...
"""

from __future__ import annotations

import sys

from freetoken.bench import decode, prefill, synthetic
from freetoken.engine.loader import attach_experts

BENCHES = {"decode": decode, "prefill": prefill}
_built: dict[tuple, tuple] = {}


def _build_once(shape: str, **options):
    """build_synthetic, keyed by its arguments; a reused model gets back the executor it was built with (each
    bench attaches its own per row and reads the host store from the one it finds)."""
    key = (shape, *sorted((name, str(value)) for name, value in options.items()))
    if key not in _built:
        lm = synthetic.build_synthetic(shape, **options)
        _built[key] = (lm, lm.experts)
    lm, built_with = _built[key]
    lm.experts = built_with
    attach_experts(lm.model, built_with)
    return lm


def main(argv: list[str]) -> int:
    commands, current = [], []
    for arg in argv + ["--"]:
        if arg == "--":
            if current:
                commands.append(current)
            current = []
        else:
            current.append(arg)
    if not commands or any(c[0] not in BENCHES for c in commands):
        print(f"usage: bench_one_model.py {{{'|'.join(BENCHES)}}} ARGS... [-- ...]", file=sys.stderr)
        return 2
    for module in BENCHES.values():
        module.build_synthetic = _build_once
    status = 0
    for command in commands:
        print(f"=== ft bench {' '.join(command)}", file=sys.stderr, flush=True)
        status = BENCHES[command[0]].main(command[1:]) or status
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
