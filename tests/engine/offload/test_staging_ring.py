"""The copier's staging ring (staging.py): which slots a batch reserves, and what its copies wait for before they
overwrite them (each slot's last reader on the compute stream). Runs on the CPU with recording stand-ins for the
streams: the waits are what matters here, not the copies."""

from __future__ import annotations

import pytest
import torch

from freetoken.engine.experts import LayerExperts
from freetoken.engine.offload.transfer import ExpertCopier


class _Stream:
    """Records the events a stream is asked to wait for, and hands out numbered events."""

    def __init__(self):
        self.waits, self.recorded = [], 0

    def wait_event(self, event) -> None:
        self.waits.append(event)

    def record_event(self) -> int:
        self.recorded += 1
        return self.recorded


def _copier(slots: int) -> tuple[ExpertCopier, _Stream, _Stream]:
    host = {0: LayerExperts(*(torch.zeros(4, 2, 2) for _ in range(3)))}
    copier = ExpertCopier(host, torch.device("cpu"), torch.float32, staging_slots=slots)
    copies, compute = _Stream(), _Stream()
    copier.stream, copier.compute = copies, compute  # as on CUDA without the runtime path (`_direct` False)
    return copier, copies, compute


def test_a_batch_takes_the_next_free_slots_in_ring_order_as_single_reservations_would():
    batched, _, _ = _copier(6)
    single, _, _ = _copier(6)
    busy = {1, 4}
    assert batched.reserve_staging_batch(3, busy) == [single.reserve_staging(busy) for _ in range(3)] == [0, 2, 3]
    assert batched.reserve_staging_batch(2, busy) == [single.reserve_staging(busy) for _ in range(2)] == [5, 0]
    with pytest.raises(RuntimeError, match="every staging slot is busy"):
        batched.reserve_staging_batch(5, busy)


def test_a_batch_waits_once_for_each_release_that_freed_its_slots():
    copier, copies, _ = _copier(8)
    assert copier.reserve_staging_batch(8) == list(range(8)) and copies.waits == []  # never read yet: no wait
    copier.release(0, 1, 2)  # compute event 1
    copier.release(3)  # 2
    copier.release(4, 5, 6, 7)  # 3
    assert copier.reserve_staging_batch(5) == [0, 1, 2, 3, 4]
    assert copies.waits == [1, 2, 3]
    copier.release(0, 1)  # 4: slots 0 and 1 read again since
    copies.waits.clear()
    assert copier.reserve_staging_batch(5) == [5, 6, 7, 0, 1]
    assert copies.waits == [3, 4]


def test_on_the_runtime_path_a_release_records_one_mark_for_all_its_slots(monkeypatch):
    """With the runtime's calls (`_direct`): one cudaEventRecord per `release`, not one per slot, and a batch then
    waits once for it."""
    from freetoken.engine.offload import cudart

    copier, _, compute = _copier(6)
    calls = []
    monkeypatch.setattr(cudart, "record_event", lambda event, stream: calls.append(("record", event, stream)))
    monkeypatch.setattr(cudart, "wait_event", lambda stream, event: calls.append(("wait", event, stream)))
    compute.cuda_stream = "compute"
    copier._direct, copier._stream_handle = True, "copy"
    copier._release_marks = [f"mark {i}" for i in range(6)]
    copier.reserve_staging_batch(6)
    copier.release(2, 3, 4)
    copier.release(5)
    assert calls == [("record", "mark 2", "compute"), ("record", "mark 5", "compute")]
    calls.clear()
    copier.reserve_staging_batch(3, busy={0, 1})
    assert calls == [("wait", "mark 2", "copy")]
