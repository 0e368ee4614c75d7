"""The staging ring's bookkeeping, no torch: which slot a copy takes next, and what it must wait for before
overwriting it (the point of the compute stream where the slot's last reader was queued).

A slot's copy waits for the `release` that freed it. Slots freed by one `release` share one event (one point of
the compute stream), so a batch of copies waits once per release that freed its slots, not once per slot: a short
prefill chunk streams ~100 experts a layer through the ring, each wait a runtime call. The events are the
caller's (`ExpertCopier`: CUDA events, or stand-ins in tests).
"""

from __future__ import annotations


class StagingRing:
    def __init__(self, slots: int):
        self._released: list[object | None] = [None] * slots  # the event of each slot's last release, if any
        self._release_of = [0] * slots  # which release freed each slot
        self._releases = 0
        self._next = 0

    def __len__(self) -> int:
        return len(self._released)

    def reserve(self, n: int, busy: frozenset[int] | set[int] = frozenset()) -> tuple[list[int], list[object]]:
        """The next `n` ring indices not in `busy` (slots holding experts streamed ahead and not yet read), in ring
        order, and the events the copies into them must wait for: one per release that freed any of them."""
        ring = len(self._released)
        if len(busy) + n > ring:
            raise RuntimeError("every staging slot is busy")
        rings, waits, i = [], {}, self._next
        for _ in range(n):
            while i in busy:
                i = (i + 1) % ring
            rings.append(i)
            if self._released[i] is not None:
                waits.setdefault(self._release_of[i], self._released[i])
            i = (i + 1) % ring
        self._next = i
        return rings, list(waits.values())

    def released(self, slots: tuple[int, ...] | list[int], event: object) -> None:
        """`event` marks the compute stream past the last reader of `slots`."""
        self._releases += 1
        for i in slots:
            self._release_of[i] = self._releases
            self._released[i] = event
