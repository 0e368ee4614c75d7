"""Eviction policies of the expert cache: plain Python, no torch.

A policy sees which cached keys were used and picks a victim when the cache is full. Keys are opaque hashables
(the cache uses (layer, expert)). `victim(protected)` never returns a protected key: experts the current step
still needs must survive the admissions of that same step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable
from typing import Protocol


class CachePolicy(Protocol):
    def admit(self, key: Hashable) -> None: ...
    def touch(self, key: Hashable) -> None: ...
    def remove(self, key: Hashable) -> None: ...
    def victim(self, protected: Iterable[Hashable] = ()) -> Hashable | None: ...


class LRUPolicy:
    """Evicts the least recently used key."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

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
    """Evicts the key with the lowest aged use count, least recent first among equals.

    MoE routing is skewed: a few experts per layer take most tokens. LRU lets a burst of one-off experts flush
    the popular ones; counting uses keeps them. Counts halve every `half_life` uses so popularity can shift
    (a new topic, a new agent turn) without old counts pinning the cache forever.
    """

    name = "freq"

    def __init__(self, half_life: int = 4096) -> None:
        self.half_life = half_life
        self._count: dict[Hashable, float] = {}
        self._last: dict[Hashable, int] = {}
        self._clock = 0
        self._history: dict[Hashable, float] = {}  # counts survive eviction so a returning expert is known

    def _tick(self) -> None:
        self._clock += 1
        if self._clock % self.half_life == 0:
            for table in (self._count, self._history):
                for k in table:
                    table[k] /= 2

    def admit(self, key: Hashable) -> None:
        self._tick()
        self._count[key] = self._history.pop(key, 0.0) + 1.0
        self._last[key] = self._clock

    def touch(self, key: Hashable) -> None:
        self._tick()
        self._count[key] += 1.0
        self._last[key] = self._clock

    def remove(self, key: Hashable) -> None:
        if key in self._count:
            self._history[key] = self._count.pop(key)
            del self._last[key]

    def victim(self, protected: Iterable[Hashable] = ()) -> Hashable | None:
        keep = set(protected)
        candidates = [k for k in self._count if k not in keep]
        if not candidates:
            return None
        return min(candidates, key=lambda k: (self._count[k], self._last[k]))


POLICIES = {"lru": LRUPolicy, "freq": FrequencyPolicy}


def make_policy(name: str) -> CachePolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown expert-cache policy {name!r}; known: {', '.join(POLICIES)}")
    return POLICIES[name]()
