"""GPU path "dequant-stream": a prefill batch's dequantizing launches on a stream of their own.

On the copy stream alone, each batch of block-format experts is its copies, then the launch that dequantizes them
into their slots, and the next batch's copies wait behind that launch: the link idles while the SMs dequantize
(a 500-token turn under a block store kept the copy stream busy 57-67% of the turn, 46 GB/s while busy). Here the
copy stream only copies; the dequantizing stream takes each batch once its copies have landed (`hand_over`), so
the link streams the next batch meanwhile. Batches not meant for it (decode's) join it first (`join`): the block
store's rows and the index buffer are then written again only after every launch that reads them.

Transient rows (experts' block bytes the block store does not keep) come from a ring of SEGMENTS buffers: the copy
stream writes a segment again only once the launch that read it last has run.
"""

from __future__ import annotations

import torch

from freetoken.engine.offload import cudart

SEGMENTS = 2  # transient row buffers: a batch's copies land in one while the launch of the last reads the other


class DequantStream:
    def __init__(self, device: torch.device, expert_bytes: int, copy_handle: int, rows_at_least: int):
        self.stream = torch.cuda.Stream(device)
        self.handle = self.stream.cuda_stream
        self.device, self.expert_bytes, self._copy, self._at_least = device, expert_bytes, copy_handle, rows_at_least
        self._landed, self._tail = self._event(), self._event()
        self._segments: list[torch.Tensor | None] = [None] * SEGMENTS
        self._segment_read = [self._event() for _ in range(SEGMENTS)]
        self._next = 0
        self.pending = False  # launches queued here that the copy stream has not waited for
        self.used = False

    def _event(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(self.stream)  # recorded once by torch, so the runtime can re-record it
        return event

    def hand_over(self) -> None:
        """Launches queued here from now on run after everything queued on the copy stream so far (this batch's
        copies, its staging slots' release waits)."""
        cudart.record_event(self._landed, self._copy)
        cudart.wait_event(self.handle, self._landed)
        self.pending = self.used = True

    def join(self) -> None:
        """The copy stream waits for every launch queued here (before work that may rewrite what they read)."""
        if self.pending:
            cudart.record_event(self._tail, self.handle)
            cudart.wait_event(self._copy, self._tail)
            self.pending = False

    def wait_by(self, stream_handle: int) -> None:
        """`stream_handle` waits for every launch queued here."""
        if self.used:
            cudart.record_event(self._tail, self.handle)
            cudart.wait_event(stream_handle, self._tail)

    def record(self) -> torch.cuda.Event:
        """An event past the launches queued here so far (what compute waits for before reading their slots)."""
        return self.stream.record_event()

    def segment(self, n: int) -> tuple[int, torch.Tensor]:
        """(index, [n, expert bytes]) of the next transient row buffer, once the copy stream has waited for its
        last reader; `read(index)` after queueing the launch that reads it."""
        j = self._next
        self._next = (j + 1) % SEGMENTS
        buf = self._segments[j]
        if buf is None or buf.shape[0] < n:
            self._segment_read[j].synchronize()  # (rare: a larger batch) the old buffer may still be read
            buf = self._segments[j] = torch.empty((max(n, self._at_least), self.expert_bytes), dtype=torch.uint8,
                                                  device=self.device)
        cudart.wait_event(self._copy, self._segment_read[j])
        return j, buf[:n]

    def read(self, j: int) -> None:
        cudart.record_event(self._segment_read[j], self.handle)
