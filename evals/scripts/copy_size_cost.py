"""Host time of one pinned host → device copy by its size, on an idle host and while the CPU reads DRAM (H200
diagnostic).

    python evals/scripts/copy_size_cost.py [--reps 50]

Offloaded decode's host thread queues each copied expert as three `cudaMemcpyAsync` calls; on the H200 host a
queued bf16 expert (3 × 3.1 MB) cost it ~34 µs and a Q8_0 one (3 × 1.7 MB) ~22 µs while the CPU share ran
(profile-perf-h200.md), where an idle host queues a copy in ~2.4 µs (copier-host-cost-h200.md). A cost that grows
with the bytes points at per-page work of the driver. Rows: memory pinned as the host expert store pins it
(torch's pinned allocator, `cudaHostAlloc`), and anonymous memory advised to huge pages and registered with
`cudaHostRegister`; each idle and under a DRAM load (the CPU expert kernel's threads reading a large buffer, as
the CPU share does). Each copy is queued on an idle stream and timed on the host only. Then twelve copies queued
one call each against one batch call (GPU path "copy-batch"). Prints markdown tables; a diagnostic, not a
benchmark.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import mmap
import statistics
import threading
import time

import torch

from freetoken.engine.offload import cudart
from freetoken.kernels.cpu_experts.kernel import CpuExpertKernel

SIZES_MB = (0.25, 1.0, 1.7, 3.1, 8.0)  # 1.7 / 3.1: one projection of a Q8_0 / bf16 qwen3-30b-a3b expert
LARGEST = int(max(SIZES_MB) * 1e6)


class DramLoad:
    """The CPU kernel's pool reading a buffer over and over in a background thread (the GIL is released)."""

    def __init__(self, gib: float = 4.0):
        self.kernel = CpuExpertKernel.get(threads=15)
        self.buf = torch.ones(int(gib * 2**30), dtype=torch.uint8)
        self.reads = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.kernel.read_bytes(self.buf)
            self.reads += 1

    def __enter__(self) -> DramLoad:
        self._thread.start()
        time.sleep(0.2)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def huge_page_pinned(nbytes: int) -> tuple[mmap.mmap, int]:
    """Anonymous memory advised to transparent huge pages, touched, and registered with the runtime."""
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    region.write(b"\1" * nbytes)
    address = ctypes.addressof(ctypes.c_char.from_buffer(region))
    lib = cudart._runtime()
    lib.cudaHostRegister.argtypes, lib.cudaHostRegister.restype = [ctypes.c_void_p, ctypes.c_size_t,
                                                                   ctypes.c_uint], ctypes.c_int
    cudart._check("cudaHostRegister", lib.cudaHostRegister(address, nbytes, 0))
    return region, address


def unregister(address: int) -> None:
    lib = cudart._runtime()
    lib.cudaHostUnregister.argtypes, lib.cudaHostUnregister.restype = [ctypes.c_void_p], ctypes.c_int
    cudart._check("cudaHostUnregister", lib.cudaHostUnregister(address))


def host_us(src: int, dst: int, nbytes: int, stream: torch.cuda.Stream, reps: int) -> float:
    """Median host µs to queue one copy of `nbytes` (the stream drained before each)."""
    samples = []
    for _ in range(reps + 3):
        stream.synchronize()
        t0 = time.perf_counter()
        cudart.copy_to_device(dst, src, nbytes, stream.cuda_stream)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples[3:]) * 1e6


def batch_host_us(src: int, dst: int, nbytes: int, copies: int, stream: torch.cuda.Stream, reps: int,
                  batched: bool) -> float:
    """Median host µs to queue `copies` copies of `nbytes` each (a layer-step's: four Q8_0 experts are twelve), one
    `cudaMemcpyAsync` each or one `cudaMemcpyBatchAsync` (GPU path "copy-batch")."""
    batch = [(dst + i * nbytes, src + i * nbytes, nbytes) for i in range(copies)]
    samples = []
    for _ in range(reps + 3):
        stream.synchronize()
        t0 = time.perf_counter()
        if batched:
            cudart.copy_batch_to_device(batch, stream.cuda_stream)
        else:
            for d, s, n in batch:
                cudart.copy_to_device(d, s, n, stream.cuda_stream)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples[3:]) * 1e6


def batch_table(reps: int) -> None:
    """Twelve copies of 1.7 MB (a Q8_0 layer-step of four experts) by single calls and by one batch call."""
    nbytes, copies = 1_700_000, 12
    dst = torch.empty(nbytes * copies, dtype=torch.uint8, device="cuda")
    src = torch.ones(nbytes * copies, dtype=torch.uint8, pin_memory=True)
    stream = torch.cuda.Stream()
    print(f"\n{copies} copies of {nbytes / 1e6} MB, host µs to queue them all (medians of {reps}):\n")
    print("| DRAM load | one cudaMemcpyAsync each | one cudaMemcpyBatchAsync |")
    print("| --- | ---: | ---: |")
    for loaded in (False, True):
        load = DramLoad() if loaded else None
        with load or contextlib.nullcontext():
            cells = [batch_host_us(src.data_ptr(), dst.data_ptr(), nbytes, copies, stream, reps, batched)
                     for batched in (False, True)]
        print(f"| {'15 threads reading' if loaded else 'idle'} | {cells[0]:.1f} µs | {cells[1]:.1f} µs |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=50)
    a = parser.parse_args()
    torch.cuda.init()
    dst = torch.empty(LARGEST, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    pinned = torch.ones(LARGEST, dtype=torch.uint8, pin_memory=True)
    region, huge = huge_page_pinned(LARGEST + 2**21)
    sources = {"cudaHostAlloc (torch pinned)": pinned.data_ptr(),
               "huge pages + cudaHostRegister": (huge + 2**21 - 1) // 2**21 * 2**21}
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; {a.reps} copies per cell, medians\n")
    print("| memory | DRAM load | " + " | ".join(f"{mb} MB" for mb in SIZES_MB) + " |")
    print("| --- | --- | " + " | ".join("---:" for _ in SIZES_MB) + " |")
    for loaded in (False, True):
        load = DramLoad() if loaded else None
        with load or contextlib.nullcontext():
            for name, src in sources.items():
                cells = [host_us(src, dst.data_ptr(), int(mb * 1e6), stream, a.reps) for mb in SIZES_MB]
                print(f"| {name} | {'15 threads reading' if loaded else 'idle'} | "
                      + " | ".join(f"{us:.1f} µs" for us in cells) + " |", flush=True)
        if load is not None:
            print(f"\n(the load read its {load.buf.numel() / 2**30:.0f} GiB buffer {load.reads} times)")
    unregister(huge)  # (the mapping stays until exit: a ctypes view of it is still alive)
    if cudart.batch_available():
        batch_table(a.reps)
    else:
        print("\n(no cudaMemcpyBatchAsync in this runtime: the batch table is skipped)")


if __name__ == "__main__":
    main()
