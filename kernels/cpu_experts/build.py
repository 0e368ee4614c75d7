"""Compiles `experts.c` (with the parts it includes) for this machine on first use and loads it; None where no C
compiler is available.

The kernel is built with `-march=native` so it uses every vector extension of the CPU it runs on (AVX-512-BF16 on
Sapphire Rapids, AVX2 on a laptop, NEON on Arm). That only makes sense on the machine itself, so the build
happens here, once, into the cache directory, keyed by the source, the compiler and the CPU's feature flags;
later loads take a few milliseconds. Set FREETOKEN_CPU_KERNEL=0 to skip it (the plain-torch path is used).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("experts.c")
# included by experts.c (one translation unit)
PARTS = ("act.h", "dots.h", "dots_avx2.h", "q16.h", "q16_avx2.h", "q16_rows.h", "pool.h", "tiles.h", "amx.h",
         "amx_q8.h", "switches.h", "memory.h")
FLAGS = ["-O3", "-march=native", "-std=gnu11", "-fPIC", "-shared", "-pthread"]


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() + platform.machine()


def _build_key(compiler: str, flags: list[str]) -> str:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    sources = [SOURCE.read_text(), *(SOURCE.with_name(part).read_text() for part in PARTS)]
    material = "\n".join([*sources, " ".join(flags), version, _cpu_flags()])
    return hashlib.sha256(material.encode()).hexdigest()[:16]


def build(build_dir: Path, emulate_amx: bool = False) -> Path | None:
    """The path of the compiled library (building it if needed), or None with a warning when it cannot be built.
    `emulate_amx`: the tile paths over tiles emulated in C (slow; for testing their layouts without AMX)."""
    compiler = _compiler()
    if compiler is None:
        log.warning("no C compiler found (set CC): CPU experts use the slower plain-torch path")
        return None
    flags = [*FLAGS, "-DFT_AMX_EMULATE"] if emulate_amx else FLAGS
    target = build_dir / f"cpu_experts-{_build_key(compiler, flags)}.so"
    if target.exists():
        return target
    build_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=build_dir) as tmp:
        out = Path(tmp) / target.name
        result = subprocess.run([compiler, *flags, "-o", str(out), str(SOURCE), "-lm"],
                                capture_output=True, text=True)
        if result.returncode != 0:
            log.warning("building the CPU expert kernel failed, using the plain-torch path:\n%s",
                        result.stderr.strip()[-2000:])
            return None
        os.replace(out, target)  # atomic: concurrent builders race harmlessly
    return target


def load(build_dir: Path, emulate_amx: bool = False) -> ctypes.CDLL | None:
    if os.environ.get("FREETOKEN_CPU_KERNEL", "1") == "0":
        return None
    path = build(build_dir, emulate_amx)
    if path is None:
        return None
    lib = ctypes.CDLL(str(path))
    p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.ft_pool_start.argtypes, lib.ft_pool_start.restype = [i], i
    lib.ft_pool_wake.argtypes, lib.ft_pool_wake.restype = [ctypes.c_long], None
    lib.ft_pool_set_tree_wake.argtypes, lib.ft_pool_set_tree_wake.restype = [i], i
    lib.ft_pool_set_join.argtypes, lib.ft_pool_set_join.restype = [i], i
    lib.ft_pool_set_caller_joins.argtypes, lib.ft_pool_set_caller_joins.restype = [i], i
    f = ctypes.c_float
    lib.ft_moe_start.argtypes = [p, p, p, i64, i64, i64, i, i, i, p, i, p, p, p, p, p, p, i, i, i, i, p, p,
                                 p, p, p, i, f, f]
    lib.ft_has_bf16_dot.argtypes, lib.ft_has_bf16_dot.restype = [], i
    lib.ft_has_q16.argtypes, lib.ft_has_q16.restype = [], i
    lib.ft_has_amx.argtypes, lib.ft_has_amx.restype = [], i
    lib.ft_set_amx.argtypes, lib.ft_set_amx.restype = [i, i, i], None
    lib.ft_has_amx_q8.argtypes, lib.ft_has_amx_q8.restype = [], i
    lib.ft_set_amx_q8.argtypes, lib.ft_set_amx_q8.restype = [i, i], None
    lib.ft_set_amx_q8_rows.argtypes, lib.ft_set_amx_q8_rows.restype = [i], None
    lib.ft_set_amx_prefetch.argtypes, lib.ft_set_amx_prefetch.restype = [i], None
    lib.ft_set_amx_dequant_prefetch.argtypes, lib.ft_set_amx_dequant_prefetch.restype = [i], i
    lib.ft_set_amx_dequant_streams.argtypes, lib.ft_set_amx_dequant_streams.restype = [i], i
    lib.ft_set_amx_dequant_streams.argtypes, lib.ft_set_amx_dequant_streams.restype = [i], i
    lib.ft_set_amx_tile_pairs.argtypes, lib.ft_set_amx_tile_pairs.restype = [i], i
    lib.ft_set_vector_act.argtypes, lib.ft_set_vector_act.restype = [i], i
    lib.ft_set_q16.argtypes, lib.ft_set_q16.restype = [i], None
    lib.ft_set_q16_form.argtypes, lib.ft_set_q16_form.restype = [i], None
    lib.ft_set_q16_rows.argtypes, lib.ft_set_q16_rows.restype = [i], i
    lib.ft_set_q16_rows_from.argtypes, lib.ft_set_q16_rows_from.restype = [i], i
    lib.ft_set_q16_rows_prefetch.argtypes, lib.ft_set_q16_rows_prefetch.restype = [i], i
    lib.ft_set_block_bf16.argtypes, lib.ft_set_block_bf16.restype = [i], i
    lib.ft_set_avx2_dots.argtypes, lib.ft_set_avx2_dots.restype = [i], i
    lib.ft_set_dots_prefetch.argtypes, lib.ft_set_dots_prefetch.restype = [i], i
    lib.ft_set_owned_rows.argtypes, lib.ft_set_owned_rows.restype = [i], i
    lib.ft_moe_start.restype = i
    lib.ft_moe_wait.argtypes, lib.ft_moe_wait.restype = [], ctypes.c_double
    lib.ft_moe_timing.argtypes, lib.ft_moe_timing.restype = [ctypes.POINTER(ctypes.c_double)], None
    lib.ft_read_bytes.argtypes, lib.ft_read_bytes.restype = [p, ctypes.c_size_t], ctypes.c_uint64
    lib.ft_warm.argtypes, lib.ft_warm.restype = [ctypes.POINTER(p), ctypes.POINTER(i64), i], i
    lib.ft_warm_rows.argtypes, lib.ft_warm_rows.restype = [p, p, p, i64, i64, i64, i, i, i, p, i, i, i], i
    lib.ft_random_fill.argtypes = [p, ctypes.c_size_t, ctypes.c_uint64, i, ctypes.c_float]
    lib.ft_random_fill.restype = None
    lib.ft_to_bf16_exact.argtypes, lib.ft_to_bf16_exact.restype = [p, p, ctypes.c_size_t], i
    return lib
