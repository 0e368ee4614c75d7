"""Which (layer, expert) sits in which GPU cache slot: the bookkeeping half of the expert cache, no torch.

Invariants: a key holds at most one slot and a slot at most one key; free slots + occupied slots = capacity;
within one step (`begin_step` … the step's admissions) keys the step needs are never evicted. The tensors the
slots index live in the executor.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

from freetoken.engine.offload.policy import CachePolicy


@dataclass(slots=True)
class CacheCounters:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_copied: int = 0  # over the link
    store_hits: int = 0  # experts made present from the block store's rows instead of over the link
    cpu_experts: int = 0  # misses computed on the host instead of copied
    rejected: int = 0  # misses the policy streamed rather than admit (admission control)
    copy_seconds: float = 0.0  # time the copy stream spent on copies (completed ones)
    cpu_seconds: float = 0.0  # time the CPU expert kernel ran (wall, all its threads)
    prefetched: int = 0  # experts copied ahead of their layer on a prediction
    prefetch_used: int = 0  # of those, the ones their layer then routed to
    cpu_warmed: int = 0  # experts read into the CPU's caches ahead of their layer on a prediction (GPU path cpu-warm)
    cpu_warm_used: int = 0  # of those, the ones their layer then computed on the CPU
    # hits on experts a prefetch admitted to the cache for that very step: their bytes crossed the link for it,
    # so a floor counts them with the misses (without cache slots a used prefetch is a miss already)
    prefetch_hits: int = 0
    # where a decode layer-step's host thread spends its time (small batches; the step's critical path)
    layer_steps: int = 0
    gpu_wait_seconds: float = 0.0  # blocked until the layer's routing reached the host
    cpu_wait_seconds: float = 0.0  # blocked on the CPU share after queueing everything else
    host_seconds: float = 0.0  # the rest: planning, queueing copies and graphs, starting the CPU, prefetch
    cpu_starts: int = 0  # layer-steps that started a CPU share
    cpu_start_delay_seconds: float = 0.0  # from the routing on the host to the CPU share started, summed
    # the CPU kernel within those layer-steps alone (cpu_experts/cpu_seconds include prefill chunks): its rate
    # while decoding, to tell a slower kernel from a later start or a slower host
    step_cpu_experts: int = 0
    step_cpu_seconds: float = 0.0  # posting the job to its last task's end

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class ExpertCache:
    def __init__(self, capacity: int, policy: CachePolicy):
        self.capacity, self.policy = capacity, policy
        self.slot_of: dict[Hashable, int] = {}
        self.free_slots: list[int] = list(range(capacity - 1, -1, -1))
        self.counters = CacheCounters()
        self._protected: set[Hashable] = set()
        # for the dashboard: hits and misses per layer (keys are (layer, expert)), and each key's last use, in steps
        self.layer_counts: dict[Hashable, list[int]] = {}
        self.last_used: dict[Hashable, int] = {}
        self.steps = 0
        self.pinned: set[Hashable] = set()  # keys never evicted (a user pinned their layer); all of them cached
        self.per_layer: Counter = Counter()  # keys cached per layer (a key's layer: its first item)

    def begin_step(self, needed: Iterable[Hashable]) -> None:
        """Marks the keys the coming computation needs; none of them can be evicted until the next step."""
        self._protected = set(needed)
        self.steps += 1

    def lookup(self, key: Hashable) -> int | None:
        """The key's slot on a hit (counted, and the policy told), None on a miss (counted)."""
        self.record_uses(_layer_of(key), (key,))
        return self.slot_of.get(key)

    def record_uses(self, layer, keys: Iterable[Hashable]) -> None:
        """What `lookup` counts and tells the policy, for keys of one layer (in lookup order) that the caller has
        looked up in `slot_of` itself. Decode does this after starting its CPU share, off the step's critical
        path; it must come before the step's admissions (the policy learns of a miss before admitting the key),
        so each key's hit or miss is still what `slot_of` says now."""
        step, last_used, policy, slot_of = self.steps, self.last_used, self.policy, self.slot_of
        counts = self.layer_counts.get(layer)
        if counts is None:
            counts = self.layer_counts[layer] = [0, 0]
        hits = misses = 0
        for key in keys:
            last_used[key] = step
            if key in slot_of:
                policy.touch(key)
                hits += 1
            else:
                policy.miss(key)
                misses += 1
        counts[0] += hits
        counts[1] += misses
        self.counters.hits += hits
        self.counters.misses += misses

    def pin(self, keys: Iterable[Hashable]) -> list[tuple[int, Hashable]]:
        """Caches `keys` for good (each admitted now if it is not, displacing unpinned keys); returns the
        (slot, key) pairs newly admitted, whose tensors the caller must fill. Refused when they cannot all fit."""
        keys = list(keys)
        if len(self.pinned | set(keys)) > self.capacity:
            raise ValueError(f"pinning them would pin {len(self.pinned | set(keys))} experts in a cache of "
                             f"{self.capacity} slots; grow the cache or unpin another layer first")
        self.pinned.update(keys)
        admitted = []
        for key in keys:
            if key not in self.slot_of:
                slot, _ = self.admit(key, force=True)
                admitted.append((slot, key))
        return admitted

    def unpin(self, keys: Iterable[Hashable]) -> None:
        self.pinned.difference_update(keys)

    def fillable(self, layer, layers: int | None = None) -> int:
        """Free slots a chunk that evicts nothing may still fill with keys of `layer`: every free one, or (with
        `layers`, the layers sharing the cache) only up to an even share of the capacity per layer, so that a
        prefill filling the cache in layer order leaves no layer all cached and the next all missing."""
        if layers is None:
            return len(self.free_slots)
        return max(0, min(len(self.free_slots), -(-self.capacity // layers) - self.per_layer[layer]))

    def admit(self, key: Hashable, force: bool = False, hold: bool = False) -> tuple[int, Hashable | None] | None:
        """A slot for a missed key: a free one, or one taken from the policy's victim. Returns (slot, evicted
        key or None), or None when every slot holds a protected key or the policy declines to displace its
        victim for this key (the caller then computes the key another way, without caching it). `hold`: the
        key is protected until the next step, like the step's own keys: a prefetch admits several in a row, and
        a fresh key is the frequency policy's coldest, so each would evict the one admitted before it."""
        evicted = None
        if not self.free_slots:
            evicted = self.policy.victim(self._protected | self.pinned if self.pinned else self._protected)
            if evicted is None:
                return None
            if not force and not self.policy.accepts(key, evicted):
                self.counters.rejected += 1
                return None
            self._drop(evicted)
            self.counters.evictions += 1
        slot = self.free_slots.pop()
        self.slot_of[key] = slot
        self.per_layer[_layer_of(key)] += 1
        self.policy.admit(key)
        if hold:
            self._protected.add(key)
        return slot, evicted

    def _drop(self, key: Hashable) -> None:
        self.free_slots.append(self.slot_of.pop(key))
        self.per_layer[_layer_of(key)] -= 1
        self.policy.remove(key)

    def resize(self, capacity: int) -> list[Hashable]:
        """Grows (keeping everything) or shrinks (evicting the coldest, then compacting into the first
        `capacity` slots). Returns the moves the caller must apply to its tensors, as (key, old, new) tuples."""
        if capacity < len(self.pinned):
            raise ValueError(f"the cache holds {len(self.pinned)} pinned experts; unpin a layer before shrinking "
                             f"it to {capacity} slots")
        moves = []
        while len(self.slot_of) > capacity:
            self._drop(self.policy.victim(self.pinned))
            self.counters.evictions += 1
        if capacity < self.capacity:
            spare = sorted(s for s in range(capacity) if s not in set(self.slot_of.values()))
            for key, slot in sorted(self.slot_of.items(), key=lambda kv: kv[1]):
                if slot >= capacity:
                    new = spare.pop(0)
                    self.slot_of[key] = new
                    moves.append((key, slot, new))
        self.capacity = capacity
        used = set(self.slot_of.values())
        self.free_slots = [s for s in range(capacity - 1, -1, -1) if s not in used]
        return moves


def _layer_of(key: Hashable):
    return key[0] if type(key) is tuple else None
