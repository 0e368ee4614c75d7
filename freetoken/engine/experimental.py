"""GPU paths that are built and checked on the CPU (Triton's interpreter, torch's fallbacks) but not yet measured
on the H200: each stays off unless named in FREETOKEN_EXPERIMENTAL (comma-separated), so nobody runs an
unmeasured kernel by default. Once a path's device run shows it right and faster, it becomes the default and
leaves this list.
"""

from __future__ import annotations

import functools
import logging
import os

log = logging.getLogger(__name__)

PATHS = {
    "grouped-mm": "long chunks' experts as sorted grouped matmuls (torch._grouped_mm, bf16 on Hopper and newer)",
    "paged-decode": "captured decode attention as a paged split-KV Triton kernel (kernels/paged_decode)",
}


@functools.cache
def enabled(path: str) -> bool:
    if path not in PATHS:
        raise ValueError(f"unknown experimental path {path!r}; known: {', '.join(PATHS)}")
    return path in _named()


@functools.cache
def _named() -> frozenset[str]:
    named = frozenset(n.strip() for n in os.environ.get("FREETOKEN_EXPERIMENTAL", "").split(",") if n.strip())
    if unknown := sorted(named - set(PATHS)):
        log.warning("FREETOKEN_EXPERIMENTAL: ignoring unknown %s (known: %s)", ", ".join(unknown), ", ".join(PATHS))
    for path in sorted(named & set(PATHS)):
        log.info("experimental path on: %s (%s)", path, PATHS[path])
    return named
