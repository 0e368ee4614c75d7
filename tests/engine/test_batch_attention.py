"""BatchAttention's decode-only step: one KV write and one padded gather for all sequences, the same outputs and
cache contents as attending one sequence at a time (GQA, latent attention's V = K, sequences of unequal length)."""

from __future__ import annotations

import pytest
import torch

from freetoken.engine.attention import BatchAttention
from freetoken.engine.kv_cache import PagedKVCache


def _cache(values_are_keys: bool, lengths: list[int], gen: torch.Generator):
    cache = PagedKVCache(2, 2, 8, page_size=4, values_are_keys=values_are_keys)
    seqs = [cache.new_sequence() for _ in lengths]
    for seq, n in zip(seqs, lengths, strict=True):  # history written through the cache's own path
        if n:
            cache.reserve(seq, n)
            for layer in range(2):
                cache.update(layer, seq, torch.randn(n, 2, 8, generator=gen), torch.randn(n, 2, 8, generator=gen))
            cache.commit(seq, n)
    return cache, seqs


@pytest.mark.parametrize("values_are_keys, sinks, window", [(False, False, None), (True, False, None),
                                                            (False, True, None), (False, False, 4), (False, True, 6)])
def test_a_decode_step_attends_in_one_call_like_one_sequence_at_a_time(values_are_keys, sinks, window):
    """Also with gpt-oss's attention sinks and sliding window."""
    gen = torch.Generator().manual_seed(int(values_are_keys))
    lengths = [0, 5, 13]
    q = torch.randn(3, 4, 8, generator=gen)  # 4 query heads over 2 KV heads
    k, v = torch.randn(3, 2, 8, generator=gen), torch.randn(3, 2, 8, generator=gen)
    if values_are_keys:  # latent attention hands its latent as both
        v = k
    extra = {"sinks": torch.randn(4, generator=gen) if sinks else None, "window": window}
    outputs, pools = [], []
    for batched in (True, False):
        cache, seqs = _cache(values_are_keys, lengths, torch.Generator().manual_seed(7))
        ctx = BatchAttention(cache, seqs, [1, 1, 1], torch.device("cpu"))
        assert (ctx._decode is not None) is True
        if not batched:
            ctx._decode = None  # the per-sequence path
        outputs.append([ctx.attend(layer, q, k, v, **extra) for layer in range(2)])
        ctx.commit()
        pools.append([cache.update(layer, s, k[:0], v[:0]) for layer in range(2) for s in seqs])
    for got, want in zip(outputs[0], outputs[1], strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    for (gk, gv), (wk, wv) in zip(pools[0], pools[1], strict=True):  # the new tokens landed in the same slots
        assert torch.equal(gk, wk) and torch.equal(gv, wv)


def test_decode_rows_beside_a_prefill_chunk_attend_together_and_the_chunk_alone():
    lengths, counts = [4, 0, 9, 2], [1, 3, 1, 1]  # a 3-token chunk of a new sequence among three decode tokens
    gen = torch.Generator().manual_seed(5)
    rows = sum(counts)
    q, k, v = torch.randn(rows, 4, 8, generator=gen), torch.randn(rows, 2, 8, generator=gen), \
        torch.randn(rows, 2, 8, generator=gen)
    outputs = []
    for batched in (True, False):
        cache, seqs = _cache(False, lengths, torch.Generator().manual_seed(8))
        ctx = BatchAttention(cache, seqs, counts, torch.device("cpu"))
        assert ctx._decode is not None and list(ctx._chunks) == [1]
        if not batched:
            ctx._decode = None
        outputs.append(torch.cat([ctx.attend(layer, q, k, v) for layer in range(2)]))
    torch.testing.assert_close(outputs[0], outputs[1], atol=1e-6, rtol=1e-6)


def test_a_lone_decode_token_or_a_too_wide_batch_attend_per_sequence():
    cache, seqs = _cache(False, [3, 4], torch.Generator().manual_seed(1))
    assert BatchAttention(cache, seqs, [2, 1], torch.device("cpu"))._decode is None  # one decode token only
    wide = BatchAttention.BATCHED_DECODE_ROWS
    try:
        BatchAttention.BATCHED_DECODE_ROWS = 9  # 2 sequences × 5 padded rows is over it
        assert BatchAttention(cache, seqs, [1, 1], torch.device("cpu"))._decode is None
    finally:
        BatchAttention.BATCHED_DECODE_ROWS = wide


class _EveryKey:
    """A selection that keeps every visible key: selected attention must then be plain causal attention."""

    heads = 1

    def visible(self, rows, keys, visible):
        return visible


@pytest.mark.parametrize("sinks, window", [(False, None), (True, None), (False, 4), (True, 6)])
def test_a_selection_keeping_every_key_is_causal_attention(sinks, window, monkeypatch):
    """The sparse-attention path honours sinks and windows like the dense one, and its query blocks (forced
    small here) change nothing."""
    from freetoken.engine import attention

    gen = torch.Generator().manual_seed(7)
    past, t = 9, 7
    q = torch.randn(t, 4, 8, generator=gen)
    k, v = torch.randn(past + t, 2, 8, generator=gen), torch.randn(past + t, 2, 8, generator=gen)
    s = torch.randn(4, generator=gen) if sinks else None
    want = attention.causal_attention(q, k, v, past, sinks=s, window=window)
    monkeypatch.setattr(attention, "SELECTION_SCORES", 2 * (past + t))  # two queries a block
    got = attention.selected_attention(q, k, v, past, _EveryKey(), 0, s, window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
