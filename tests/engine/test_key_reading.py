"""Reading a sequence's cached keys: as views where its slots are consecutive, run by run without gathering where
they form a few runs (a reused prefix, then its last page's copy and new pages elsewhere), else gathered; every
way gives the attention of the gathered keys."""

from __future__ import annotations

import pytest
import torch

from freetoken.engine import attention
from freetoken.engine.attention import KeyReading, SequenceAttention, causal_attention, run_attention
from freetoken.engine.kv_cache import PagedKVCache


def _cache_with(tokens: int, values_are_keys: bool = False) -> tuple[PagedKVCache, object]:
    cache = PagedKVCache(n_layers=1, n_kv_heads=2, head_dim=8, page_size=4, initial_pages=64,
                         values_are_keys=values_are_keys)
    seq = cache.new_sequence()
    k = torch.randn(tokens, 2, 8, generator=torch.Generator().manual_seed(tokens))
    cache.reserve(seq, tokens)
    cache.update(0, seq, k, -k)
    cache.commit(seq, tokens)
    return cache, seq


def test_slot_runs_merge_consecutive_pages_in_position_order():
    cache = PagedKVCache(n_layers=1, n_kv_heads=1, head_dim=4, page_size=4, initial_pages=16)
    seq = cache.new_sequence()
    seq.pages = [3, 4, 5, 9, 2, 3]
    assert cache.slot_runs(seq, 22) == [(12, 12), (36, 4), (8, 6)]  # the last page holds 2 of its 4 slots
    assert cache.slot_runs(seq, 12) == [(12, 12)] and cache.contiguous_base(seq, 12) == 12
    assert cache.contiguous_base(seq, 13) is None


@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("value_dim", [8, 5])
def test_attention_over_runs_is_attention_over_the_gathered_keys(tokens, value_dim):
    """One softmax over every run's scores: the same as attending over the keys gathered into one tensor, with
    grouped query heads and, for several new tokens, the causal mask aligned to the last key."""
    gen = torch.Generator().manual_seed(value_dim * tokens)
    past = 37
    keys, values = torch.randn(past + tokens, 2, 8, generator=gen), torch.randn(past + tokens, 2, value_dim,
                                                                                  generator=gen)
    q = torch.randn(tokens, 6, 8, generator=gen)
    cuts = [0, 5, 21, 22, past + tokens]  # runs of 5, 16, 1 and the rest
    runs = [(keys[a:b], values[a:b]) for a, b in zip(cuts, cuts[1:], strict=False)]
    got = run_attention(q, [k for k, _ in runs], [v for _, v in runs], past=past)
    want = causal_attention(q, keys, values, past=past) if value_dim == 8 else _plain_attention(q, keys, values, past)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _plain_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int) -> torch.Tensor:
    """Softmax attention written out (values of another width than the keys), grouped heads, causal."""
    t, h, d = q.shape
    k, v = (x.repeat_interleave(h // x.shape[1], dim=1) for x in (k, v))
    scores = torch.einsum("thd,lhd->htl", q, k) * d ** -0.5
    scores = scores.masked_fill(torch.arange(k.shape[0]) > past + torch.arange(t)[:, None], float("-inf"))
    return torch.einsum("htl,lhd->thd", scores.softmax(-1), v)


@pytest.mark.parametrize("values_are_keys", [False, True])
def test_a_forks_decode_reads_its_keys_by_runs_and_attends_as_if_gathered(values_are_keys, monkeypatch):
    """A fork shares its parent's pages and copies the shared last page at its first write: its keys are two runs.
    Its decode token reads them as views, run by run, and gets the gathered keys' attention; a long forward, a
    layout of too many runs or a pool on consecutive slots read as before."""
    cache, seq = _cache_with(10, values_are_keys)
    child = cache.fork(seq)
    q, new = torch.randn(1, 4, 8), torch.randn(1, 2, 8)
    ctx = SequenceAttention(cache, child, 1, torch.device("cpu"))
    assert ctx._read.base is None and len(ctx._read.runs) == 2
    calls = []
    monkeypatch.setattr(attention, "run_attention", lambda *a, **kw: calls.append(1) or run_attention(*a, **kw))
    got = ctx.attend(0, q, new, -new)
    assert calls == [1]
    keys, values = cache.update(0, child, new, -new)  # the same write again, then the gathered keys
    torch.testing.assert_close(got, causal_attention(q, keys, values, past=10), atol=1e-6, rtol=1e-6)
    assert KeyReading(cache, child, KeyReading.RUN_ROWS + 1).runs is None  # a prefill chunk gathers
    monkeypatch.setattr(KeyReading, "MAX_RUNS", 1)
    assert KeyReading(cache, child, 1).runs is None
    assert KeyReading(cache, seq, 1).base is not None  # the parent: consecutive pages, views


def test_a_cache_in_another_dtype_gathers():
    cache = PagedKVCache(n_layers=1, n_kv_heads=2, head_dim=8, page_size=4, initial_pages=16, dtype=torch.bfloat16)
    seq = cache.new_sequence()
    cache.reserve(seq, 6)
    cache.update(0, seq, torch.randn(6, 2, 8), torch.randn(6, 2, 8))
    cache.commit(seq, 6)
    child = cache.fork(seq)
    assert KeyReading(cache, child, 1).runs is None
