"""Runs several `ft bench decode|prefill` commands in one process on one build of their synthetic model: the
48-layer Qwen3-30B-A3B shape takes ~4 minutes to build on the H200 host, so a device command (10 minutes at
most) fits one build and several benches, not several builds. Commands that name other model options build
their own.

  python evals/scripts/bench_one_model.py decode ARGS... -- prefill ARGS...
  python evals/scripts/bench_one_model.py decode ARGS... -- FREETOKEN_EXPERIMENTAL=cpu-prewake decode ARGS...

A command may start with VARIABLE=value words, set for that command only (an A/B of a GPU path on one build).
`PREFETCH_HOLD=off` is the script's own: the cache forgets `hold` (decode's prefetch before 4099866 let each
prediction it admitted evict the previous one), for an A/B of that fix on one build.
"""

from __future__ import annotations

import os
import sys

from freetoken.bench import decode, prefill, synthetic
from freetoken.engine import gpu_paths
from freetoken.engine.loader import attach_experts
from freetoken.engine.offload.expert_cache import ExpertCache

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
    commands = [(dict(_env_words(c)), c[len(dict(_env_words(c))):]) for c in commands]
    if not commands or any(not c or c[0] not in BENCHES for _, c in commands):
        print(f"usage: bench_one_model.py {{{'|'.join(BENCHES)}}} ARGS... [-- ...]", file=sys.stderr)
        return 2
    for module in BENCHES.values():
        module.build_synthetic = _build_once
    status = 0
    for env, command in commands:
        print(f"=== {' '.join(f'{k}={v}' for k, v in env.items())} ft bench {' '.join(command)}", file=sys.stderr,
              flush=True)
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        gpu_paths.enabled.cache_clear()
        gpu_paths._named.cache_clear()
        ExpertCache.admit = _admit_without_hold if env.get("PREFETCH_HOLD") == "off" else _admit
        try:
            status = BENCHES[command[0]].main(command[1:]) or status
        finally:
            for k, v in saved.items():
                if v is None:
                    del os.environ[k]
                else:
                    os.environ[k] = v
            gpu_paths.enabled.cache_clear()
            gpu_paths._named.cache_clear()
    return status


_admit = ExpertCache.admit
_held: list = []  # predictions admitted by the current prefetch (keys of one layer), for PREFETCH_HOLD=off


def _admit_without_hold(cache, key, force=False, hold=False):
    """The prefetch's admissions before 4099866: not held, so the next one could evict one admitted just before;
    that prefetch then put the later prediction in its place and stopped. Here it stops instead (as many copies,
    the earlier prediction kept)."""
    if not hold:
        return _admit(cache, key, force)
    if _held and _held[0][0] != key[0]:
        _held.clear()  # another layer's prefetch
    if not cache.free_slots and cache.policy.victim(cache._protected | cache.pinned) in _held:
        return None
    admitted = _admit(cache, key, force)
    if admitted is not None:
        _held.append(key)
    return admitted


def _env_words(command: list[str]):
    """The leading VARIABLE=value words of a command, as (VARIABLE, value)."""
    for word in command:
        name, eq, value = word.partition("=")
        if not eq or not name.isidentifier() or not name.isupper():
            return
        yield name, value


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
