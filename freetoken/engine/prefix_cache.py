"""Cross-request prefix reuse: full KV pages of finished sequences, indexed by the tokens they hold.

Agents resend a growing history every turn. When a sequence ends, each of its full pages is registered under a
key chained from the page before it (the hash of the parent key and the page's token ids), so a key names a
page's tokens *and* everything before them: equal keys mean equal K/V. A new prompt walks the chain page by
page and takes the longest run of registered pages as its own (shared, never written: a sequence only writes
after its last full shared page). The index holds one reference to each page it registers (the allocator's
refcounts), so pages outlive their sequences until they are evicted when the pool needs room or the index its
budget. Only leaves go (pages no other cached page continues): evicting a page in the middle of a chain would
leave every page after it unreachable yet still held. Among leaves, eviction weighs what a page would cost to
recompute against how long ago it was used (GreedyDual: every page costs the same bytes, a page further into its
sequence costs more attention to recompute): a used page's credit is the current inflation level plus its
cost, the leaf with the least credit goes, and the level rises to that credit, so pages not used for a while
lose to fresh ones whatever their cost. Plain Python, no torch: the KV cache owns the tensors.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Sequence

ATTENTION_TOKENS = 4096  # position where a token's attention costs about as much as the rest of its layer


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
        self._credit: dict[int, float] = {}  # key → inflation level at its last use + its recompute cost
        # eviction candidates, least credit first: (credit, push order, key), pushed at each use and when a page
        # becomes a leaf; an entry whose key is gone, has children or was used again since is skipped. A scan
        # of every page per eviction made making room for a long prompt quadratic in the index's size.
        self._leaves: list[tuple[float, int, int]] = []
        self._pushes = 0
        self._level = 0.0
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

    def _use(self, key: int, page_index: int) -> None:
        """Page `page_index` of its sequence was used: its credit is renewed (cost in units of one page's
        position-independent work)."""
        credit = self._credit[key] = self._level + 1.0 + (page_index + 0.5) * self.page_size / ATTENTION_TOKENS
        self._candidate(credit, key)

    def _candidate(self, credit: float, key: int) -> None:
        self._pushes += 1
        heapq.heappush(self._leaves, (credit, self._pushes, key))
        if len(self._leaves) > 4 * len(self._credit) + 64:  # mostly stale: keep the live entries only
            live = {k: c for k, c in self._credit.items() if not self._children.get(k)}
            self._leaves = [e for e in self._leaves if live.get(e[2]) == e[0]]
            heapq.heapify(self._leaves)

    def match(self, tokens: Sequence[int]) -> list[int]:
        """The registered pages holding the longest prefix of `tokens` in whole pages, leaving at least one
        token to compute (its logits pick the next token). The caller takes its own references."""
        self.lookups += 1
        found = []
        for i, (key, parent, chunk) in enumerate(self._keys(tokens, (len(tokens) - 1) // self.page_size)):
            entry = self._pages.get(key)
            if entry is None or entry[1] != parent or entry[2] != chunk:
                break
            self._pages.move_to_end(key)
            self._use(key, i)
            found.append(entry[0])
        self.hit_tokens += len(found) * self.page_size
        return found

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> None:
        """Registers the full pages of a sequence whose KV holds `tokens` in `pages` (in order)."""
        full = min(len(tokens) // self.page_size, len(pages))
        for i, ((key, parent, chunk), page) in enumerate(zip(self._keys(tokens, full), pages, strict=False)):
            self._use(key, i)
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
        """Drops the index's reference to `n` pages (fewer if it holds fewer), leaves with the least credit
        first; a page no sequence shares goes back to the pool. Returns how many were dropped."""
        dropped = []
        while self._leaves and len(dropped) < n:
            credit, _, key = heapq.heappop(self._leaves)
            if self._credit.get(key) != credit or self._children.get(key):
                continue  # used again since (a newer entry stands), evicted, or no longer a leaf
            page, parent, _ = self._pages.pop(key)
            self._level = self._credit.pop(key)
            if parent in self._children:
                self._children[parent] -= 1
                if not self._children[parent]:
                    del self._children[parent]
                    self._candidate(self._credit[parent], parent)  # a leaf now
            dropped.append(page)
        self._release(dropped)
        self.evicted += len(dropped)
        return len(dropped)

    def tree(self, max_nodes: int = 24) -> list[dict]:
        """The cached prefixes as a tree for the dashboard: chains of pages with one continuation each are one
        node (`tokens`), a page several cached sequences continue is a fork (`children`). At most `max_nodes`
        nodes; a node whose children were left out says how many (`more`)."""
        children: dict[int, list[int]] = {}
        # a copy taken in one C call: /v1/stats reads this from a handler thread while the engine inserts and evicts
        for key, (_, parent, _) in tuple(self._pages.items()):
            children.setdefault(parent, []).append(key)
        budget = [max_nodes]

        def node(key: int) -> dict:
            pages = 1
            while len(children.get(key, ())) == 1:  # a straight run: one node
                key, pages = children[key][0], pages + 1
            return {"tokens": pages * self.page_size, "children": branch(children.get(key, []))}

        def branch(keys: list[int]) -> list[dict]:
            out = []
            for i, key in enumerate(keys):
                if budget[0] <= 0:
                    out.append({"more": len(keys) - i})
                    break
                budget[0] -= 1
                out.append(node(key))
            return out

        return branch(children.get(0, []))

    def renumber(self, moves: dict[int, int]) -> None:
        """Pages moved to new ids (a resized pool)."""
        for key, (page, parent, chunk) in self._pages.items():
            if page in moves:
                self._pages[key] = (moves[page], parent, chunk)

    def clear(self) -> None:
        self.evict(len(self._pages))
