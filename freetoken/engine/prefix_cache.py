"""Cross-request prefix reuse: full KV pages of finished sequences, indexed by the tokens they hold.

Agents resend a growing history every turn. When a sequence ends, each of its full pages is registered under a
key chained from the page before it (the hash of the parent key and the page's token ids), so a key names a
page's tokens *and* everything before them: equal keys mean equal K/V. A new prompt walks the chain page by
page and takes the longest run of registered pages as its own (shared, never written: a sequence only writes
after its last full shared page). The index holds one reference to each page it registers (the allocator's
refcounts), so pages outlive their sequences until they are evicted when the pool needs room or the index its
budget: the least recently used page among those no other cached page continues (a leaf). Evicting a page in the
middle of a chain would leave every page after it unreachable yet still held; a leaf costs only its own tokens
to recompute. Plain Python, no torch: the KV cache owns the tensors.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence


class PrefixCache:
    def __init__(self, page_size: int, retain: Callable[[list[int]], None], release: Callable[[list[int]], None],
                 max_pages: int | None = None):
        """`retain`/`release` take and drop one reference to pages (the KV cache's allocator). `max_pages`:
        most pages the index keeps (None: bounded only by `evict` calls from the pool)."""
        self.page_size, self.max_pages = page_size, max_pages
        self._retain, self._release = retain, release
        # chained key → (page, parent key, the page's tokens), least recently used first; the parent and tokens
        # are compared on a match, so a hash collision costs a miss, never wrong K/V
        self._pages: OrderedDict[int, tuple[int, int, tuple[int, ...]]] = OrderedDict()
        self._children: dict[int, int] = {}  # key → cached pages continuing it
        self.lookups = self.hit_tokens = self.inserted = self.evicted = 0

    def __len__(self) -> int:
        return len(self._pages)

    def _keys(self, tokens: Sequence[int], pages: int):
        """(key, parent key, page tokens) of the first `pages` full pages of `tokens`."""
        key, size = 0, self.page_size
        for i in range(pages):
            parent, chunk = key, tuple(tokens[i * size:(i + 1) * size])
            key = hash((parent, chunk))
            yield key, parent, chunk

    def match(self, tokens: Sequence[int]) -> list[int]:
        """The registered pages holding the longest prefix of `tokens` in whole pages, leaving at least one
        token to compute (its logits pick the next token). The caller takes its own references."""
        self.lookups += 1
        found = []
        for key, parent, chunk in self._keys(tokens, (len(tokens) - 1) // self.page_size):
            entry = self._pages.get(key)
            if entry is None or entry[1] != parent or entry[2] != chunk:
                break
            self._pages.move_to_end(key)
            found.append(entry[0])
        self.hit_tokens += len(found) * self.page_size
        return found

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> None:
        """Registers the full pages of a sequence whose KV holds `tokens` in `pages` (in order)."""
        full = min(len(tokens) // self.page_size, len(pages))
        for (key, parent, chunk), page in zip(self._keys(tokens, full), pages, strict=False):
            if key in self._pages:
                self._pages.move_to_end(key)
                continue
            self._retain([page])
            self._pages[key] = (page, parent, chunk)
            if parent:
                self._children[parent] = self._children.get(parent, 0) + 1
            self.inserted += 1
        if self.max_pages is not None and len(self._pages) > self.max_pages:
            self.evict(len(self._pages) - self.max_pages)

    def evict(self, n: int) -> int:
        """Drops the index's reference to the `n` least recently used pages (fewer if it holds fewer); a page
        no sequence shares goes back to the pool. Returns how many were dropped."""
        dropped = []
        while self._pages and len(dropped) < n:
            key = next(k for k in self._pages if not self._children.get(k))  # a chain always ends in a leaf
            page, parent, _ = self._pages.pop(key)
            if parent in self._children:
                self._children[parent] -= 1
                if not self._children[parent]:
                    del self._children[parent]
            dropped.append(page)
        self._release(dropped)
        self.evicted += len(dropped)
        return len(dropped)

    def renumber(self, moves: dict[int, int]) -> None:
        """Pages moved to new ids (a resized pool)."""
        for key, (page, parent, chunk) in self._pages.items():
            if page in moves:
                self._pages[key] = (moves[page], parent, chunk)

    def clear(self) -> None:
        self.evict(len(self._pages))
