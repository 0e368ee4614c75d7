"""Python's cyclic collector in a serving process: the objects loading left behind taken out of its scans, and its
pauses counted for /v1/stats.

A full collection scans every object the collector tracks and holds the GIL while it does, so the engine's worker
stops wherever it is, between two layers of a decode step. After a model has loaded that is about half a million
objects (torch, triton, the tokenizer's tables): 220 ms a full collection on the CI-class core. Almost all of them
live as long as the process. `freeze_loaded()` moves them into the permanent generation (`gc.freeze`), after
which a full collection scans only what serving allocated since (well under a millisecond right after). The last
server to close thaws them, so a process that goes on (the tests) can collect them again.
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

_lock = threading.Lock()
_frozen_by = 0  # servers open that froze the heap


def freeze_loaded() -> None:
    """Collects once, then freezes every object alive now (call when a model has loaded)."""
    global _frozen_by
    with _lock:
        gc.collect()
        gc.freeze()
        _frozen_by += 1


def thaw() -> None:
    """Undoes one `freeze_loaded`; the last one returns the frozen objects to the collector."""
    global _frozen_by
    with _lock:
        _frozen_by -= 1
        if _frozen_by == 0:
            gc.unfreeze()


class GcPauses:
    """Per generation (0, 1, 2 = full): collections, seconds paused, the longest pause. Counts from `start()` to
    `stop()`; the callbacks run on whichever thread triggered the collection, with the GIL held."""

    def __init__(self) -> None:
        self.collections = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.longest = [0.0, 0.0, 0.0]
        self._began = 0.0

    def start(self) -> None:
        gc.callbacks.append(self._callback)

    def stop(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        g = min(info["generation"], 2)
        pause = time.perf_counter() - self._began
        self.collections[g] += 1
        self.seconds[g] += pause
        self.longest[g] = max(self.longest[g], pause)

    def snapshot(self) -> dict[str, Any]:
        """Flat numbers (for /metrics too): all generations, then full collections alone (the long ones), and
        the objects frozen out of the scans."""
        return {"collections": sum(self.collections), "pause_seconds": round(sum(self.seconds), 6),
                "longest_pause_seconds": round(max(self.longest), 6), "full_collections": self.collections[2],
                "full_pause_seconds": round(self.seconds[2], 6), "frozen_objects": gc.get_freeze_count()}
