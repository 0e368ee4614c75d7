"""Cross-request reuse for models with recurrent layers (linear attention, SSMs): whole-sequence snapshots.

Their state sums up every token, so shared KV pages alone cannot start a sequence (the prefix cache is off for
them) and a sequence cannot be cut back to a shorter prefix. Instead the scheduler keeps a few sequences as they
stood at points an agent's next request is likely to continue from: the end of each prompt (the next turn
resends it, then the reply as the template renders it, then new messages) and the end of each finished request
(prompt and reply as generated). A snapshot is a fork (`PagedKVCache.fork`: pages shared, recurrent state
copied), so taking one copies only the state. A new prompt starts from the longest snapshot whose tokens begin
it (leaving at least one token to compute), as a fork of it. The least recently used snapshot goes first when
the store is full or the KV pool needs pages.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from freetoken.engine.kv_cache import PagedKVCache, SequenceKV


class StateSnapshots:
    def __init__(self, cache: PagedKVCache, max_snapshots: int = 8):
        self.cache, self.max_snapshots = cache, max_snapshots
        self._held: OrderedDict[tuple[int, ...], SequenceKV] = OrderedDict()  # tokens → the sequence after them
        self.lookups = self.hits = self.hit_tokens = self.taken = self.evicted = 0

    def __len__(self) -> int:
        return len(self._held)

    def keep(self, tokens: Sequence[int], seq: SequenceKV) -> None:
        """Holds `seq` (which the store now owns) as the state after `tokens`; one already held for the same
        tokens is kept instead."""
        key = tuple(tokens[:seq.length])
        if len(key) != seq.length or not key:
            self.cache.release(seq)
            return
        if key in self._held:
            self._held.move_to_end(key)
            self.cache.release(seq)
            return
        self._held[key] = seq
        self.taken += 1
        while len(self._held) > self.max_snapshots:
            self._drop_oldest()

    def snapshot(self, tokens: Sequence[int], seq: SequenceKV) -> None:
        """Keeps a fork of a live `seq` that holds `tokens` (the live one goes on)."""
        if tuple(tokens[:seq.length]) not in self._held:
            self.keep(tokens, self.cache.fork(seq))

    def start(self, prompt: Sequence[int]) -> SequenceKV | None:
        """A fork of the longest snapshot that `prompt` continues (by at least one token), or None."""
        self.lookups += 1
        best = None
        for key in self._held:
            if len(key) < len(prompt) and (best is None or len(key) > len(best)) and \
                    tuple(prompt[:len(key)]) == key:
                best = key
        if best is None:
            return None
        self._held.move_to_end(best)
        self.hits += 1
        self.hit_tokens += len(best)
        return self.cache.fork(self._held[best])

    def evict(self, wanted: int) -> int:
        """Drops snapshots, oldest first, until they held references to at least `wanted` pages (the pool's
        `reclaim` hook). Returns the references dropped (0: nothing left)."""
        dropped = 0
        while self._held and dropped < wanted:
            dropped += self._drop_oldest()
        return dropped

    def clear(self) -> None:
        while self._held:
            self._drop_oldest()

    def _drop_oldest(self) -> int:
        _, seq = self._held.popitem(last=False)
        pages = len(seq.pages)
        self.cache.release(seq)
        self.evicted += 1
        return pages
