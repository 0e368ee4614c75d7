"""What the machine's CPUs did during each request, when the endpoint runs on this machine (Linux `/proc/stat`):
the share of CPU time busy, idle, waiting on I/O, and stolen by the hypervisor.

An offloading server computes part of every decode step on the host's cores, beside its own threads and, in a
benchmark, this client. A turn whose decode rate drops while the cores were ~100% busy points at contention on the
host; one with steal time at a virtual machine whose neighbours took its cores; one with idle cores at neither.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

from freetoken.loopback import is_loopback

STAT = Path("/proc/stat")
# the aggregate line's first eight columns, in clock ticks summed over every CPU
FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def read() -> tuple[int, ...] | None:
    """The aggregate CPU times now, or None where /proc/stat is not there (not Linux) or not in this shape."""
    try:
        with STAT.open() as f:
            line = f.readline().split()
    except OSError:
        return None
    if not line or line[0] != "cpu" or len(line) < 1 + len(FIELDS):
        return None
    try:
        return tuple(int(v) for v in line[1:1 + len(FIELDS)])
    except ValueError:
        return None


def shares(before: tuple[int, ...] | None, after: tuple[int, ...] | None) -> dict[str, float] | None:
    """The shares of CPU time between two reads: busy (user, nice, system, irq, softirq), idle, iowait, steal;
    None when either read failed or no tick passed."""
    if before is None or after is None:
        return None
    d = dict(zip(FIELDS, (b - a for a, b in zip(before, after, strict=True)), strict=True))
    total = sum(d.values())
    if total <= 0:
        return None
    busy = d["user"] + d["nice"] + d["system"] + d["irq"] + d["softirq"]
    return {"busy": round(busy / total, 4), "idle": round(d["idle"] / total, 4),
            "iowait": round(d["iowait"] / total, 4), "steal": round(d["steal"] / total, 4)}


def is_local(endpoint: str) -> bool:
    """Whether the endpoint is on this machine (a loopback address or localhost): only then do this machine's
    CPU times describe the server's."""
    return is_loopback(urlparse(endpoint).hostname or "")
