"""Paged KV cache: page bookkeeping, growth, rollback, and that paged attention equals one-shot attention."""

import pytest
import torch

from freetoken.engine.kv_cache import PageAllocator, PagedKVCache


def test_allocator_hands_out_each_page_once_and_reuses_freed_pages():
    alloc = PageAllocator(4)
    a, b = alloc.allocate(3), alloc.allocate(1)
    assert sorted(a + b) == [0, 1, 2, 3] and alloc.num_free == 0
    with pytest.raises(MemoryError):
        alloc.allocate(1)
    alloc.free(a)
    assert sorted(alloc.allocate(3)) == sorted(a)


def test_cache_grows_and_returns_written_values_in_order():
    cache = PagedKVCache(n_layers=2, n_kv_heads=2, head_dim=4, page_size=4, initial_pages=1)
    seq = cache.new_sequence()
    written = []
    for chunk in (3, 1, 6, 1):  # crosses page boundaries and forces the pool to grow twice
        k = torch.randn(chunk, 2, 4)
        cache.reserve(seq, chunk)
        keys, values = cache.update(1, seq, k, -k)
        cache.commit(seq, chunk)
        written.append(k)
        expected = torch.cat(written)
        assert torch.equal(keys, expected) and torch.equal(values, -expected)
    assert seq.length == 11 and len(seq.pages) == 3 and cache.allocator.num_pages >= 3


def test_two_sequences_do_not_share_pages():
    cache = PagedKVCache(n_layers=1, n_kv_heads=1, head_dim=2, page_size=2, initial_pages=2)
    s1, s2 = cache.new_sequence(), cache.new_sequence()
    for seq, val in ((s1, 1.0), (s2, 2.0), (s1, 3.0)):
        cache.reserve(seq, 3)
        keys, _ = cache.update(0, seq, torch.full((3, 1, 2), val), torch.zeros(3, 1, 2))
        cache.commit(seq, 3)
    assert not set(s1.pages) & set(s2.pages)
    cache.reserve(s1, 0)
    assert torch.equal(cache.k[0].index_select(0, s1.slots[:6])[:, 0, 0], torch.tensor([1.0] * 3 + [3.0] * 3))


def test_truncate_frees_pages_and_rewrites_after_the_cut():
    cache = PagedKVCache(n_layers=1, n_kv_heads=1, head_dim=1, page_size=2, initial_pages=8)
    seq = cache.new_sequence()
    cache.reserve(seq, 7)
    cache.update(0, seq, torch.arange(7.0).view(7, 1, 1), torch.zeros(7, 1, 1))
    cache.commit(seq, 7)
    free_before = cache.allocator.num_free
    cache.truncate(seq, 3)
    assert seq.length == 3 and len(seq.pages) == 2 and cache.allocator.num_free == free_before + 2
    cache.reserve(seq, 1)
    keys, _ = cache.update(0, seq, torch.full((1, 1, 1), 9.0), torch.zeros(1, 1, 1))
    assert keys.flatten().tolist() == [0.0, 1.0, 2.0, 9.0]


def test_budget_is_enforced():
    cache = PagedKVCache(n_layers=1, n_kv_heads=1, head_dim=1, page_size=2, initial_pages=1, max_pages=2)
    seq = cache.new_sequence()
    cache.reserve(seq, 4)
    with pytest.raises(MemoryError):
        cache.reserve(seq, 5)


def _write(cache, seq, values):
    cache.reserve(seq, len(values))
    for layer in range(cache.n_layers):
        k = torch.tensor(values, dtype=torch.float32).view(-1, 1, 1)
        cache.update(layer, seq, k, torch.zeros_like(k))
    cache.commit(seq, len(values))


def _read(cache, seq, layer=0):
    return cache.k[layer].index_select(0, seq.slots[:seq.length]).flatten().tolist()


def test_a_fork_shares_every_page_until_a_branch_writes_then_only_that_page_is_copied():
    cache = PagedKVCache(n_layers=2, n_kv_heads=1, head_dim=1, page_size=4, initial_pages=16)
    parent = cache.new_sequence()
    _write(cache, parent, list(range(10)))  # pages: full, full, 2 of 4
    free = cache.allocator.num_free
    child = cache.fork(parent)
    assert child.pages == parent.pages and cache.allocator.num_free == free  # O(1): nothing allocated
    _write(cache, child, [100.0])  # lands in the shared partial page: the child copies it
    assert cache.allocator.num_free == free - 1 and child.pages[:2] == parent.pages[:2]
    assert child.pages[2] != parent.pages[2]
    _write(cache, parent, [200.0, 201.0, 202.0])  # the parent's page is its own again; then a new page
    for layer in range(2):
        assert _read(cache, child, layer) == list(range(10)) + [100.0]
        assert _read(cache, parent, layer) == list(range(10)) + [200.0, 201.0, 202.0]
    cache.release(parent)
    cache.release(child)
    assert cache.allocator.num_free == cache.allocator.num_pages and not cache.allocator.refs


def test_random_forks_truncations_and_writes_never_leak_or_mix_up_pages():
    """1,000 random operations on a family of forked sequences: each reads back exactly what it wrote (its
    shared history included), and once all are released every page is free."""
    import random

    rng = random.Random(0)
    cache = PagedKVCache(n_layers=1, n_kv_heads=1, head_dim=1, page_size=4, initial_pages=4)
    seqs = [(cache.new_sequence(), [])]
    for _ in range(1000):
        i = rng.randrange(len(seqs))
        seq, content = seqs[i]
        op = rng.random()
        if op < 0.45:
            values = [float(rng.randrange(1000)) for _ in range(rng.randrange(1, 7))]
            _write(cache, seq, values)
            content.extend(values)
        elif op < 0.65 and len(seqs) < 12:
            seqs.append((cache.fork(seq), list(content)))
        elif op < 0.85:
            keep = rng.randrange(len(content) + 1)
            cache.truncate(seq, keep)
            del content[keep:]
        elif len(seqs) > 1:
            cache.release(seq)
            seqs.pop(i)
        for s, c in seqs:
            assert _read(cache, s) == c
        holders = {}
        for s, _ in seqs:
            for p in s.pages:
                holders[p] = holders.get(p, 0) + 1
        assert holders == cache.allocator.refs
    for s, _ in seqs:
        cache.release(s)
    assert cache.allocator.num_free == cache.allocator.num_pages


def test_forking_a_4k_token_sequence_allocates_nothing_until_a_branch_writes():
    cache = PagedKVCache(n_layers=2, n_kv_heads=1, head_dim=1, page_size=16, initial_pages=300)
    parent = cache.new_sequence()
    _write(cache, parent, [float(i % 97) for i in range(4000)])  # 250 pages, the last one partial
    free = cache.allocator.num_free
    branches = [cache.fork(parent) for _ in range(8)]
    assert cache.allocator.num_free == free  # eight forks of 4k tokens: not one page
    _write(cache, branches[0], [1.0])  # the first write copies only the shared partial page
    assert cache.allocator.num_free == free - 1
    for seq in [parent, *branches]:
        cache.release(seq)
    assert cache.allocator.num_free == cache.allocator.num_pages


@pytest.mark.parametrize("full", [False, True])
def test_resizing_the_pool_keeps_every_sequence_and_moves_pages_past_a_smaller_size(full):
    """`full`: the pool allocated at its budget up front (as CUDA graphs need): it is reallocated either way."""
    cache = PagedKVCache(n_layers=2, n_kv_heads=1, head_dim=1, page_size=2, initial_pages=16 if full else 4,
                         max_pages=16)
    seqs, contents = [], []
    for i in range(5):
        seq = cache.new_sequence()
        values = [float(10 * i + j) for j in range(3 + i)]
        _write(cache, seq, values)
        seqs.append(seq)
        contents.append(values)
    cache.release(seqs.pop(1))  # a hole in the middle of the pool
    contents.pop(1)
    fork = cache.fork(seqs[0])
    seqs.append(fork)
    contents.append(list(contents[0]))
    held = len(cache.allocator.refs)
    moved = []
    cache.remap_hooks.append(moved.append)
    version = cache.version
    info = cache.resize(held)  # as small as the live pages allow: pages past it must move
    assert info["pages"] == held == cache.allocator.num_pages and cache.version > version
    assert all(p < held for s in seqs for p in s.pages) and moved and moved[0]
    for s, c in zip(seqs, contents, strict=True):
        for layer in range(2):
            assert _read(cache, s, layer) == c
    with pytest.raises(ValueError, match="held by live requests"):
        cache.resize(held - 1)
    cache.resize(32)  # grows back; writes go on
    _write(cache, fork, [99.0])
    assert _read(cache, fork) == contents[-1] + [99.0] and _read(cache, seqs[0]) == contents[0]
    for s in seqs:
        cache.release(s)
    assert cache.allocator.num_free == cache.allocator.num_pages and not cache.allocator.refs


def test_shrinking_a_growing_pool_with_nothing_to_move_still_shrinks_it():
    cache = PagedKVCache(n_layers=1, n_kv_heads=1, head_dim=1, page_size=2, initial_pages=16)
    seq = cache.new_sequence()
    _write(cache, seq, [1.0, 2.0, 3.0])  # pages 0 and 1
    cache.resize(4)
    assert cache.allocator.num_pages == 4 == cache.max_pages and cache.k[0].shape[0] == 8
    assert cache.allocator.num_free == 2 and _read(cache, seq) == [1.0, 2.0, 3.0]


@pytest.mark.parametrize("values_are_keys", [False, True])
def test_consecutive_slots_are_read_as_views_and_any_other_layout_is_gathered(values_are_keys):
    """A sequence whose pages are consecutive reads its keys as views of the pools (no gather); one whose pages
    are not (a fork's copied page, pages freed and handed out again out of order) is gathered: the same values
    either way."""
    cache = PagedKVCache(n_layers=1, n_kv_heads=2, head_dim=4, page_size=4, initial_pages=16,
                         values_are_keys=values_are_keys)
    gen = torch.Generator().manual_seed(3)
    seq = cache.new_sequence()
    k = torch.randn(10, 2, 4, generator=gen)
    cache.reserve(seq, 10)
    cache.update(0, seq, k, -k)
    cache.commit(seq, 10)
    new = torch.randn(1, 2, 4, generator=gen)
    cache.reserve(seq, 1)
    base = cache.contiguous_base(seq, 11)
    assert base == seq.pages[0] * 4
    viewed = cache.update(0, seq, new, -new, base=base)
    gathered = cache.update(0, seq, new, -new)
    for a, b in zip(viewed, gathered, strict=True):
        assert torch.equal(a, b) and a.shape == (11, 2, 4)
    assert viewed[0].untyped_storage().data_ptr() == cache.k[0].untyped_storage().data_ptr()  # a view
    want = torch.cat([k, new])
    assert torch.equal(viewed[0], want) and torch.equal(viewed[1], want if values_are_keys else -want)
    child = cache.fork(seq)  # shares every page; its first write copies the shared last page
    cache.reserve(child, 1)
    assert child.pages[-1] != seq.pages[-1] and cache.contiguous_base(child, 12) is None
    assert cache.contiguous_base(child, 8) == base  # its first two pages are still the parent's, in order
    shuffled = cache.new_sequence()
    shuffled.pages = [seq.pages[1], seq.pages[0]]  # consecutive ids, out of order
    assert cache.contiguous_base(shuffled, 8) is None
