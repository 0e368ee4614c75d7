"""Host → device expert copies on a side stream, ordered against the compute stream by events.

Copies run on their own CUDA stream so they overlap the compute stream's work (hits, earlier copied experts):
one event per copied expert lets the compute stream start on an expert as soon as its own bytes have landed.
Experts the cache cannot take this step go through a ring of staging slots (at least double buffering): the copy
into a staging slot waits for the compute that last read it, through an event recorded on the compute stream.
The staging slots are the executor's, placed after the cache slots in one tensor so one gather reaches both.
Quantized experts cross the link in their block format and are dequantized on the copy stream, into the slot
(Q8_0, MXFP4 and FP8_B32 by one fused Triton launch per expert or batch, row_dequant.py; other types by the
plain-torch reference). With a block store (block_store.py) their bytes land in its rows, and experts a row
already holds are dequantized from it without crossing the link at all. Experts in pinned memory are copied
through the CUDA runtime directly (`cudart`): the host thread issuing the copies is the decode step's critical
path. On the CPU (tests, CI) the same calls run synchronously with no streams.

Shapes: S slots, H hidden, I expert intermediate.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from freetoken.engine import gpu_paths
from freetoken.engine.experts import LayerExperts
from freetoken.engine.offload import cudart
from freetoken.engine.offload.block_store import BlockStore
from freetoken.engine.offload.expert_cache import CacheCounters
from freetoken.engine.offload.quantized import PROJECTIONS, QuantizedExperts
from freetoken.engine.offload.row_dequant import RowDequantizer, fusable
from freetoken.engine.offload.staging import StagingRing
from freetoken.kernels.gguf_dequant.reference import dequantize

_ROWS_AT_LEAST = 16  # experts' block bytes the device buffers hold at first (a decode step's; they grow on demand)


def _stacks(experts: LayerExperts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return experts.gate_proj, experts.up_proj, experts.down_proj


@dataclass(slots=True)
class _Batch:
    """The copies of one layer-step, timed as a whole for the planner."""

    nbytes: int = 0
    start: object = None  # torch.cuda.Event, or a perf_counter float on the CPU
    end: object = None
    seconds: float | None = None  # CPU copies: known at once
    sample: bool = True  # False: paced by something else (compute, a kernel compiled or captured on the way)
    prefill: bool = False  # a prefill chunk's copies: paced by its staging ring and compute (its own sample kind)


class ExpertCopier:
    MARKS = 4  # events handed out by mark_compute / mark_copies before one is re-recorded

    def __init__(self, host: dict[int, LayerExperts | QuantizedExperts], device: torch.device, dtype: torch.dtype,
                 staging_slots: int = 2, counters: CacheCounters | None = None, store_rows: int = 0,
                 store_policy: str = "freq"):
        first = next(iter(host.values()))
        self.host, self.device, self.dtype = host, device, dtype
        # bytes over the link and experts dequantized from the block store are counted here, where they move
        self.counters = counters if counters is not None else CacheCounters()
        self.shapes = dict(first.shapes) if isinstance(first, QuantizedExperts) else \
            {p: tuple(getattr(first, p).shape[1:]) for p in PROJECTIONS}
        self.quantized = isinstance(first, QuantizedExperts)
        self.expert_bytes = first.expert_nbytes() if self.quantized else \
            sum(first.weights_of(0)[i].numel() for i in range(3)) * dtype.itemsize
        if store_rows and not self.quantized:
            raise ValueError("a block store keeps quantized experts' block bytes; these experts are dense")
        self.store = BlockStore(store_rows, self.expert_bytes, device, store_policy) if store_rows else None
        self._store_evicts = True  # this batch's copies may displace the store's rows (see `begin`)
        self._store_spread: int | None = None  # else: how many layers share the free rows evenly (see `begin`)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # pinned experts (dense ones of the slots' dtype): raw byte copies through the runtime, no torch dispatch
        sources = [t for le in host.values() for t in (le.raw.values() if self.quantized else
                                                        (le.gate_proj, le.up_proj, le.down_proj))]
        self._direct = self.stream is not None and cudart.available() and all(
            t.is_contiguous() and t.is_pinned() and (self.quantized or t.dtype == dtype) for t in sources)
        # GPU path "copy-batch" (dense experts; "copy-batch-blocks" for block formats): a batch's copies queued by
        # one runtime call instead of one call each; read at each batch, so a run can switch it (profile_turn.py)
        self._batch_path = "copy-batch-blocks" if self.quantized else "copy-batch"
        self._can_batch = self._direct and cudart.batch_available()
        self._ring = StagingRing(staging_slots)
        if self._direct:  # events recorded through the runtime: created (and recorded once by torch) up front
            self._stream_handle = self.stream.cuda_stream
            self._compute_mark = self._new_event()
            self._release_marks = [self._new_event() for _ in range(staging_slots)]
            self._timing_pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # free (start, end) pairs
            self._copies_mark = self._new_event()  # wait_all: the copies queued so far
            # marks handed out (`mark_compute`, `mark_copies`), each re-recorded only a ring later: a wait queued
            # on one waits for the record before it, whatever is recorded after
            self._marks = [self._new_event() for _ in range(self.MARKS)]
            self._next_mark = 0
        if self.quantized:  # block-format bytes land here before being dequantized into a slot
            self.raw = {p: torch.empty(first.raw[p].shape[1], dtype=torch.uint8, device=device) for p in PROJECTIONS}
        self._raw_batches: dict[str, torch.Tensor] = {}  # the same for several experts at once (to_slots)
        self._rows: torch.Tensor | None = None  # [n, expert bytes] on the device: block bytes of experts in transit
        self._batch: _Batch | None = None
        self._timed: list[_Batch] = []
        # the compute stream while a decode boundary runs (the executor pins it: `torch.cuda.current_stream` costs
        # the host several µs a call, about ten calls a layer-step), else looked up at each use
        self.compute: torch.cuda.Stream | None = None
        # experts of a fused format in pinned memory: an expert's block bytes land in one row of a device buffer
        # through the runtime, and one launch dequantizes a batch of rows into their slots (row_dequant.py). More
        # batches in flight than the staging ring can have: a prefill streaming a whole layer ahead queues one
        # batch per expert, and slot numbers still unread would hold the host until the link caught up.
        self.fused = RowDequantizer(host, self.stream, 2 * staging_slots + 8) \
            if self.quantized and self._direct and fusable(host, device) else None

    def compute_stream(self) -> torch.cuda.Stream:
        return self.compute if self.compute is not None else torch.cuda.current_stream(self.device)

    def mark_compute(self):
        """An event past the compute queued so far, for `wait_for` (None on the CPU)."""
        if self.stream is None:
            return None
        if not self._direct:
            return self.compute_stream().record_event()
        return self._mark(self.compute_stream().cuda_stream)

    def mark_copies(self):
        """An event past the copies queued so far, for `wait` (None on the CPU)."""
        if self.stream is None:
            return None
        return self._mark(self._stream_handle) if self._direct else self.stream.record_event()

    def wait_for(self, event) -> None:
        """Copies queued after this wait for `event` (from `mark_compute`)."""
        if self._direct:
            cudart.wait_event(self._stream_handle, event)
        else:
            self.stream.wait_event(event)

    def _mark(self, stream: int):
        event = self._marks[self._next_mark]
        self._next_mark = (self._next_mark + 1) % len(self._marks)
        cudart.record_event(event, stream)
        return event

    @property
    def staging_slots(self) -> int:
        return len(self._ring)

    def allocate(self, n: int) -> LayerExperts:
        return LayerExperts(*(torch.empty((n, *self.shapes[p]), dtype=self.dtype, device=self.device)
                              for p in PROJECTIONS))

    # -- one layer-step: begin, any number of copies, end --

    def begin(self, wait_compute: bool = True, sample: bool = True, prefill: bool = False,
              store_evicts: bool = True, store_spread: int | None = None) -> None:
        """Before the step's copies: slots about to be overwritten may still be read by queued compute.
        `wait_compute=False` when every copy goes to staging slots (their release events order them) or the
        caller orders them itself. `sample=False`: copies whose timing says nothing about the link.
        `prefill=True`: a prefill chunk's copies, paced by its staging ring and compute — what the copy path
        costs a prefill, not the link's speed; reported apart (see `finished_timings`). `store_evicts=False`:
        experts new to the block store take free rows only (a prefill chunk's, see `BlockStore.place`), with
        `store_spread` (the layers sharing them: GPU path "prefill-spread") up to an even share per layer."""
        self._batch = _Batch(sample=sample, prefill=prefill)
        self._store_evicts, self._store_spread = store_evicts, store_spread
        if self.stream is None or not wait_compute:
            return
        if self._direct:
            cudart.record_event(self._compute_mark, self.compute_stream().cuda_stream)
            cudart.wait_event(self._stream_handle, self._compute_mark)
        else:
            self.stream.wait_stream(self.compute_stream())

    def to_slot(self, layer: int, expert: int, dest: LayerExperts, slot: int):
        """Copies one expert into dest[slot]; returns what `wait` needs before computing from it."""
        with self._on_copy_stream():
            self._copy(layer, expert, dest, slot)
            return self._record()

    def to_staging(self, layer: int, expert: int, dest: LayerExperts, first: int) -> tuple[int, object]:
        """Copies one expert into the next of the staging slots dest[first:first + staging_slots], once its
        previous reader is done. Returns (ring index, what `wait` needs)."""
        i = self.reserve_staging()
        with self._on_copy_stream():
            self._copy(layer, expert, dest, first + i)
            return i, self._record()

    def to_slots_marked(self, layer: int, experts: list[int], dest: LayerExperts, slots: list[int]):
        """`to_slots` (one batch: block-format experts dequantized by one launch, dense ones by one batched copy
        where "copy-batch" is on); returns what `wait` needs before computing from any of them."""
        self.to_slots(layer, experts, dest, slots)
        return self._record()

    def to_staging_batch(self, layer: int, experts: list[int], dest: LayerExperts, first: int,
                         busy: frozenset[int] | set[int] = frozenset()) -> tuple[list[int], object]:
        """`to_staging` for several experts as one batch, into ring slots not in `busy`: (their ring indices,
        what `wait` needs)."""
        rings = self.reserve_staging_batch(len(experts), busy)
        return rings, self.to_slots_marked(layer, experts, dest, [first + i for i in rings])

    def reserve_staging(self, busy: frozenset[int] | set[int] = frozenset()) -> int:
        """The next staging ring index not in `busy` (slots holding prefetched experts not yet read); copies
        issued after this wait until its previous reader is done."""
        return self.reserve_staging_batch(1, busy)[0]

    def reserve_staging_batch(self, n: int, busy: frozenset[int] | set[int] = frozenset()) -> list[int]:
        """`reserve_staging` for `n` slots at once (one batch's copies): the copy stream waits once per release
        that freed them (staging.py)."""
        rings, waits = self._ring.reserve(n, busy)
        if self.stream is not None:
            for event in waits:
                if self._direct:
                    cudart.wait_event(self._stream_handle, event)
                else:
                    self.stream.wait_event(event)
        return rings

    def to_slots(self, layer: int, experts: list[int], dest: LayerExperts, slots: list[int]) -> None:
        """Copies several experts into dest[slots]. Quantized ones are dequantized together, one kernel sequence
        per projection for all of them instead of one per expert (the launches were the cost, not the bytes).
        The slots must differ: a batch writes them in no particular order."""
        if len(set(slots)) != len(slots):
            raise ValueError(f"one slot twice in a batch of copies: {slots}")
        if not self.quantized:
            if self._batches_copies():
                self._dense_batch(layer, experts, dest, slots)
                return
            with self._on_copy_stream():
                for e, slot in zip(experts, slots, strict=True):
                    self._copy(layer, e, dest, slot)
            return
        if self.store is not None:
            self._store_copies(layer, experts, dest, slots)
            return
        if self.fused:  # enters the copy stream only where torch launches something
            self._fused_copies(layer, experts, dest, slots)
            return
        if len(experts) < 2:
            for e, slot in zip(experts, slots, strict=True):
                self.to_slot(layer, e, dest, slot)
            return
        with self._on_copy_stream():
            self._start_timing()
            src, n = self.host[layer], len(experts)
            # from pinned memory: a pageable copy would hold the host until the copy stream had drained
            index = torch.tensor(slots, pin_memory=self.stream is not None).to(self.device, non_blocking=True)
            for p in PROJECTIONS:
                raw = self._raw_batch(p, n)
                for i, e in enumerate(experts):
                    raw[i].copy_(src.raw[p][e], non_blocking=True)  # only the block-format bytes cross the link
                out, inp = self.shapes[p]
                values = dequantize(raw.view(-1), src.type_names[p], n * out * inp, self.dtype).view(n, out, inp)
                getattr(dest, p).index_copy_(0, index, values)
            self._finish_timing(n)

    def _batches_copies(self) -> bool:
        if not self._can_batch:
            return False
        # GPU path "copy-batch-prefill": a prefill chunk's batches of block-format experts only (decode's measured
        # 0.88-0.96x at 16 GiB under copy-batch-blocks, a streamed turn's 1.07x)
        return gpu_paths.enabled(self._batch_path) or (
            self._batch is not None and self._batch.prefill and gpu_paths.enabled("copy-batch-prefill"))

    def _raw_rows(self, n: int) -> torch.Tensor:
        """[n, expert bytes] on the device: whole experts' block bytes, gate, up and down back to back."""
        if self._rows is None or self._rows.shape[0] < n:
            self._rows = torch.empty((max(n, _ROWS_AT_LEAST), self.expert_bytes), dtype=torch.uint8,
                                     device=self.device)
        return self._rows[:n]

    def _fused_copies(self, layer: int, experts: list[int], dest: LayerExperts, slots: list[int]) -> None:
        """On the copy stream: the experts' block bytes into rows of the device buffer (three runtime calls
        each), then one launch dequantizes every row into its slot. Stream order keeps the next batch's copies
        into these rows behind this launch."""
        self._start_timing()
        n = len(experts)
        copies = self.fused.block_copies(layer, experts, self._raw_rows(n).data_ptr())
        self._queue_copies(copies, self.stream.cuda_stream)
        self._dequantize_rows(n, dest, slots)
        self._finish_timing(n)

    def stored(self, layer: int, expert: int) -> bool:
        """Whether the block store holds the expert: then making it present costs no link bytes."""
        return self.store is not None and (layer, expert) in self.store.cache.slot_of

    def _store_copies(self, layer: int, experts: list[int], dest: LayerExperts, slots: list[int]) -> None:
        """Quantized experts through the block store: those it holds are dequantized from their rows; the others'
        bytes cross the link into the rows it admits them to (else into transient rows) and are dequantized from
        there. The held ones' launch comes first and outside the batch's timing: it needs no link, so the GPU
        runs it while the host still queues the copies, and a link sample counts only link bytes and their
        dequantizing (with it inside, a batch of store hits read as a slow link to the planner)."""
        placed = self.store.place(layer, experts, self._store_evicts, self._store_spread)
        near = [i for i, (_, fetch) in enumerate(placed) if not fetch]
        far = [i for i, (_, fetch) in enumerate(placed) if fetch]
        if near:
            self._rows_into_slots(dest, [slots[i] for i in near], [placed[i][0] for i in near])
        if far:
            self._start_timing()
            experts, slots, rows = ([xs[i] for i in far] for xs in (experts, slots, [row for row, _ in placed]))
            if self.fused:
                self._fused_store_copies(layer, experts, dest, slots, rows)
            else:
                with self._on_copy_stream():
                    self._plain_store_copies(layer, experts, dest, slots, rows)
            self._finish_timing(len(far))
        self.counters.store_hits += len(near)

    def _rows_into_slots(self, dest: LayerExperts, slots: list[int], rows: list[int]) -> None:
        """Experts the block store holds, dequantized from their rows into `slots` on the copy stream."""
        if self.fused:
            self._dequantize_rows(len(rows), dest, slots, rows)
            return
        src = next(iter(self.host.values()))  # every layer's experts share one format
        with self._on_copy_stream():
            for slot, row in zip(slots, rows, strict=True):
                self._dequantize_row(src, self.store.rows[row], dest, slot)

    def _fused_store_copies(self, layer: int, experts: list[int], dest: LayerExperts, slots: list[int],
                            rows: list[int | None]) -> None:
        """Experts new to the device: block bytes over the link into their store rows (or transient rows where
        the store took them not), then one launch per kind of row."""
        transient = [i for i, row in enumerate(rows) if row is None]
        kept = [i for i, row in enumerate(rows) if row is not None]
        copies = self.fused.block_copies(layer, [experts[i] for i in transient],
                                    self._raw_rows(len(transient)).data_ptr()) if transient else []
        store = self.store.rows
        for i in kept:
            copies += self.fused.block_copies(layer, [experts[i]], store.data_ptr() + rows[i] * store.stride(0))
        self._queue_copies(copies, self.stream.cuda_stream)
        if transient:
            self._dequantize_rows(len(transient), dest, [slots[i] for i in transient])
        if kept:
            self._dequantize_rows(len(kept), dest, [slots[i] for i in kept], [rows[i] for i in kept])

    def _plain_store_copies(self, layer: int, experts: list[int], dest: LayerExperts, slots: list[int],
                            rows: list[int | None]) -> None:
        """The same expert by expert through the plain-torch reference (no fused kernel: the CPU, other types)."""
        src = self.host[layer]
        for e, slot, row in zip(experts, slots, rows, strict=True):
            buf = self._raw_rows(1)[0] if row is None else self.store.rows[row]
            at = 0
            for p in PROJECTIONS:  # only the block-format bytes cross the link
                nbytes = src.raw[p].shape[1]
                buf[at:at + nbytes].copy_(src.raw[p][e], non_blocking=True)
                at += nbytes
            self._dequantize_row(src, buf, dest, slot)

    def _dequantize_row(self, src: QuantizedExperts, buf: torch.Tensor, dest: LayerExperts, slot: int) -> None:
        """One expert's block bytes (gate, up, down back to back in `buf`) into dest[slot], plain torch."""
        at = 0
        for p, d in zip(PROJECTIONS, dest.weights_of(slot), strict=True):
            nbytes = src.raw[p].shape[1]
            d.copy_(src.dequantized(0, p, self.dtype, buf[at:at + nbytes]))
            at += nbytes

    def _dense_batch(self, layer: int, experts: list[int], dest: LayerExperts, slots: list[int]) -> None:
        """Pinned dense experts into their slots, every projection of every expert in one batch (GPU path
        "copy-batch")."""
        self._start_timing()
        self._queue_copies(self._dense_copies(layer, experts, dest, slots), self.stream.cuda_stream)
        self._finish_timing(len(experts))

    def _dense_copies(self, layer: int, experts: list[int], dest: LayerExperts,
                      slots: list[int]) -> list[tuple[int, int, int]]:
        """(device address, host address, bytes) of each projection of each pinned dense expert into its slot."""
        copies = []
        for d, s in zip(_stacks(dest), _stacks(self.host[layer]), strict=True):
            n = d.stride(0) * d.element_size()  # one expert's projection: contiguous, same size on both sides
            copies += [(d.data_ptr() + slot * n, s.data_ptr() + e * n, n) for e, slot in zip(experts, slots,
                                                                                              strict=True)]
        return copies

    def _queue_copies(self, copies: list[tuple[int, int, int]], stream: int) -> None:
        """(device address, pinned host address, bytes) copies, by one runtime call ("copy-batch") or one each."""
        if self._batches_copies():
            cudart.copy_batch_to_device(copies, stream)
            return
        for dst, src, nbytes in copies:
            cudart.copy_to_device(dst, src, nbytes, stream)

    def _dequantize_rows(self, n: int, dest: LayerExperts, slots: list[int], sources: list[int] | None = None) -> None:
        """Rows [0, n) of the transit buffer (or the block store's rows `sources`) into their slots, one launch."""
        rows = self.store.rows if sources is not None else self._rows
        self._batch.sample &= self.fused.dequantize(rows, n, dest, slots, sources)

    def _raw_batch(self, projection: str, n: int) -> torch.Tensor:
        buf = self._raw_batches.get(projection)
        if buf is None or buf.shape[0] < n:
            width = self.raw[projection].shape[0]
            buf = torch.empty((max(n, _ROWS_AT_LEAST), width), dtype=torch.uint8, device=self.device)
            self._raw_batches[projection] = buf
        return buf[:n]

    def wait(self, done) -> None:
        """Makes the compute stream wait for one copy."""
        if done is None:
            return
        if self._direct:
            cudart.wait_event(self.compute_stream().cuda_stream, done)
        else:
            self.compute_stream().wait_event(done)

    def wait_all(self) -> None:
        """Makes the compute stream wait for every copy issued so far."""
        if self._direct:
            cudart.record_event(self._copies_mark, self._stream_handle)
            cudart.wait_event(self.compute_stream().cuda_stream, self._copies_mark)
        elif self.stream is not None:
            self.compute_stream().wait_stream(self.stream)

    def release(self, *staging: int) -> None:
        """The compute stream has queued its last read of these staging slots (ring indices). One event marks
        them all (a short chunk's layer releases ~100 at once): on the runtime path the first slot's own mark.
        Re-recorded later for that slot alone, it makes the others wait for a later point of the compute
        stream than theirs: longer at worst, never wrong, as that point was queued before any copy that waits."""
        if self.stream is None or not staging:
            return
        if self._direct:
            event = self._release_marks[staging[0]]
            cudart.record_event(event, self.compute_stream().cuda_stream)
        else:
            event = self.compute_stream().record_event()
        self._ring.released(staging, event)

    def end(self) -> None:
        batch, self._batch = self._batch, None
        if batch is not None and batch.nbytes:
            if self._direct:
                cudart.record_event(batch.end, self._stream_handle)
            elif self.stream is not None:
                batch.end = torch.cuda.Event(enable_timing=True)
                batch.end.record(self.stream)
            self._timed.append(batch)

    def idle(self) -> bool:
        """Whether every batch of copies queued so far has landed (never blocks)."""
        last = self._timed[-1] if self._timed else None
        return last is None or last.seconds is not None or self._done(last.end)

    @property
    def batch_is_sample(self) -> bool:
        """False when the open batch compiled or captured a kernel: the host's time to queue it is no sample."""
        return self._batch is not None and self._batch.sample

    def finished_timings(self) -> list[tuple[int, float, bool, bool]]:
        """(bytes, seconds, sample, prefill) of the steps whose copies have completed since the last call; never
        blocks. `sample` is False for batches whose timing is no sample (see `begin`)."""
        done, pending = [], []
        for b in self._timed:
            if b.seconds is not None:
                done.append((b.nbytes, b.seconds, b.sample, b.prefill))
            elif self._done(b.end):
                seconds = cudart.elapsed_seconds(b.start, b.end) if self._direct else b.start.elapsed_time(b.end) / 1e3
                done.append((b.nbytes, seconds, b.sample, b.prefill))
                if self._direct:
                    self._timing_pairs.append((b.start, b.end))
            else:
                pending.append(b)
        self._timed = pending
        return done

    # -- internals --

    def _done(self, event) -> bool:
        return cudart.event_done(event) if self._direct else event.query()

    def _on_copy_stream(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def _new_event(self, timing: bool = False) -> torch.cuda.Event:
        """An event torch has recorded once (on the copy stream), so the runtime can re-record it."""
        event = torch.cuda.Event(enable_timing=timing)
        event.record(self.stream)
        return event

    def _record(self):
        return self.stream.record_event() if self.stream is not None else None

    def _start_timing(self) -> None:
        batch = self._batch
        if batch.start is not None:
            return
        if self._direct:
            batch.start, batch.end = self._timing_pairs.pop() if self._timing_pairs else \
                (self._new_event(timing=True), self._new_event(timing=True))
            cudart.record_event(batch.start, self._stream_handle)
        elif self.stream is not None:
            batch.start = torch.cuda.Event(enable_timing=True)
            batch.start.record(self.stream)
        else:
            batch.start = time.perf_counter()

    def _finish_timing(self, experts: int) -> None:
        """`experts`: how many crossed the link in the call."""
        batch = self._batch
        batch.nbytes += experts * self.expert_bytes
        self.counters.bytes_copied += experts * self.expert_bytes
        if self.stream is None:
            batch.seconds = time.perf_counter() - batch.start

    def _copy(self, layer: int, expert: int, dest: LayerExperts, slot: int) -> None:
        if self.store is not None:
            self._store_copies(layer, [expert], dest, [slot])
            return
        if self.fused:
            self._fused_copies(layer, [expert], dest, [slot])
            return
        self._start_timing()
        src = self.host[layer]
        if self.quantized:
            for p, d in zip(PROJECTIONS, dest.weights_of(slot), strict=True):
                raw = self.raw[p]
                raw.copy_(src.raw[p][expert], non_blocking=True)  # only the block-format bytes cross the link
                d.copy_(src.dequantized(expert, p, self.dtype, raw))
        elif self._direct:
            self._queue_copies(self._dense_copies(layer, [expert], dest, [slot]), self.stream.cuda_stream)
        else:
            for d, s in zip(dest.weights_of(slot), src.weights_of(expert), strict=True):
                d.copy_(s, non_blocking=True)  # pinned host memory → asynchronous DMA
        self._finish_timing(1)
