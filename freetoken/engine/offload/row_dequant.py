"""Rows of block-format expert bytes on the device, dequantized into expert slots by one fused Triton launch a batch.

The copier (transfer.py) lands experts' block bytes (gate, up and down back to back: one row an expert) in a device
buffer or in the block store's rows; this queues the launch that dequantizes a batch of rows into their slots, on
the copy stream. Triton's launcher costs the host tens of µs a call, and that host thread is the decode step's
critical path; a CUDA graph replay costs a few. So the first launch compiles the kernel, each batch size's first
use captures its graph (capturing runs nothing, so it is safe whatever the slots hold), and a cache resize (the
slots move) recaptures. Replays go through the runtime where torch gives the graph's handle (no stream context).
Only experts of one fused format (Q8_0, MXFP4, FP8_B32) in pinned memory on CUDA take this path.
"""

from __future__ import annotations

import torch

from freetoken.engine.experts import LayerExperts
from freetoken.engine.offload import cudart
from freetoken.engine.offload.quantized import PROJECTIONS, QuantizedExperts
from freetoken.kernels.gguf_dequant import fused

DEQUANT_GRAPHS = True  # replay the fused dequantiser's launch from a CUDA graph per batch size (False: launch it)


def fusable(host: dict[int, QuantizedExperts], device: torch.device) -> bool:
    """Whether every layer's experts are of one format the fused kernel reads, on a device it runs on."""
    return fused.available(device) and all(
        set(le.type_names.values()) <= fused.SUPPORTED and len(set(le.type_names.values())) == 1
        for le in host.values())


class RowDequantizer:
    def __init__(self, host: dict[int, QuantizedExperts], stream: torch.cuda.Stream, batches_in_flight: int):
        """`batches_in_flight`: how many batches' slot numbers may wait on the copy stream at once."""
        first = next(iter(host.values()))
        self.stream, self._stream_handle = stream, stream.cuda_stream
        self.type_name = first.type_names["gate_proj"]
        # per layer: (address of expert 0, bytes per expert) of each projection: no tensor indexing per copy
        self._sources = {layer: [(le.raw[p].data_ptr(), le.raw[p].shape[1]) for p in PROJECTIONS]
                         for layer, le in host.items()}
        # a batch's slot numbers cross from a ring of pinned rows: the host fills a row only once the copy that
        # read it last time has run (its event). A row: the slot numbers, then (from the block store) source rows.
        most = first.num_experts
        self._index_host = torch.empty((batches_in_flight, 2 * most), dtype=torch.int64, pin_memory=True)
        self._index_rows = self._index_host.numpy()
        self._index_read = [self._recorded_event() for _ in range(batches_in_flight)]
        self._index_next = 0
        self._index_device = torch.empty(2 * most, dtype=torch.int64, device=stream.device)  # read in stream order
        # (n, from the store) → (pointers, graph, its exec handle or None)
        self._graphs: dict[tuple[int, bool], tuple] = {}
        self._launched: set[tuple[bool, bool]] = set()  # kernel variants compiled: (slot numbers read, from store)

    def block_copies(self, layer: int, experts: list[int], at: int) -> list[tuple[int, int, int]]:
        """(device address, host address, bytes) of each projection of the experts' block bytes, the experts back
        to back from device address `at` (one expert: one row)."""
        copies, sources = [], self._sources[layer]
        for e in experts:
            for address, nbytes in sources:
                copies.append((at, address + e * nbytes, nbytes))
                at += nbytes
        return copies

    def dequantize(self, rows: torch.Tensor, n: int, dest: LayerExperts, slots: list[int],
                   sources: list[int] | None = None) -> bool:
        """Rows [0, n) of `rows` (or its rows `sources`: the block store's) into dest[slots] on the copy stream.
        False when this call compiled the kernel or captured a graph: the batch's time is then no sample of the
        link."""
        stacks, stored = (dest.gate_proj, dest.up_proj, dest.down_proj), sources is not None
        raw = rows if stored else rows[:n]
        # a graph reads its slot numbers from the device, like a batch, and so does a launch from the store
        use_rows = DEQUANT_GRAPHS or n > 1 or stored
        compiles = (use_rows, stored) not in self._launched
        if not DEQUANT_GRAPHS or compiles:
            self._launched.add((use_rows, stored))
            index = self._slot_index(slots + (sources or [])) if use_rows else slots[0]
            with torch.cuda.stream(self.stream):
                fused.dequantize_into(raw, self.type_name, stacks, *_split_index(index, n, stored))
            return not compiles
        index = self._slot_index(slots + (sources or []))
        pointers = (raw.data_ptr(), *(t.data_ptr() for t in stacks))
        entry = self._graphs.get((n, stored))
        sample = entry is not None and entry[0] == pointers
        if not sample:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(self.stream):
                graph.capture_begin(capture_error_mode="thread_local")  # the CPU expert threads never touch CUDA
                fused.dequantize_into(raw, self.type_name, stacks, *_split_index(index, n, stored))
                graph.capture_end()
            handle = graph.raw_cuda_graph_exec() if hasattr(graph, "raw_cuda_graph_exec") else None
            entry = self._graphs[(n, stored)] = (pointers, graph, handle)
        if entry[2] is not None:
            cudart.launch_graph(entry[2], self._stream_handle)
        else:
            with torch.cuda.stream(self.stream):
                entry[1].replay()
        return sample

    def _slot_index(self, slots: list[int]) -> torch.Tensor:
        """The slot numbers as a device tensor, queued on the copy stream without holding the host."""
        k = self._index_next
        self._index_next = (k + 1) % len(self._index_read)
        self._index_read[k].synchronize()  # queued a ring of batches ago: long done in practice
        n = len(slots)
        self._index_rows[k, :n] = slots
        row_bytes = self._index_rows.shape[1] * 8
        cudart.copy_to_device(self._index_device.data_ptr(), self._index_host.data_ptr() + k * row_bytes, n * 8,
                              self._stream_handle)
        cudart.record_event(self._index_read[k], self._stream_handle)
        return self._index_device[:n]

    def _recorded_event(self) -> torch.cuda.Event:
        """An event torch has recorded once (on the copy stream), so the runtime can re-record it."""
        event = torch.cuda.Event()
        event.record(self.stream)
        return event


def _split_index(index, n: int, stored: bool) -> tuple:
    """(destination rows, source rows or None) for `fused.dequantize_into` from one `_slot_index` tensor."""
    return (index[:n], index[n:]) if stored else (index, None)
