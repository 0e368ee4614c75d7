"""Host → device copies, event records and waits, and graph launches issued straight through the CUDA runtime
(ctypes), for the decode hot path.

A decode step copies a few experts per layer, three projections each; through `Tensor.copy_` every copy costs
~10 µs of host time (dispatch, checks, a pinned-memory event), more than the copy engine needs to start it, and
the host thread is the critical path of an offloaded decode step. `cudaMemcpyAsync` through ctypes costs ~1 µs;
recording a torch event or entering a stream context costs several µs each, the runtime call about one. Only
used between pinned host memory and device memory, on streams and events torch created (events recorded once by
torch first, so torch's own `query` and `elapsed_time` keep working); where the runtime library cannot be found
in this process (a static build), `available()` is False and callers keep using torch.

`copy_batch_to_device` queues many such copies in one `cudaMemcpyBatchAsync` (CUDA 12.8 and later): a Q8_0 layer-step
of four experts is twelve copies, ~4.5 µs of host time each on the H200 host whatever their size
(evals/results/copier-host-cost-h200.md), so one call for all of them is what GPU path "copy-batch" measures.
"""

from __future__ import annotations

import ctypes
import functools

_HOST_TO_DEVICE = 1  # cudaMemcpyHostToDevice
_NOT_READY = 600  # cudaErrorNotReady
_SRC_ACCESS_ORDER_STREAM = 1  # cudaMemcpySrcAccessOrderStream: the sources are read in stream order
BATCH_MAX = 256  # copies one batch call takes (the argument arrays are allocated once, at this size)


class _MemLocation(ctypes.Structure):  # cudaMemLocation
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):  # cudaMemcpyAttributes
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _MemLocation), ("dstLocHint", _MemLocation),
                ("flags", ctypes.c_uint)]


class _BatchArgs:
    """The argument arrays of `cudaMemcpyBatchAsync`, allocated once (building them per call would cost the host
    what the batch saves): every copy of a batch shares one attribute entry."""

    def __init__(self, lib: ctypes.CDLL, version: int):
        self.fn = lib.cudaMemcpyBatchAsync
        pointers, sizes = ctypes.c_void_p * BATCH_MAX, ctypes.c_size_t * BATCH_MAX
        self.dsts, self.srcs, self.sizes = pointers(), pointers(), sizes()
        self.attrs = _MemcpyAttributes(srcAccessOrder=_SRC_ACCESS_ORDER_STREAM)
        self.attr_index = ctypes.c_size_t(0)
        self.fail_index = ctypes.c_size_t(0)
        # CUDA 13 dropped the failure-index argument that 12.8-12.9 have before the stream
        self.with_fail_index = version < 13000
        common = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                  ctypes.POINTER(_MemcpyAttributes), ctypes.POINTER(ctypes.c_size_t), ctypes.c_size_t]
        self.fn.argtypes = common + ([ctypes.POINTER(ctypes.c_size_t)] if self.with_fail_index else []) + \
            [ctypes.c_void_p]
        self.fn.restype = ctypes.c_int

    def call(self, count: int, stream: int) -> int:
        args = [self.dsts, self.srcs, self.sizes, count, ctypes.byref(self.attrs), ctypes.byref(self.attr_index), 1]
        if self.with_fail_index:
            args.append(ctypes.byref(self.fail_index))
        return self.fn(*args, stream)


@functools.cache
def _runtime() -> ctypes.CDLL | None:
    """The libcudart torch already loaded (found in this process's mappings), or None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
            fn = lib.cudaMemcpyAsync
        except (OSError, AttributeError):
            continue
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        for name, args in (("cudaEventRecord", [ctypes.c_void_p, ctypes.c_void_p]),
                           ("cudaStreamWaitEvent", [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]),
                           ("cudaGraphLaunch", [ctypes.c_void_p, ctypes.c_void_p]),
                           ("cudaEventQuery", [ctypes.c_void_p]),
                           ("cudaEventElapsedTime", [ctypes.POINTER(ctypes.c_float), ctypes.c_void_p,
                                                     ctypes.c_void_p])):
            getattr(lib, name).argtypes, getattr(lib, name).restype = args, ctypes.c_int
        return lib
    return None


@functools.cache
def _batch() -> _BatchArgs | None:
    """The batched copy where this runtime has it (CUDA 12.8 and later), else None."""
    lib = _runtime()
    if lib is None or not hasattr(lib, "cudaMemcpyBatchAsync"):
        return None
    version = ctypes.c_int()
    lib.cudaRuntimeGetVersion.argtypes, lib.cudaRuntimeGetVersion.restype = [ctypes.POINTER(ctypes.c_int)], ctypes.c_int
    if lib.cudaRuntimeGetVersion(ctypes.byref(version)) != 0 or version.value < 12080:
        return None
    return _BatchArgs(lib, version.value)


def batch_available() -> bool:
    return _batch() is not None


def available() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_initialized() and _runtime() is not None


def copy_to_device(dst: int, src: int, nbytes: int, stream: int) -> None:
    """Queues a copy of `nbytes` from pinned host address `src` to device address `dst` on the stream handle
    `stream` (`torch.cuda.Stream.cuda_stream`)."""
    _check("cudaMemcpyAsync", _runtime().cudaMemcpyAsync(dst, src, nbytes, _HOST_TO_DEVICE, stream))


def copy_batch_to_device(copies: list[tuple[int, int, int]], stream: int) -> None:
    """Queues (device address, pinned host address, bytes) copies on the stream handle `stream` in as few
    runtime calls as `BATCH_MAX` allows (`batch_available()` must be True). The copies of one call run in no
    particular order among themselves; the call as a whole is in stream order."""
    batch = _batch()
    for first in range(0, len(copies), BATCH_MAX):
        chunk = copies[first:first + BATCH_MAX]
        dsts, srcs, sizes = batch.dsts, batch.srcs, batch.sizes
        for i, (dst, src, nbytes) in enumerate(chunk):
            dsts[i], srcs[i], sizes[i] = dst, src, nbytes
        _check("cudaMemcpyBatchAsync", batch.call(len(chunk), stream))


def record_event(event, stream: int) -> None:
    """Records `event` (a torch.cuda.Event torch has recorded once) on the stream handle `stream`."""
    _check("cudaEventRecord", _runtime().cudaEventRecord(event._as_parameter_, stream))


def wait_event(stream: int, event) -> None:
    """Work queued on `stream` after this call waits for `event`'s last record."""
    _check("cudaStreamWaitEvent", _runtime().cudaStreamWaitEvent(stream, event._as_parameter_, 0))


def launch_graph(graph_exec: int, stream: int) -> None:
    """Launches an instantiated graph (`CUDAGraph.raw_cuda_graph_exec()`) on `stream`."""
    _check("cudaGraphLaunch", _runtime().cudaGraphLaunch(graph_exec, stream))


def event_done(event) -> bool:
    """Whether the work before `event`'s last record has run (never blocks; torch's `query` costs several µs)."""
    rc = _runtime().cudaEventQuery(event._as_parameter_)
    if rc == _NOT_READY:
        return False
    _check("cudaEventQuery", rc)
    return True


def elapsed_seconds(start, end) -> float:
    """Seconds between two completed records of timing events."""
    ms = ctypes.c_float()
    _check("cudaEventElapsedTime", _runtime().cudaEventElapsedTime(ctypes.byref(ms), start._as_parameter_,
                                                                    end._as_parameter_))
    return ms.value / 1e3


def graph_exec(graph) -> int | None:
    """The instantiated graph's handle, for `launch_graph`, where this torch gives it (else None: replay it).
    Only for graphs without random-number work: torch's `replay` also advances the generators' offsets (two
    small fills per replay, most of its ~20 µs of host time on the H200), which `launch_graph` skips."""
    if _runtime() is None or not hasattr(graph, "raw_cuda_graph_exec"):
        return None
    return graph.raw_cuda_graph_exec()


def _check(call: str, rc: int) -> None:
    if rc != 0:
        raise RuntimeError(f"{call} failed with CUDA error {rc}")
