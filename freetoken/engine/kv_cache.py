"""Paged KV cache: fixed-size pages in one pool per layer, a page table per sequence.

Bookkeeping (`PageAllocator`, `SequenceKV.pages`) is plain Python; the tensors live in `PagedKVCache`. A page
holds `page_size` consecutive token slots; a token's slot is `page * page_size + offset`, so K/V pools are
addressed flat as [num_pages * page_size, n_kv_heads, head_dim]. Pools grow by doubling when the allocator runs
dry, so a short chat never pays for the model's full context up front.

Pages are reference-counted: a fork shares every page of its parent, a cached prefix is shared by the prompts
that start with it. A sequence about to write into a page someone else also holds gets its own copy first
(copy on write, in `reserve`), so sharing is invisible to the model code.

Layers with recurrent state (linear attention, SSMs) keep it per sequence in `SequenceKV.recurrent`: it sums up
every token so far and cannot be rolled back, so `truncate` refuses a sequence that has any; a fork copies it,
which makes a fork the way to snapshot a sequence at a point it may have to return to (see sdk/local.py).

Shapes: L cached tokens, T new tokens, Hkv KV heads, D head dim.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch


class RecurrentStateError(ValueError):
    """A sequence whose layers keep recurrent state was asked to forget tokens."""


class PageAllocator:
    """Free-list of page ids with reference counts. Invariant: every page id is either free or referenced by its
    holders (sequences, the prefix cache) exactly `refs[page]` times; it is free again when the last lets go."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))
        self.refs: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def grow(self, new_total: int) -> None:
        self._free[:0] = list(range(new_total - 1, self.num_pages - 1, -1))
        self.num_pages = new_total

    def shrink(self, new_total: int, moves: dict[int, int]) -> None:
        """Drops page ids ≥ `new_total`; `moves` (old → new id) relocates the held ones among them into free
        ids below it (the caller has copied their contents)."""
        for old, new in moves.items():
            self.refs[new] = self.refs.pop(old)
        if any(p >= new_total for p in self.refs):
            raise ValueError("a held page is past the new size and was not moved")
        self.num_pages = new_total
        self._free = [p for p in range(new_total - 1, -1, -1) if p not in self.refs]

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"KV cache needs {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self.refs[p] = 1
        return pages

    def retain(self, pages: list[int]) -> None:
        """One more holder of each page (a page shared by another sequence, or kept by the prefix cache)."""
        for p in pages:
            if p not in self.refs:
                raise ValueError(f"page {p} is free; only a held page can be shared")
            self.refs[p] += 1

    def free(self, pages: list[int]) -> None:
        """One holder fewer for each page; pages nobody holds go back to the free list."""
        released = []
        for p in pages:
            left = self.refs[p] - 1
            if left:
                self.refs[p] = left
            else:
                del self.refs[p]
                released.append(p)
        self._free.extend(reversed(released))


@dataclass(slots=True)
class SequenceKV:
    """One sequence's view of the cache: its pages and how many tokens are committed."""

    pages: list[int] = field(default_factory=list)
    length: int = 0
    slots: torch.Tensor | None = None  # flat slot ids of tokens [0, capacity), on the cache's device
    recurrent: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)  # layer → its state tensors

    def capacity(self, page_size: int) -> int:
        return len(self.pages) * page_size


class PagedKVCache:
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, *, page_size: int = 16,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 initial_pages: int = 64, max_pages: int | None = None, kv_layers: Sequence[int] | None = None,
                 values_are_keys: bool = False):
        """`kv_layers`: the layers that attend over K/V (default all); the others (linear attention) get an
        empty pool that never grows, so a hybrid model's cache holds only its attention layers' rows.
        `values_are_keys`: the model attends with V = K (DeepSeek's latent attention: the cached latent is both),
        so one pool per layer holds both and `update` writes it once: half the bytes."""
        self.n_layers, self.n_kv_heads, self.head_dim = n_layers, n_kv_heads, head_dim
        self.kv_layers = tuple(range(n_layers)) if kv_layers is None else tuple(sorted(kv_layers))
        self.page_size, self.dtype, self.device = page_size, dtype, torch.device(device)
        self.max_pages = max_pages
        self.allocator = PageAllocator(initial_pages)
        self.version = 0  # bumped when the pool tensors are reallocated (captured CUDA graphs read them)
        self._sequences: dict[int, SequenceKV] = {}  # live sequences by id(): a resize renumbers their pages
        self.remap_hooks: list[Callable[[dict[int, int]], None]] = []  # other page holders (the prefix cache)
        # frees held-but-idle pages (the prefix cache's) when the pool runs short: called with the number of
        # pages wanted, returns how many references it dropped (0: nothing left to give)
        self.reclaim: Callable[[int], int] | None = None
        shape = (initial_pages * page_size, n_kv_heads, head_dim)
        keeps = set(self.kv_layers)
        self.values_are_keys = values_are_keys
        self.k, self.v = ([torch.zeros(shape if i in keeps else (0, n_kv_heads, head_dim), dtype=dtype,
                                       device=self.device) for i in range(n_layers)] for _ in range(2))
        self._share_values()

    def _share_values(self) -> None:
        """With `values_are_keys`, every layer's V pool is its K pool (the same tensor)."""
        if self.values_are_keys:
            self.v = list(self.k)

    def _pools(self) -> tuple[list[torch.Tensor], ...]:
        """The pool lists to copy or grow: K alone when V is K."""
        return (self.k,) if self.values_are_keys else (self.k, self.v)

    def new_sequence(self) -> SequenceKV:
        seq = SequenceKV(slots=torch.empty(0, dtype=torch.long, device=self.device))
        self._sequences[id(seq)] = seq
        return seq

    def adopt(self, seq: SequenceKV, pages: list[int]) -> None:
        """Starts an empty `seq` on shared full pages (a cached prefix): it holds them too and its own tokens
        go to pages after them, so the shared ones are never written."""
        if seq.pages:
            raise ValueError("only an empty sequence can adopt a prefix")
        self.allocator.retain(pages)
        seq.pages = list(pages)
        seq.length = len(pages) * self.page_size
        offsets = torch.arange(self.page_size, device=self.device)
        seq.slots = (torch.tensor(pages, dtype=torch.long, device=self.device)[:, None] * self.page_size
                     + offsets).flatten() if pages else torch.empty(0, dtype=torch.long, device=self.device)

    def fork(self, seq: SequenceKV) -> SequenceKV:
        """A second sequence holding the same tokens: it shares every page (no K/V is copied) until one of the
        two writes into a shared page, which then gets copied for the writer."""
        self.allocator.retain(seq.pages)
        state = {layer: tuple(t.clone() for t in tensors) for layer, tensors in seq.recurrent.items()}
        child = SequenceKV(list(seq.pages), seq.length, seq.slots.clone(), state)
        self._sequences[id(child)] = child
        return child

    def free_pages(self, wanted: int) -> int:
        """Free pages, after asking `reclaim` for up to `wanted` of them."""
        allocator = self.allocator
        while self.reclaim is not None and allocator.num_free < wanted:
            if not self.reclaim(wanted - allocator.num_free):
                break
        return allocator.num_free

    def release(self, seq: SequenceKV) -> None:
        self.allocator.free(seq.pages)
        seq.pages, seq.length, seq.recurrent = [], 0, {}
        self._sequences.pop(id(seq), None)
        seq.slots = torch.empty(0, dtype=torch.long, device=self.device)

    def reserve(self, seq: SequenceKV, n_new: int) -> None:
        """Makes room for `n_new` more tokens of `seq` (called once per forward, before any layer writes)."""
        self._own_pages(seq, n_new)
        need = -(-(seq.length + n_new) // self.page_size) - len(seq.pages)
        if need <= 0:
            return
        if need > self.free_pages(need):
            self._grow(self.allocator.num_pages - self.allocator.num_free + need)
        new_pages = self.allocator.allocate(need)
        seq.pages.extend(new_pages)
        offsets = torch.arange(self.page_size, device=self.device)
        new_slots = (torch.tensor(new_pages, device=self.device)[:, None] * self.page_size + offsets).flatten()
        seq.slots = torch.cat([seq.slots, new_slots])

    def _own_pages(self, seq: SequenceKV, n_new: int) -> None:
        """Copy on write: the pages the next `n_new` tokens land in (among those `seq` has) become its own."""
        if n_new <= 0:
            return
        first, last = seq.length // self.page_size, (seq.length + n_new - 1) // self.page_size
        for i in range(first, min(last + 1, len(seq.pages))):
            old = seq.pages[i]
            if self.allocator.refs[old] == 1:
                continue
            if self.free_pages(1) < 1:
                self._grow(self.allocator.num_pages + 1)
            new = self.allocator.allocate(1)[0]
            size = self.page_size
            for layer in self.kv_layers:
                for pools in self._pools():
                    pool = pools[layer]
                    pool[new * size:(new + 1) * size] = pool[old * size:(old + 1) * size]
            seq.pages[i] = new
            seq.slots = seq.slots.clone()  # a fork's slots may be a view its parent also reads
            seq.slots[i * size:(i + 1) * size] = torch.arange(new * size, (new + 1) * size, device=self.device)
            self.allocator.free([old])

    def resize(self, max_pages: int) -> dict[str, int]:
        """Changes the pool's page budget while sequences live in it, keeping every token: the pool tensors are
        reallocated when they are allocated at full size (CUDA graphs need that) or would hold more than the
        new budget; held pages past a smaller size move into free ones below it (idle prefix-cache pages are
        given back first). Too many pages held by live sequences: ValueError, and nothing changes."""
        if max_pages < 1:
            raise ValueError("the KV cache needs at least one page")
        allocator = self.allocator
        if len(allocator.refs) > max_pages:
            self.free_pages(allocator.num_pages - max_pages)  # the prefix cache lets go of what it can
            if len(allocator.refs) > max_pages:
                raise ValueError(f"{len(allocator.refs)} pages are held by live requests; the KV cache cannot "
                                 f"shrink to {max_pages} pages now")
        full = self.max_pages is not None and allocator.num_pages == self.max_pages
        new_total = max_pages if full or allocator.num_pages > max_pages else allocator.num_pages
        moves: dict[int, int] = {}
        if new_total < allocator.num_pages:
            spare = iter(p for p in range(new_total) if p not in allocator.refs)
            moves = {old: next(spare) for old in sorted(allocator.refs) if old >= new_total}
        if new_total != allocator.num_pages:
            self._reallocate(new_total, moves)
        if new_total < allocator.num_pages:
            allocator.shrink(new_total, moves)
            if moves:
                self._renumber(moves)
        elif new_total > allocator.num_pages:
            allocator.grow(new_total)
        self.max_pages = max_pages
        return {"pages": max_pages, "tokens": max_pages * self.page_size, "allocated_pages": allocator.num_pages}

    def _reallocate(self, new_total: int, moves: dict[int, int]) -> None:
        """New pool tensors of `new_total` pages holding every kept page's rows (moved ones at their new ids)."""
        size, rows = self.page_size, min(new_total, self.allocator.num_pages) * self.page_size
        shape = (new_total * size, self.n_kv_heads, self.head_dim)
        for pools in self._pools():
            for i in self.kv_layers:
                pool = pools[i]
                new = torch.zeros(shape, dtype=self.dtype, device=self.device)
                new[:rows] = pool[:rows]
                for old, to in moves.items():
                    new[to * size:(to + 1) * size] = pool[old * size:(old + 1) * size]
                pools[i] = new
        self._share_values()
        self.version += 1

    def _renumber(self, moves: dict[int, int]) -> None:
        size = self.page_size
        offsets = torch.arange(size, device=self.device)
        for seq in self._sequences.values():
            if any(p in moves for p in seq.pages):
                seq.pages = [moves.get(p, p) for p in seq.pages]
                seq.slots = (torch.tensor(seq.pages, dtype=torch.long, device=self.device)[:, None] * size
                             + offsets).flatten()  # a sequence's slots cover its pages exactly
        for hook in self.remap_hooks:
            hook(moves)

    def _grow(self, pages_needed: int) -> None:
        new_total = max(pages_needed, 2 * self.allocator.num_pages)
        if self.max_pages is not None:
            if pages_needed > self.max_pages:
                raise MemoryError(f"KV cache needs {pages_needed} pages; its budget is {self.max_pages}")
            new_total = min(new_total, self.max_pages)
        extra = (new_total - self.allocator.num_pages) * self.page_size
        pad = (extra, self.n_kv_heads, self.head_dim)
        for pools in self._pools():
            for i in self.kv_layers:
                pools[i] = torch.cat([pools[i], torch.zeros(pad, dtype=self.dtype, device=self.device)])
        self._share_values()
        self.allocator.grow(new_total)

    def slot_runs(self, seq: SequenceKV, end: int) -> list[tuple[int, int]]:
        """The sequence's positions [0, end) as runs of consecutive slots, in position order: (first slot, count)
        per run. Call after `reserve`, once per forward: a reservation's copy on write can move a page."""
        runs: list[tuple[int, int]] = []
        for i, page in enumerate(seq.pages[:-(-end // self.page_size)]):
            first, count = page * self.page_size, min(self.page_size, end - i * self.page_size)
            if runs and sum(runs[-1]) == first:
                runs[-1] = (runs[-1][0], runs[-1][1] + count)
            else:
                runs.append((first, count))
        return runs

    def contiguous_base(self, seq: SequenceKV, end: int) -> int | None:
        """The slot of position 0 when the sequence's positions [0, end) sit in consecutive slots (its pages
        consecutive, as a sequence filling a fresh or unfragmented pool gets them), else None. `update` then
        returns views of the pools instead of gathering the keys (a decode step over a 5k-token context on the
        CI-class CPU spent 15-48 ms of ~100-150 in those gathers). Call after `reserve`, once per forward. (A list
        compare, not `slot_runs`: every forward asks this first, and a long sequence has thousands of pages.)"""
        pages = seq.pages[:-(-end // self.page_size)]
        first = pages[0] if pages else 0
        return first * self.page_size if pages == list(range(first, first + len(pages))) else None

    def write(self, layer: int, seq: SequenceKV, k: torch.Tensor, v: torch.Tensor, start: int | None = None) -> int:
        """Writes k, v [T, Hkv, D] after the committed tokens (or at positions from `start`, rows the sequence
        already holds); returns the position after the last written."""
        start = seq.length if start is None else start
        end = start + k.shape[0]
        self.k[layer].index_copy_(0, seq.slots[start:end], k.to(self.dtype))
        if not self.values_are_keys:
            self.v[layer].index_copy_(0, seq.slots[start:end], v.to(self.dtype))
        return end

    def read_runs(self, layer: int, runs: list[tuple[int, int]]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The layer's keys and values of each run (`slot_runs`) as views of the pools, which the caller must only
        read."""
        keys = [self.k[layer][first:first + count] for first, count in runs]
        return keys, keys if self.values_are_keys else [self.v[layer][first:first + count] for first, count in runs]

    def update(self, layer: int, seq: SequenceKV, k: torch.Tensor, v: torch.Tensor, start: int | None = None,
               base: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`write`s k, v; returns all keys/values up to the last written [start + T, Hkv, D]: gathered, or (`base`:
        `contiguous_base` of this forward) views of the pools, which the caller must only read."""
        end = self.write(layer, seq, k, v, start)
        if end == k.shape[0]:
            return k, v  # nothing cached before: skip the gather
        if base is not None:
            keys = self.k[layer][base:base + end]
            return keys, keys if self.values_are_keys else self.v[layer][base:base + end]
        slots = seq.slots[:end]
        keys = self.k[layer].index_select(0, slots)
        return keys, keys if self.values_are_keys else self.v[layer].index_select(0, slots)

    def commit(self, seq: SequenceKV, n_new: int) -> None:
        seq.length += n_new

    def truncate(self, seq: SequenceKV, length: int, recurrent: dict | None = None) -> None:
        """Drops tokens past `length` (rollback); frees pages no longer needed. A sequence with recurrent state
        cannot go back (its state holds every token): restore a fork taken at the point instead, or give the
        layers' states at `length` as `recurrent` (speculative decoding keeps them across one pass)."""
        if recurrent is not None:
            seq.recurrent = dict(recurrent)
        elif seq.recurrent and length < seq.length:
            raise RecurrentStateError(f"cannot roll a sequence with recurrent state back from {seq.length} to "
                                      f"{length} tokens; restore a snapshot (a fork) taken there instead")
        keep = -(-length // self.page_size)
        self.allocator.free(seq.pages[keep:])
        del seq.pages[keep:]
        seq.slots = seq.slots[: keep * self.page_size]
        seq.length = min(seq.length, length)
