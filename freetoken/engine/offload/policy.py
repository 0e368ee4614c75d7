"""Eviction policies of the expert cache: plain Python, no torch.

A policy sees which cached keys were used and picks a victim when the cache is full. Keys are opaque hashables
(the cache uses (layer, expert)). `victim(protected)` never returns a protected key: experts the current step
still needs must survive the admissions of that same step.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Hashable, Iterable
from typing import Protocol


class CachePolicy(Protocol):
    def miss(self, key: Hashable) -> None: ...  # a lookup of an uncached key
    def admit(self, key: Hashable) -> None: ...
    def touch(self, key: Hashable) -> None: ...  # a hit
    def remove(self, key: Hashable) -> None: ...
    def victim(self, protected: Iterable[Hashable] = ()) -> Hashable | None: ...
    def accepts(self, candidate: Hashable, victim: Hashable) -> bool: ...  # admission control


class LRUPolicy:
    """Evicts the least recently used key."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def miss(self, key: Hashable) -> None:
        pass

    def accepts(self, candidate: Hashable, victim: Hashable) -> bool:
        return True

    def admit(self, key: Hashable) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: Hashable) -> None:
        self._order.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def victim(self, protected: Iterable[Hashable] = ()) -> Hashable | None:
        keep = set(protected)
        return next((k for k in self._order if k not in keep), None)


class FrequencyPolicy:
    """Evicts the key with the lowest aged use count; O(log n) per operation.

    MoE routing is skewed: a few experts per layer take most tokens. LRU lets a burst of one-off experts flush
    the popular ones; counting uses keeps them. Counts age with a half-life of `half_life` uses so popularity can
    shift (a new topic, a new agent turn). Ageing is done by inflation rather than by halving every count: use
    number c adds 2^(c / half_life), which ranks keys exactly as halving all counts would, leaves older heap
    entries comparable, and so lets a lazy min-heap find the victim without a scan.
    """

    name = "freq"
    _RESCALE_EVERY = 64  # half-lives between rescalings that keep the scores finite

    def __init__(self, half_life: int = 4096, admission: bool = False) -> None:
        self.half_life, self.admission = half_life, admission
        self._score: dict[Hashable, float] = {}
        self._history: dict[Hashable, float] = {}  # scores survive eviction so a returning expert is known
        self._heap: list[tuple[float, int, Hashable]] = []  # (score, push order, key); stale entries skipped
        self._clock = 0
        self._pushes = 0

    def _tick(self) -> None:
        self._clock += 1
        if self._clock >= self._RESCALE_EVERY * self.half_life:
            self._rescale()

    def _bump(self, key: Hashable, base: float) -> None:
        """Records one use; `base` is the key's score read after `_tick` (so already in the current scale)."""
        score = base + 2.0 ** (self._clock / self.half_life)
        self._score[key] = score
        self._push(score, key)
        if len(self._heap) > 4 * len(self._score) + 64:
            self._rebuild()

    def _push(self, score: float, key: Hashable) -> None:
        self._pushes += 1
        heapq.heappush(self._heap, (score, self._pushes, key))

    def _rescale(self) -> None:
        factor = 2.0 ** -self._RESCALE_EVERY
        self._clock -= self._RESCALE_EVERY * self.half_life
        for table in (self._score, self._history):
            for k in table:
                table[k] *= factor
        self._rebuild()

    def _rebuild(self) -> None:
        self._heap = []
        for key, score in self._score.items():
            self._push(score, key)

    def miss(self, key: Hashable) -> None:
        """Counts a use of an uncached key, so popularity is known before the key is ever admitted."""
        self._tick()
        self._history[key] = self._history.get(key, 0.0) + 2.0 ** (self._clock / self.half_life)

    def accepts(self, candidate: Hashable, victim: Hashable) -> bool:
        """With admission control, a key displaces the victim only once it has been used at least as much
        (aged): a one-off expert is streamed through instead of flushing a popular one (TinyLFU's idea)."""
        return not self.admission or self._history.get(candidate, 0.0) >= self._score[victim]

    def admit(self, key: Hashable) -> None:
        if key in self._history:  # the use was counted by `miss`
            score = self._history.pop(key)
            self._score[key] = score
            self._push(score, key)
        else:
            self._tick()
            self._bump(key, 0.0)

    def touch(self, key: Hashable) -> None:
        self._tick()
        self._bump(key, self._score[key])

    def remove(self, key: Hashable) -> None:
        if key in self._score:
            self._history[key] = self._score.pop(key)

    def victim(self, protected: Iterable[Hashable] = ()) -> Hashable | None:
        keep = protected if isinstance(protected, (set, frozenset)) else set(protected)
        skipped, found = [], None
        while self._heap:
            score, _, key = self._heap[0]
            if self._score.get(key) != score:  # stale: the key was used again or evicted since this push
                heapq.heappop(self._heap)
            elif key in keep:
                skipped.append(heapq.heappop(self._heap))
            else:
                found = key
                break
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        return found


class AdmittingFrequencyPolicy(FrequencyPolicy):
    """`FrequencyPolicy` with admission control."""

    name = "freq-admit"

    def __init__(self, half_life: int = 4096) -> None:
        super().__init__(half_life, admission=True)


POLICIES = {"lru": LRUPolicy, "freq": FrequencyPolicy, "freq-admit": AdmittingFrequencyPolicy}


def make_policy(name: str) -> CachePolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown expert-cache policy {name!r}; known: {', '.join(POLICIES)}")
    return POLICIES[name]()
