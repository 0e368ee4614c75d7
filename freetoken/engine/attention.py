"""Where attention reads and writes its keys and values: the contexts a model forward runs in.

A model's attention layer hands q, k, v to the context and gets the attention output back; the context owns
the KV cache traffic and the causal mask. Four contexts:
- `SequenceAttention`: T new tokens of one sequence appended to the paged cache (prefill, eager decode).
- `BatchAttention`: new tokens of several sequences in one forward (continuous batching): every other layer runs
  over all their rows at once, attention per sequence over its own keys.
- `StaticDecodeAttention`: one token whose position and slots live in device buffers with fixed shapes, so the
  whole decode step can be captured once in a CUDA graph and replayed (see cuda_graphs.py).
- `StaticBatchAttention`: the same for one token of each of B sequences (a continuous-batching decode step).

Shapes: T new tokens, W window of key slots, H query heads, Hkv KV heads, D head dim.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from freetoken.engine import gpu_paths
from freetoken.engine.kv_cache import PagedKVCache, RecurrentStateError, SequenceKV


class KeyReading:
    """How one sequence's forward reads its cached keys and values, chosen once per forward (after `reserve`): as
    views of the pools where its positions sit in consecutive slots; on the CPU, for a decode-sized forward whose
    slots form a few runs (a prefix reused from the prefix cache, then its last page's copy and the new pages
    elsewhere: every request a server answers from it), run by run without gathering (`run_attention`); else
    gathered."""

    RUN_ROWS = 4  # new tokens at most for reading by runs (a decode token, a speculative pass's two)
    MAX_RUNS = 8  # more runs than this and their per-run calls cost more than the gather saves

    def __init__(self, cache: PagedKVCache, seq: SequenceKV, n_new: int):
        self.cache, self.seq = cache, seq
        self.base = cache.contiguous_base(seq, seq.length + n_new)
        self.runs = None
        if (self.base is None and n_new <= self.RUN_ROWS and seq.length and cache.device.type == "cpu"
                and cache.dtype == torch.float32):
            runs = cache.slot_runs(seq, seq.length + n_new)
            self.runs = runs if len(runs) <= self.MAX_RUNS else None

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None,
               window: int | None, select: KeySelection | None, first_row: int) -> torch.Tensor:
        """Writes the new tokens' k, v and attends q [T, H, D] (the forward's rows `first_row`..) over the
        sequence's keys (see `SequenceAttention.attend`)."""
        past = self.seq.length
        if self.runs is not None and sinks is None and window is None and select is None \
                and q.dtype == torch.float32:
            self.cache.write(layer, self.seq, k, v)
            return run_attention(q, *self.cache.read_runs(layer, self.runs), past=past)
        keys, values = self.cache.update(layer, self.seq, k, v, base=self.base)  # [L + T, Hkv, D]
        keys, values = keys.to(q.dtype), values.to(q.dtype)
        if select is not None:
            return selected_attention(q, keys, values, past, select, first_row, sinks, window)
        return causal_attention(q, keys, values, past=past, sinks=sinks, window=window)


def run_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], past: int) -> torch.Tensor:
    """`causal_attention` over keys and values held as runs ([n, Hkv, D] views of the pools in position order,
    past + T rows in all) without gathering them: each run's scores, one softmax over all of them, each run's share
    of the values summed. For a few query rows q [T, H, D]: the scores are [H, T, past + T]."""
    t, h, d = q.shape
    kv_heads = keys[0].shape[1]
    group = h // kv_heads
    rows = q.reshape(t, kv_heads, group, d).transpose(0, 1).reshape(kv_heads, t * group, d) * d ** -0.5
    scores = torch.cat([torch.bmm(rows, k.permute(1, 2, 0)) for k in keys], dim=-1)  # [Hkv, T * G, L]
    if t > 1:  # row r is token r // G, at position past + r // G: later keys are masked
        last = past + torch.arange(t, device=q.device).repeat_interleave(group)
        scores.masked_fill_(torch.arange(scores.shape[-1], device=q.device) > last[:, None], float("-inf"))
    probs = scores.softmax(-1).split([k.shape[0] for k in keys], dim=-1)
    out = torch.bmm(probs[0], values[0].transpose(0, 1))
    for p, v in zip(probs[1:], values[1:], strict=True):
        out.baddbmm_(p, v.transpose(0, 1))
    return out.reshape(kv_heads, t, group, -1).transpose(0, 1).reshape(t, h, -1)


class SequenceAttention:
    def __init__(self, cache: PagedKVCache, seq: SequenceKV, n_new: int, device: torch.device):
        cache.reserve(seq, n_new)
        self.cache, self.seq, self.n_new = cache, seq, n_new
        self.positions = torch.arange(seq.length, seq.length + n_new, device=device)
        self._pending_state: dict[int, tuple[torch.Tensor, ...]] = {}
        self._read = KeyReading(cache, seq, n_new)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
               sinks: torch.Tensor | None = None, window: int | None = None,
               select: KeySelection | None = None) -> torch.Tensor:
        """`sinks` [H] (gpt-oss: a learnt logit per head in every softmax's denominator), `window`: each token
        sees only its last `window` positions (itself included), `select`: each token sees only the cached keys
        the selection picks for it (sparse attention)."""
        return self._read.attend(layer, q, k, v, sinks, window, select, first_row=0)

    def recurrent_state(self, layer: int) -> tuple[torch.Tensor, ...] | None:
        """A recurrent layer's state after the committed tokens (None before its first token)."""
        return self.seq.recurrent.get(layer)

    def set_recurrent_state(self, layer: int, state: tuple[torch.Tensor, ...]) -> None:
        """The layer's state after this forward's tokens; it replaces the old one when the forward commits."""
        self._pending_state[layer] = state

    def commit(self) -> None:
        self.cache.commit(self.seq, self.n_new)
        self.seq.recurrent.update(self._pending_state)


class TrailingAttention:
    """A layer that runs after the model's own at positions [start, start + n) the sequence already holds (the
    multi-token-prediction layer, models/mtp.py): its own cache rows written there, each attending to that
    layer's rows up to its position. Nothing is committed: the main layers did."""

    def __init__(self, cache: PagedKVCache, seq: SequenceKV, start: int, n: int, device: torch.device):
        if start < 0 or start + n > seq.length:
            raise ValueError(f"rows {start}..{start + n} are not all held by the sequence ({seq.length} tokens)")
        self.cache, self.seq, self.start = cache, seq, start
        self.positions = torch.arange(start, start + n, device=device)
        self._base = cache.contiguous_base(seq, start + n)

    def recurrent_state(self, layer: int) -> tuple[torch.Tensor, ...] | None:
        """The layer's own state (DeepSeek-V4 keeps its attention window there), after its last rows."""
        return self.seq.recurrent.get(layer)

    def set_recurrent_state(self, layer: int, state: tuple[torch.Tensor, ...]) -> None:
        self.seq.recurrent[layer] = state  # at once: the main layers committed these positions already

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
               select: KeySelection | None = None) -> torch.Tensor:
        """`select`: each row sees only the keys the selection picks (a sparse-attention layer's indexer)."""
        keys, values = self.cache.update(layer, self.seq, k, v, start=self.start, base=self._base)
        keys, values = keys.to(q.dtype), values.to(q.dtype)
        if select is not None:
            return selected_attention(q, keys, values, self.start, select, 0)
        return causal_attention(q, keys, values, past=self.start)


class SequenceRows:
    """One sequence's rows of a batched forward as a recurrent layer sees them: their positions and the sequence's
    recurrent state (the state a layer sets replaces the old one when the batch commits)."""

    __slots__ = ("seq", "positions", "_pending")

    def __init__(self, seq: SequenceKV, positions: torch.Tensor, pending: dict[int, tuple[torch.Tensor, ...]]):
        self.seq, self.positions, self._pending = seq, positions, pending

    def recurrent_state(self, layer: int) -> tuple[torch.Tensor, ...] | None:
        return self.seq.recurrent.get(layer)

    def set_recurrent_state(self, layer: int, state: tuple[torch.Tensor, ...]) -> None:
        self._pending[layer] = state


class BatchAttention:
    """Rows [bounds[i], bounds[i + 1]) of the forward are new tokens of seqs[i] (a decode token or a prefill chunk).
    The projections, MLPs and experts see all rows together, so weights are read once per step for the whole
    batch; attention runs per sequence, each over its own cached keys, and so do recurrent layers' state updates
    (`sequence_rows`)."""

    # The decode tokens of a step (one new token per sequence) attend in one call over their sequences' keys
    # gathered into [B, W] padded rows: one KV write and one gather per layer for all of them, not a write, a gather
    # and an SDPA call per sequence (the batched step's launches, evals/results/serve-q3-8l-h200.md), while the
    # padded rows stay under this. Prefill chunks in the same step attend per sequence.
    BATCHED_DECODE_ROWS = 1 << 18

    def __init__(self, cache: PagedKVCache, seqs: list[SequenceKV], counts: list[int], device: torch.device):
        self.cache, self.seqs, self.counts = cache, seqs, counts
        for seq, n in zip(seqs, counts, strict=True):
            cache.reserve(seq, n)
        self.bounds = [0]
        for n in counts:
            self.bounds.append(self.bounds[-1] + n)
        self.positions = torch.cat([torch.arange(s.length, s.length + n) for s, n in zip(seqs, counts, strict=True)]
                                   ).to(device)
        self._pending_states: list[dict[int, tuple[torch.Tensor, ...]]] = [{} for _ in seqs]
        # (rows or None for all, write slots [B], read slots [B, W], each row's position [B])
        self._decode = None
        self._chunks = range(len(seqs))  # sequences attended one at a time
        decoding = [i for i, n in enumerate(counts) if n == 1]
        width = max((seqs[i].length for i in decoding), default=0) + 1
        if len(decoding) > 1 and len(decoding) * width <= self.BATCHED_DECODE_ROWS:
            picked = [seqs[i] for i in decoding]
            write = torch.cat([s.slots[s.length:s.length + 1] for s in picked])
            read = torch.stack([F.pad(s.slots[:s.length + 1], (0, width - s.length - 1)) for s in picked])
            positions = torch.tensor([s.length for s in picked], device=read.device)  # each row's own slot
            rows = None if len(decoding) == len(seqs) else \
                torch.tensor([self.bounds[i] for i in decoding], device=device)
            self._decode = rows, write, read, positions
            self._chunks = [i for i, n in enumerate(counts) if n != 1]
        # the sequences attended one at a time read their keys as views, by runs or gathered (KeyReading)
        self._reads = {i: KeyReading(cache, seqs[i], counts[i]) for i in self._chunks}

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
               sinks: torch.Tensor | None = None, window: int | None = None,
               select: KeySelection | None = None) -> torch.Tensor:
        if self._decode is None:
            return torch.cat([self._attend_one(i, layer, q, k, v, sinks, window, select)
                              for i in range(len(self.seqs))])
        rows = self._decode[0]
        if rows is None:  # decode tokens only
            return self._attend_decode(layer, q, k, v, sinks, window, select)
        out = torch.empty_like(q)
        out[rows] = self._attend_decode(layer, q[rows], k[rows], v[rows], sinks, window, select)
        for i in self._chunks:
            out[self.bounds[i]:self.bounds[i + 1]] = self._attend_one(i, layer, q, k, v, sinks, window, select)
        return out

    def _attend_one(self, i: int, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    sinks: torch.Tensor | None, window: int | None, select: KeySelection | None) -> torch.Tensor:
        a, b = self.bounds[i], self.bounds[i + 1]
        if i not in self._reads:  # a decode row attended alone (the batched path set aside)
            self._reads[i] = KeyReading(self.cache, self.seqs[i], self.counts[i])
        return self._reads[i].attend(layer, q[a:b], k[a:b], v[a:b], sinks, window, select, first_row=a)

    def _attend_decode(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       sinks: torch.Tensor | None = None, window: int | None = None,
                       select: KeySelection | None = None) -> torch.Tensor:
        rows, write, read, positions = self._decode
        return decode_rows_attention(self.cache, layer, q, k, v, write, read, positions,
                                     slice(None) if rows is None else rows, sinks, window, select)

    def sequences(self) -> list[tuple[int, int, SequenceRows]]:
        """(first row, end row, its view) of each sequence, for layers whose state is per sequence."""
        return [(self.bounds[i], self.bounds[i + 1],
                 SequenceRows(seq, self.positions[self.bounds[i]:self.bounds[i + 1]], self._pending_states[i]))
                for i, seq in enumerate(self.seqs)]

    def recurrent_state(self, layer: int):
        """Refused: a batch holds several sequences' states; a recurrent layer reads each through
        `sequence_rows`."""
        raise RecurrentStateError("a batched forward holds one recurrent state per sequence: read them per "
                                  "sequence (attention.sequence_rows)")

    set_recurrent_state = recurrent_state

    def last_rows(self) -> list[int]:
        """The row of each sequence's last new token (the one whose logits pick its next token)."""
        return [b - 1 for b in self.bounds[1:]]

    def commit(self) -> None:
        for seq, n, states in zip(self.seqs, self.counts, self._pending_states, strict=True):
            self.cache.commit(seq, n)
            seq.recurrent.update(states)


def sequence_rows(ctx, rows: int) -> list[tuple[int, int, object]]:
    """(first row, end row, context) of each sequence among a forward's `rows`: a recurrent layer updates each
    sequence's state from its own rows. One entry (the whole forward, `ctx` itself) unless `ctx` batches several
    sequences."""
    return ctx.sequences() if isinstance(ctx, BatchAttention) else [(0, rows, ctx)]


_ONE_TOKEN_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def write_decode_kv(cache: PagedKVCache, layer: int, slots: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Writes each new token's K/V [N, Hkv, D] to its slot of the layer's pools (once where the values are the
    keys: one pool) and returns the pools (k_pool, v_pool)."""
    k_pool, v_pool = cache.k[layer], cache.v[layer]
    k_pool.index_copy_(0, slots, k.to(k_pool.dtype))
    if v_pool is not k_pool:
        v_pool.index_copy_(0, slots, v.to(v_pool.dtype))
    return k_pool, v_pool


def paged_kernel_for(path: str, cache: PagedKVCache, window: int, q: torch.Tensor, batch: int = 1):
    """The paged split-KV kernel (kernels/paged_decode) for a static window of `batch` rows where GPU path `path` is
    on and the device and shape allow it, else None. Built before capture (its buffers need fixed addresses)."""
    from freetoken.kernels.paged_decode import kernel as paged

    heads, kv_heads, head_dim = q.shape[1], cache.n_kv_heads, q.shape[2]
    if gpu_paths.enabled(path) and paged.available(q.device) and paged.supports(heads, kv_heads, head_dim):
        return paged.PagedDecodeAttention(window, heads, kv_heads, head_dim, q.device, q.dtype, batch=batch)
    return None


def decode_rows_attention(cache: PagedKVCache, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          write: torch.Tensor, read: torch.Tensor, positions: torch.Tensor,
                          rows: slice | torch.Tensor, sinks: torch.Tensor | None = None, window: int | None = None,
                          select: KeySelection | None = None) -> torch.Tensor:
    """One new token per sequence: q [B, H, D] (the forward's `rows`) over each sequence's keys → [B, H, D]. Row i
    writes its K/V to slot write[i] and reads the slots read[i, :positions[i] + 1] (the rest of the row is padding).
    `window`: each token sees its last `window` positions; `sinks` [H]: a virtual key per head whose logit is
    the sink and whose value is 0 (as in `sink_attention`); `select`: the keys it picks per row."""
    last = positions[:, None]
    k_pool, v_pool = write_decode_kv(cache, layer, write, k, v)
    b, w = read.shape
    valid = torch.arange(w, device=read.device)[None, :] <= last  # slot j of a row holds position j
    keys = k_pool.index_select(0, read.reshape(-1)).to(q.dtype).view(b, w, *k.shape[1:])
    values = keys if v_pool is k_pool else v_pool.index_select(0, read.reshape(-1)).to(q.dtype).view(b, w, *v.shape[1:])
    h, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    mask = valid
    if window is not None:
        mask = mask & (torch.arange(w, device=valid.device)[None, :] > last - window)
    if select is not None:  # each row one query: [B, 1, W]
        mask = select.visible(rows, keys, mask[:, None, :])[:, 0]
    if sinks is not None:  # the virtual key first: a coordinate sink·√D in q, 1 in the key, 0 in the value
        pad = (-(d + 1)) % 8
        q = torch.cat((q, (sinks.to(q.dtype) * d ** 0.5)[None, :, None].expand(b, h, 1), q.new_zeros(b, h, pad)),
                      dim=-1)
        sink_key = keys.new_zeros(b, 1, hkv, d + 1 + pad)
        sink_key[..., d] = 1
        keys = torch.cat((sink_key, torch.cat((keys, keys.new_zeros(b, w, hkv, 1 + pad)), dim=-1)), dim=1)
        values = torch.cat((values.new_zeros(b, 1, hkv, values.shape[-1]), values), dim=1)
        mask = torch.cat((mask.new_ones(b, 1), mask), dim=1)
    qg = q.reshape(b, hkv, h // hkv, q.shape[2])  # a KV head's query heads as its G query rows
    with sdpa_kernel(_ONE_TOKEN_BACKENDS):  # not cuDNN for one token (see causal_attention)
        out = F.scaled_dot_product_attention(qg, keys.transpose(1, 2), values.transpose(1, 2),
                                             attn_mask=mask[:, None, None, :], scale=d ** -0.5)
    return out.reshape(b, h, -1)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int,
                     sinks: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """q [T, H, D] at positions past..past+T-1; k, v [past + T, Hkv, D] → [T, H, D]. `sinks` [H], `window`:
    see `SequenceAttention.attend`.

    Inputs go to SDPA as 4-D [1, heads, tokens, D]: its fused kernels (flash, memory-efficient) take only 4-D
    inputs, and the math fallback materialises [H, T, L + T] scores (32 GB for a 16k-token chunk)."""
    if sinks is not None or window is not None:
        return _masked_attention(q, k, v, past, sinks, window)
    t = q.shape[0]
    qh, kh, vh = (x.transpose(0, 1)[None] for x in (q, k, v))  # [1, heads, tokens, D]
    if t == 1:
        # Not cuDNN for one token: it builds an execution plan for each new key length, ~0.5–1.3 ms of host time a
        # call on the H200, and a batched decode step calls it per sequence and layer with lengths that grow every
        # step (the ~100 ms step of evals/results/serve-q3-8l-h200.md).
        with sdpa_kernel(_ONE_TOKEN_BACKENDS):
            out = F.scaled_dot_product_attention(qh, kh, vh, enable_gqa=True)
    elif past == 0:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
    else:  # a later chunk: causal aligned to the last key (lower right), which the fused kernels take as a bias
        group = qh.shape[1] // kh.shape[1]
        kh, vh = kh.repeat_interleave(group, dim=1), vh.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=causal_lower_right(t, past + t))
    return out[0].transpose(0, 1)


SINK_QUERY_ROWS = 2048  # queries per SDPA call with an explicit mask: bounds the [rows, L] mask of a long chunk


class KeySelection(Protocol):
    """Sparse attention's choice of keys (DeepSeek Sparse Attention's indexer): which of the visible cached keys
    each query attends to."""

    heads: int  # scores per query and key (the indexer's heads): bounds how many queries are scored at once

    def visible(self, rows: slice | torch.Tensor, keys: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """`rows`: the queries' rows in the forward; `keys` [..., L, Hkv, D]: the cached key rows they may see
        (with a leading batch dimension in a batched decode step), `visible` [..., T, L] bool: the keys each
        query may see (causal, padding) → the subset it attends to, same shape."""
        ...


# Scores a selection holds at once ([rows, indexer heads, keys] in fp32): bounds a long chunk's query blocks.
SELECTION_SCORES = 1 << 26


def selected_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int, select: KeySelection,
                       first_row: int, sinks: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """`causal_attention` where each query attends only to the keys `select` picks among its visible ones (within
    its `window`, with `sinks`: as in `SequenceAttention.attend`); q [T, H, D] are the forward's rows
    first_row.. at positions past..; queries in blocks that bound the selection's scores."""
    return _masked_attention(q, k, v, past, sinks, window, (select, first_row))


def _masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int, sinks: torch.Tensor | None,
                      window: int | None, select: tuple[KeySelection, int] | None = None) -> torch.Tensor:
    """`causal_attention` with attention sinks, a sliding window and/or a key selection (with the forward's row
    of q's first query): an explicit mask, queries in blocks (smaller where a selection scores every key)."""
    t, n = q.shape[0], k.shape[0]
    key_pos = torch.arange(n, device=q.device)
    block = SINK_QUERY_ROWS if select is None else \
        max(1, min(SINK_QUERY_ROWS, SELECTION_SCORES // (n * select[0].heads)))
    outs = []
    for lo in range(0, t, block):
        hi = min(t, lo + block)
        query_pos = torch.arange(past + lo, past + hi, device=q.device)[:, None]
        visible = key_pos[None, :] <= query_pos
        if window is not None:
            visible &= key_pos[None, :] > query_pos - window
        if select is not None:
            visible = select[0].visible(slice(select[1] + lo, select[1] + hi), k, visible)
        # keys no query of the block sees are left out (a window's old keys): less work, same result
        first = 0 if window is None else max(0, past + lo - window + 1)
        outs.append(sink_attention(q[lo:hi], k[first:past + hi], v[first:past + hi], visible[:, first:past + hi],
                                   sinks))
    return torch.cat(outs)


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                   sinks: torch.Tensor | None) -> torch.Tensor:
    """q [T, H, D] over k, v [L, Hkv, D] where `visible` [T, L] (bool) allows → [T, H, D]; with `sinks` [H] each
    head's softmax also counts exp(sink) in its denominator (gpt-oss), i.e. a virtual key of logit `sink` and
    value 0. SDPA takes that key as one more key: the queries gain a coordinate sink·√D (padded to a multiple of
    8 dimensions, which the fused kernels want), the keys a coordinate 0 and the virtual key 1, so its logit is
    exactly the sink at the unchanged scale 1/√D. Every query sees it."""
    t, h, d = q.shape
    hkv = k.shape[1]
    scale = d ** -0.5
    mask = visible
    if sinks is not None:
        pad = (-(d + 1)) % 8
        column = (sinks.to(q.dtype) / scale)[None, :, None].expand(t, h, 1)
        q = torch.cat((q, column, q.new_zeros(t, h, pad)), dim=-1)
        sink_key = k.new_zeros(1, hkv, d + 1 + pad)
        sink_key[..., d] = 1
        k = torch.cat((sink_key, torch.cat((k, k.new_zeros(k.shape[0], hkv, 1 + pad)), dim=-1)))
        v = torch.cat((v.new_zeros(1, hkv, v.shape[-1]), v))
        mask = torch.cat((visible.new_ones(t, 1), visible), dim=1)
    qh, kh, vh = (x.transpose(0, 1)[None] for x in (q, k, v))  # [1, heads, tokens, D']
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask[None, None], scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


class StaticDecodeAttention:
    """One decode token attending over a fixed window of W slots; slots past the sequence are masked out.

    `prepare(seq)` fills the buffers on the host side before each replay; nothing inside `attend` depends on
    Python values, so it is safe to capture. Layers with recurrent state read and write it in static buffers
    too: `prepare` copies the sequence's state in, the step overwrites the buffers in place (`copy_`, captured
    like any kernel), `commit_state` hands the new state back to the sequence."""

    def __init__(self, cache: PagedKVCache, window: int):
        device = cache.device
        self.cache, self.window = cache, window
        self.positions = torch.zeros(1, dtype=torch.long, device=device)
        self.write_slot = torch.zeros(1, dtype=torch.long, device=device)
        self.read_slots = torch.zeros(window, dtype=torch.long, device=device)
        self.key_positions = torch.arange(window, device=device)
        self._paged, self._paged_checked = None, False
        self.gathered = False  # whether a layer's attention gathered its keys (set while the step is captured)
        self._state: dict[int, tuple[torch.Tensor, ...]] = {}  # layer → static recurrent-state buffers

    def recurrent_state(self, layer: int) -> tuple[torch.Tensor, ...] | None:
        return self._state.get(layer)

    def set_recurrent_state(self, layer: int, state: tuple[torch.Tensor, ...]) -> None:
        held = self._state.get(layer)
        if held is None:  # a sequence without state yet (warm-up only: decode follows a prefill)
            self._state[layer] = tuple(t.clone() for t in state)
            return
        for buffer, new in zip(held, state, strict=True):
            buffer.copy_(new)

    def commit_state(self, seq: SequenceKV) -> None:
        """After a step: the sequence takes the new state (copies: the buffers serve the next sequence too)."""
        for layer, buffers in self._state.items():
            seq.recurrent[layer] = tuple(b.clone() for b in buffers)

    def _paged_kernel(self, q: torch.Tensor):
        """The paged split-KV kernel for this window (GPU path "paged-decode", CUDA with Triton), built on the
        first call: graph warm-ups run before capture, so its buffers exist before any replay reads them."""
        if not self._paged_checked:
            self._paged_checked = True
            self._paged = paged_kernel_for("paged-decode", self.cache, self.window, q)
        return self._paged

    @property
    def reads_in_place(self) -> bool:
        """Whether every layer's attention of the captured step ran the paged kernel: its cost then follows the
        sequence, not the window (cuda_graphs.py captures such a step once, over the cache's capacity)."""
        return self._paged is not None and not self.gathered

    def prepare(self, seq: SequenceKV) -> None:
        """Points the buffers at token `seq.length` (its slot must already be reserved)."""
        n = seq.length
        if n + 1 > self.window:
            raise ValueError(f"position {n} is outside this decode window of {self.window} slots")
        self.positions.fill_(n)
        self.write_slot.copy_(seq.slots[n:n + 1])
        self.read_slots[:n + 1].copy_(seq.slots[:n + 1])
        for layer, state in seq.recurrent.items():
            if layer in self._state:
                for buffer, value in zip(self._state[layer], state, strict=True):
                    buffer.copy_(value)
            else:  # first use: the buffers are allocated here, before any capture
                self._state[layer] = tuple(t.clone() for t in state)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
               sinks: torch.Tensor | None = None, window: int | None = None,
               select: KeySelection | None = None) -> torch.Tensor:
        k_pool, v_pool = write_decode_kv(self.cache, layer, self.write_slot, k, v)
        plain = sinks is None and window is None and select is None
        paged = self._paged_kernel(q) if plain else None
        if paged is not None:  # reads the window's rows in place (no gather), the window split across the SMs
            return paged(q, k_pool, v_pool, self.read_slots, self.positions)
        self.gathered = True
        keys = k_pool.index_select(0, self.read_slots).to(q.dtype)  # [W, Hkv, D]
        values = keys if v_pool is k_pool else v_pool.index_select(0, self.read_slots).to(q.dtype)
        valid = self.key_positions <= self.positions
        if plain:
            return static_decode_attention(q, keys, values, valid)
        if window is not None:
            valid = valid & (self.key_positions > self.positions - window)
        visible = valid[None, :] if select is None else select.visible(slice(None), keys, valid[None, :])
        return sink_attention(q, keys, values, visible, sinks)


class StaticBatchAttention:
    """One decode token for each of up to B sequences over a fixed window of W slots: `StaticDecodeAttention` for a
    continuous-batching step, captured per (B, W) (cuda_graphs.py). Rows past the step's sequences are padding: they
    write to and read from one scratch slot the caller lends (a page nobody else holds), so the real rows' keys are
    never touched and every tensor keeps its shape. Models with recurrent layers are not batched (BatchAttention)."""

    def __init__(self, cache: PagedKVCache, batch: int, window: int):
        device = cache.device
        self.cache, self.batch, self.window = cache, batch, window
        self.positions = torch.zeros(batch, dtype=torch.long, device=device)
        self.write_slots = torch.zeros(batch, dtype=torch.long, device=device)
        self.read_slots = torch.zeros(batch, window, dtype=torch.long, device=device)
        self._paged, self._paged_checked = None, False

    def _paged_kernel(self, q: torch.Tensor):
        """The paged split-KV kernel over every row at once (GPU path "batch-paged-decode": reads each row's keys
        in place where `decode_rows_attention` gathers B × W of them), built on the first call."""
        if not self._paged_checked:
            self._paged_checked = True
            self._paged = paged_kernel_for("batch-paged-decode", self.cache, self.window, q, self.batch)
        return self._paged

    def prepare(self, seqs: list[SequenceKV], scratch_slot: int) -> None:
        """Points row i at token `seqs[i].length` (its slot reserved), the rows after them at `scratch_slot`."""
        n = len(seqs)
        if n > self.batch or max(s.length for s in seqs) + 1 > self.window:
            raise ValueError(f"{n} sequences up to {max(s.length for s in seqs)} tokens do not fit this step of "
                             f"{self.batch} rows of {self.window} slots")
        host = torch.tensor([s.length for s in seqs] + [0] * (self.batch - n), dtype=torch.long)
        self.positions.copy_(host.pin_memory() if self.positions.is_cuda else host, non_blocking=True)
        pad = [torch.full((self.batch - n,), scratch_slot, dtype=torch.long, device=self.write_slots.device)]
        self.write_slots.copy_(torch.cat([s.slots[s.length:s.length + 1] for s in seqs] + pad))
        for i, s in enumerate(seqs):
            self.read_slots[i, :s.length + 1].copy_(s.slots[:s.length + 1])
        if n < self.batch:
            self.read_slots[n:, 0] = scratch_slot  # a padding row sees its own slot only

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
               sinks: torch.Tensor | None = None, window: int | None = None,
               select: KeySelection | None = None) -> torch.Tensor:
        paged = self._paged_kernel(q) if sinks is None and window is None and select is None else None
        if paged is not None:
            k_pool, v_pool = write_decode_kv(self.cache, layer, self.write_slots, k, v)
            return paged(q, k_pool, v_pool, self.read_slots, self.positions)
        return decode_rows_attention(self.cache, layer, q, k, v, self.write_slots, self.read_slots, self.positions,
                                     slice(None), sinks, window, select)

    def recurrent_state(self, layer: int):
        raise RecurrentStateError("a captured batched step holds no recurrent state: several sequences of a model "
                                  "with recurrent layers step eagerly (BatchAttention)")

    set_recurrent_state = recurrent_state


def static_decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                            valid: torch.Tensor) -> torch.Tensor:
    """q [1, H, D] of one token over keys, values [W, Hkv, D], `valid` [W] bool → [1, H, D].

    The query heads that share a KV head are one position, so they attend as that KV head's G = H / Hkv query
    rows: SDPA gets 4-D [1, Hkv, G, D] queries and the keys unexpanded. The 3-D, `enable_gqa` form it replaces ran
    the math fallback (expanding K and V G-fold and materialising the scores): ~0.6 ms per layer at 16k keys."""
    _, h, d = q.shape
    hkv = keys.shape[1]
    qg = q.reshape(1, hkv, h // hkv, d)
    kh, vh = keys.permute(1, 0, 2)[None], values.permute(1, 0, 2)[None]  # [1, Hkv, W, D]
    out = F.scaled_dot_product_attention(qg, kh, vh, attn_mask=valid[None, None, None, :])
    return out.reshape(1, h, d)
