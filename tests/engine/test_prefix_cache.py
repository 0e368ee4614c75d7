"""Cross-request prefix reuse: the index of full pages, shared pages' reference counts, and the scheduler reusing
an earlier request's K/V for a prompt that starts the same way (same logits, same tokens as a fresh run)."""

from __future__ import annotations

import random

import pytest
import torch

from freetoken.engine.batching import BatchRequest, BatchScheduler
from freetoken.engine.generator import Generator
from freetoken.engine.kv_cache import PageAllocator
from freetoken.engine.loader import load_model
from freetoken.engine.prefix_cache import PrefixCache
from freetoken.engine.sampling import SamplingParams
from support.checkpoints import PARITY_CASES, prompt_ids, write_hf_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _index(pages: int = 32, page_size: int = 4, max_pages: int | None = None):
    alloc = PageAllocator(pages)
    return alloc, PrefixCache(page_size, alloc.retain, alloc.free, max_pages=max_pages)


def _sequence(rng: random.Random, alloc: PageAllocator, index: PrefixCache, shortest: int, longest: int):
    """A random sequence of 4-token pages (tokens from 3 ids, so prefixes repeat): its tokens and its pages, the
    cached prefix the index matched (referenced) and new pages for the rest."""
    tokens = [rng.randrange(3) for _ in range(rng.randrange(shortest, longest))]
    shared = index.match(tokens)
    alloc.retain(shared)
    return tokens, shared + alloc.allocate(-(-len(tokens) // 4) - len(shared))


def test_the_longest_run_of_whole_pages_matches_and_one_token_is_always_left():
    alloc, index = _index()
    tokens = list(range(10))  # pages [0-3] [4-7], then 2 tokens in a partial page
    pages = alloc.allocate(3)
    index.insert(tokens, pages)
    assert len(index) == 2 and alloc.refs[pages[0]] == 2 and alloc.refs[pages[2]] == 1  # partial page not kept
    assert index.match(tokens) == pages[:2]
    assert index.match(tokens[:8]) == pages[:1]  # 8 tokens: the second page would leave nothing to compute
    assert index.match([0, 1, 2, 3, 9, 9, 9, 9, 9]) == pages[:1]  # diverges in the second page
    assert index.match([7, 1, 2, 3, 4, 5]) == []  # a page's key chains everything before it
    alloc.free(pages)  # the sequence ends: the index still holds the full pages
    assert alloc.num_free == 32 - 2
    index.clear()
    assert alloc.num_free == 32 and not alloc.refs


def test_eviction_drops_the_least_recently_used_leaf_and_shared_pages_survive_it():
    alloc, index = _index(max_pages=3)
    a, b = list(range(100, 108)), list(range(200, 208))
    pa, pb = alloc.allocate(2), alloc.allocate(2)
    index.insert(a, pa)
    index.insert(b, pb)  # 4 pages > 3: a's last page goes (a's first is older, but b's... a's second continues it)
    assert len(index) == 3 and index.match(a + [0]) == pa[:1]  # a's chain is shorter, not broken
    assert index.evicted == 1 and alloc.refs[pa[1]] == 1  # a's sequence still holds it
    index.match(b + [0])  # b used again: a's first page is now the oldest leaf
    assert index.evict(1) == 1 and index.match(b + [0]) == pb and index.match(a + [0]) == []
    alloc.free(pa + pb)
    index.clear()
    assert alloc.num_free == 32 and not alloc.refs


def test_random_shares_and_evictions_keep_the_reference_counts_exact():
    rng = random.Random(0)
    alloc, index = _index(pages=64, max_pages=12)
    live: list[list[int]] = []
    for _ in range(500):
        op = rng.random()
        if op < 0.4 and alloc.num_free >= 3:
            live.append(_sequence(rng, alloc, index, 1, 12))
        elif op < 0.8 and live:
            tokens, pages = live.pop(rng.randrange(len(live)))
            index.insert(tokens, pages)
            alloc.free(pages)
        else:
            index.evict(rng.randrange(1, 4))
        holders = {}
        for _, pages in live:
            for p in pages:
                holders[p] = holders.get(p, 0) + 1
        for page, _, _ in index._pages.values():
            holders[page] = holders.get(page, 0) + 1
        assert holders == alloc.refs
        assert alloc.num_free + len(alloc.refs) == alloc.num_pages
    for _, pages in live:
        alloc.free(pages)
    index.clear()
    assert alloc.num_free == alloc.num_pages


def test_each_eviction_takes_a_leaf_of_least_credit():
    """The leaf candidates are kept in a heap rather than found by a scan of every page: over random inserts,
    matches and evictions, each evicted page was a leaf of the least credit among the leaves at that moment."""
    rng = random.Random(1)
    alloc, index = _index(pages=256, max_pages=None)
    evictions = 0
    for _ in range(600):
        op = rng.random()
        if op < 0.5 and alloc.num_free >= 6:
            tokens, pages = _sequence(rng, alloc, index, 4, 24)
            index.insert(tokens, pages)
            alloc.free(pages)
        elif op < 0.7:
            index.match([rng.randrange(3) for _ in range(rng.randrange(4, 24))])
        elif len(index):
            leaves = {k: index._credit[k] for k in index._pages if not index._children.get(k)}
            least = min(leaves.values())
            before = set(index._pages)
            assert index.evict(1) == 1
            (gone,) = before - set(index._pages)
            assert leaves.get(gone) == least
            evictions += 1
    assert evictions > 100
    index.clear()
    assert not len(index) and alloc.num_free == alloc.num_pages


@pytest.fixture(scope="module", params=["llama", "qwen3_moe"])
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    write_hf_checkpoint(path=path, **PARITY_CASES[request.param])
    return load_model(path, progress=False)


def _generate(scheduler: BatchScheduler, prompt: list[int]) -> tuple[list[int], BatchRequest, torch.Tensor]:
    """Runs one request alone; returns its tokens, the request and the logits its first token came from."""
    out: list[int] = []
    req = BatchRequest(prompt, GREEDY, emit=lambda ev: out.extend(ev.token_ids))
    scheduler.add(req)
    first = []
    accept = req.reply.accept
    req.reply.accept = lambda logits: (first.append(logits.clone()) if not first else None, accept(logits))[1]
    while scheduler.active:
        scheduler.step()
    return out, req, first[0]


def test_an_agents_next_turn_reuses_the_last_turns_kv_and_gets_the_fresh_runs_logits_and_tokens(model, monkeypatch):
    """With another request's pages cached between (a title request), the reused turn's new pages are not next to
    the cached ones: its decode reads its keys run by run (attention.KeyReading)."""
    from freetoken.engine import attention

    by_runs, plain = [], attention.run_attention
    monkeypatch.setattr(attention, "run_attention", lambda *a, **kw: by_runs.append(1) or plain(*a, **kw))
    scheduler = BatchScheduler(model, prefill_chunk=8, page_size=4)
    turn1 = prompt_ids("You are a coding agent. The repository has three files and a failing test. Fix it.")
    out1, req1, _ = _generate(scheduler, turn1)
    assert req1.cached == 0 and len(scheduler.prefix) == (len(turn1) + len(out1) - 1) // 4
    _generate(scheduler, prompt_ids("Write a five-word title for this conversation."))
    turn2 = turn1 + out1 + prompt_ids(" The test passes now; what next?")
    out2, req2, logits2 = _generate(scheduler, turn2)
    reused = (len(turn1) + len(out1) - 1) // 4 * 4  # whole pages of turn 1's prompt and reply
    assert req2.cached == reused and req2.reply.cached_tokens == reused
    torch.testing.assert_close(logits2, model.prefill_logits(turn2)[-1], atol=1e-4, rtol=1e-4)
    assert out2 == Generator(model).generate_ids(turn2, GREEDY) and by_runs
    # the same prompt again: everything but its last partial page (and at least one token) comes from the cache
    out3, req3, _ = _generate(scheduler, turn2)
    assert out3 == out2 and req3.cached == (len(turn2) - 1) // 4 * 4


def test_a_full_pool_takes_pages_back_from_the_prefix_cache_instead_of_failing_requests(model):
    scheduler = BatchScheduler(model, prefill_chunk=8, page_size=4, kv_tokens=64, max_seq_len=64)
    for i in range(12):  # 12 distinct prompts of ~24 tokens through a pool of 16 pages
        out, req, _ = _generate(scheduler, prompt_ids(f"Request number {i} asks about something else entirely."))
        assert len(out) == GREEDY.max_tokens
    assert scheduler.prefix.evicted > 0
    scheduler.prefix.clear()
    assert scheduler.cache.allocator.num_free == scheduler.cache.allocator.num_pages


def test_eviction_weighs_recompute_cost_against_age():
    """A page deep into a long conversation costs more to recompute than the first page of a short one: with
    both unused since, the cheap one goes first; once the expensive one has sat unused while others were used
    and evicted, it goes too."""
    alloc, index = _index(pages=256, page_size=16)
    deep = list(range(1000, 1000 + 16 * 120))  # 120 pages: its leaf sits at token 1,900
    shallow = list(range(5000, 5016))
    pd, ps = alloc.allocate(120), alloc.allocate(1)
    index.insert(deep, pd)
    index.insert(shallow, ps)  # used after the deep one
    assert index.evict(1) == 1 and index.match(shallow + [0]) == []  # the cheap leaf went despite being newer
    assert index.match(deep + [0]) == pd
    for i in range(40):  # a stream of other short conversations, used and evicted while the deep one idles
        other = list(range(10_000 + 16 * i, 10_016 + 16 * i))
        page = alloc.allocate(1)
        index.insert(other, page)
        alloc.free(page)
        index.evict(1)
    assert len(index.match(deep + [0])) < 120  # its tail went after all
    alloc.free(pd + ps)
    index.clear()
    assert alloc.num_free == 256


def test_the_tree_the_dashboard_draws_merges_straight_runs_and_shows_forks():
    alloc, index = _index(page_size=2)
    pages = alloc.allocate(12)
    index.insert([1, 2, 3, 4, 5, 6], pages[0:3])  # one conversation, 3 pages
    index.insert([1, 2, 3, 4, 7, 8, 9, 9], [pages[0], pages[1], pages[3], pages[4]])  # an edit after 2 pages
    index.insert([5, 5], pages[5:6])  # an unrelated prompt
    assert index.tree() == [{"tokens": 4, "children": [{"tokens": 2, "children": []},
                                                       {"tokens": 4, "children": []}]},
                            {"tokens": 2, "children": []}]
    assert index.tree(max_nodes=1) == [{"tokens": 4, "children": [{"more": 2}]}, {"more": 1}]
