"""What other processes hold on a GPU, from NVML (libnvidia-ml, installed with the NVIDIA driver) through ctypes:
the dashboard's "other" memory, where the driver can say it.

NVML lists each process using the device (compute and graphics: a consumer card's desktop counts) with its
memory. This process is left out by its pid; where NVML cannot see it (a container without the host's pid
namespace reports host pids), the list cannot tell ours from theirs and the answer is None, as it is wherever
NVML is missing or fails: the caller then estimates from what the device has free.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

log = logging.getLogger(__name__)
NOT_AVAILABLE = 0xFFFFFFFFFFFFFFFF  # NVML's usedGpuMemory when it cannot tell (e.g. under WDDM)
MAX_PROCESSES = 256


class _ProcessV1(ctypes.Structure):
    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]


class _ProcessV2(ctypes.Structure):  # the _v2 and _v3 queries' layout
    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong), ("gpuInstanceId", ctypes.c_uint),
                ("computeInstanceId", ctypes.c_uint)]


@functools.cache
def _library():
    """NVML, initialised once; None where there is none."""
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
        if lib.nvmlInit_v2() != 0:
            return None
        return lib
    except (OSError, AttributeError):
        return None


@functools.cache
def _handle(bus_id: str):
    lib = _library()
    if lib is None:
        return None
    handle = ctypes.c_void_p()
    if lib.nvmlDeviceGetHandleByPciBusId_v2(bus_id.encode(), ctypes.byref(handle)) != 0:
        return None
    return handle


def _processes(lib, handle, kind: str) -> list[tuple[int, int]] | None:
    """(pid, bytes) of the device's compute or graphics processes; None if NVML refuses."""
    for suffix, struct in (("_v3", _ProcessV2), ("_v2", _ProcessV2), ("", _ProcessV1)):
        fn = getattr(lib, f"nvmlDeviceGet{kind}RunningProcesses{suffix}", None)
        if fn is None:
            continue
        count = ctypes.c_uint(MAX_PROCESSES)
        infos = (struct * MAX_PROCESSES)()
        if fn(handle, ctypes.byref(count), infos) != 0:
            return None
        return [(infos[i].pid, infos[i].usedGpuMemory) for i in range(count.value)]
    return None


def other_processes_bytes(bus_id: str, pid: int | None = None) -> int | None:
    """Bytes the device at PCI `bus_id` ("0000:65:00.0") holds for processes other than `pid` (default: this
    one), or None when NVML cannot tell."""
    lib, handle = _library(), _handle(bus_id)
    if lib is None or handle is None:
        return None
    pid = os.getpid() if pid is None else pid
    seen: dict[int, int] = {}
    for kind in ("Compute", "Graphics"):
        listed = _processes(lib, handle, kind)
        if listed is None:
            return None
        for p, used in listed:
            if used != NOT_AVAILABLE:
                seen[p] = max(seen.get(p, 0), used)  # a process may be listed as both
            else:
                seen.setdefault(p, 0)
    if pid not in seen:  # ours is not among them: another pid namespace, or no context yet
        return None
    return sum(used for p, used in seen.items() if p != pid)


def bus_id_of(device) -> str | None:
    """The PCI bus id NVML names a torch CUDA device by."""
    import torch

    try:
        props = torch.cuda.get_device_properties(device)
        return f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    except (AttributeError, RuntimeError, AssertionError):
        return None
