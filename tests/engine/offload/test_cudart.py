"""The runtime calls of the copy path, as far as a machine without CUDA can check them: how a batch of copies fills
`cudaMemcpyBatchAsync`'s arguments. The calls themselves run in the CUDA tests (test_quantized_experts.py)."""

from __future__ import annotations

import ctypes

import pytest

from freetoken.engine.offload import cudart


class _RecordingBatch(cudart._BatchArgs):
    """The argument arrays without a runtime: each call records what they hold."""

    def __init__(self, rc: int = 0):
        pointers, sizes = ctypes.c_void_p * cudart.BATCH_MAX, ctypes.c_size_t * cudart.BATCH_MAX
        self.dsts, self.srcs, self.sizes = pointers(), pointers(), sizes()
        self.rc, self.calls = rc, []

    def call(self, count: int, stream: int) -> int:
        self.calls.append(([(self.dsts[i], self.srcs[i], self.sizes[i]) for i in range(count)], stream))
        return self.rc


def test_a_batch_of_copies_goes_to_the_runtime_in_calls_of_at_most_batch_max(monkeypatch):
    batch = _RecordingBatch()
    monkeypatch.setattr(cudart, "_batch", lambda: batch)
    copies = [(1 << 40 | i, 1 << 20 | i, 64 + i) for i in range(cudart.BATCH_MAX + 3)]
    cudart.copy_batch_to_device(copies, stream=7)
    assert [len(c) for c, _ in batch.calls] == [cudart.BATCH_MAX, 3]
    assert [c for chunk, _ in batch.calls for c in chunk] == copies and {s for _, s in batch.calls} == {7}


def test_a_failed_batch_raises_with_the_runtimes_error(monkeypatch):
    monkeypatch.setattr(cudart, "_batch", lambda: _RecordingBatch(rc=1))
    with pytest.raises(RuntimeError, match="cudaMemcpyBatchAsync failed with CUDA error 1"):
        cudart.copy_batch_to_device([(1, 2, 3)], stream=0)


def test_the_copy_attributes_have_the_runtimes_layout():
    """cudaMemcpyAttributes: the source access order (an enum), two cudaMemLocation hints (type, id) and flags."""
    assert ctypes.sizeof(cudart._MemLocation) == 8 and ctypes.sizeof(cudart._MemcpyAttributes) == 24
    assert cudart._MemcpyAttributes.flags.offset == 20
    assert cudart._MemcpyAttributes(srcAccessOrder=cudart._SRC_ACCESS_ORDER_STREAM).srcAccessOrder == 1
