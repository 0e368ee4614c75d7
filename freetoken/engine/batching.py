"""Continuous batching: the requests in flight share every forward.

Each step runs one forward over the next token of every sequence that is decoding plus, interleaved, at most
`prefill_chunk` tokens of the prompts still being prefilled, so a long prompt never stalls the streams already
talking. Those tokens go to the prompts with the fewest tokens left first, several chunks packed into one step:
a short request that arrives beside a long one (an agent's title request beside its first turn) is answered
after one step, not after the whole long prefill, and the long prompt takes the rest of each step's tokens.
Requests join and leave between steps. All sequences live in one paged KV cache; a finished or cancelled
sequence returns its pages at once, except its full pages, which the prefix cache keeps (until the pool needs
them) so a later prompt that starts with the same tokens, an agent's next turn, reuses their K/V.
Models with recurrent layers (Qwen3-Next, Qwen3.5-MoE, DeepSeek-V4) batch too, their recurrent layers updating
each sequence's state from its own rows, and reuse whole-sequence snapshots instead of shared pages
(state_snapshots.py: each prompt's end, each finished request, and the last few message and block ends inside a
prompt, so that an agent editing its recent history recomputes from the boundary before the edit).
On CUDA a step of decode tokens only replays a CUDA graph: the single-sequence path's for one sequence, a batched
step's for several (cuda_graphs.py; GPU path "batch-graphs"; the KV pool is then allocated at full size up front,
as the graphs need; several sequences of a recurrent model step eagerly); a step with prefill chunks runs eagerly
through `LoadedModel.forward_batch`.
With `speculative` (a model with a multi-token-prediction layer: speculative.py) every decoding request brings its
sampled token and its draft to the step (two rows; two tokens out where the draft is picked), prefill chunks
fill their MTP rows, and each request's MTP layer runs after the step. All steps are eager then (no CUDA graphs
yet).

Shapes: B sequences in a step, V vocabulary.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from freetoken.engine import gpu_paths
from freetoken.engine.generator import GenerationEvent, Reply, run_settings
from freetoken.engine.kv_cache import SequenceKV
from freetoken.engine.loader import LoadedModel
from freetoken.engine.prefix_cache import PrefixCache
from freetoken.engine.sampling import SamplingParams
from freetoken.engine.speculative import Drafting, speculator_for
from freetoken.engine.state_snapshots import StateSnapshots
from freetoken.errors import FreeTokenError


class KVCacheFull(FreeTokenError):
    """The shared KV cache cannot hold one more token for this request."""


@dataclass(eq=False)
class BatchRequest:
    """One generation in the batch. `emit` receives its events (or the exception that ended it); `cancelled`
    is polled between steps."""

    prompt_ids: list[int]
    params: SamplingParams
    emit: Callable[[GenerationEvent | BaseException], None]
    cancelled: Callable[[], bool] = lambda: False
    seq: SequenceKV | None = None
    reply: Reply | None = None
    prefilled: int = 0  # prompt tokens in the cache
    cached: int = 0  # of those, taken from the prefix cache
    next_token: int | None = None  # sampled, not yet in the cache
    fed: list[int] = field(default_factory=list)  # generated tokens written to the cache
    steps: list[int] = field(default_factory=list)  # batch sizes of the forwards this request took part in
    boundaries: list[int] = field(default_factory=list)  # recurrent models: prompt offsets to snapshot at
    drafting: Drafting = field(default_factory=Drafting)  # speculative decoding's state (unused without it)

    @property
    def decoding(self) -> bool:
        return self.next_token is not None


class BatchScheduler:
    def __init__(self, lm: LoadedModel, *, max_batch: int = 16, prefill_chunk: int | None = None,
                 max_seq_len: int | None = None, kv_tokens: int | None = None, page_size: int = 16,
                 cuda_graphs: bool | None = None, prefix_cache: bool = True, speculative: bool = False):
        """`max_seq_len`: tokens one request may hold (default: the model's context); `kv_tokens`: tokens all
        requests hold together (default: unbounded on the CPU, where the pool grows; on CUDA the pool is
        allocated up front, `max_seq_len` tokens by default). `prefix_cache`: keep finished requests' full
        pages for later prompts with the same start. `speculative`: see the module docstring."""
        self.lm, self.max_batch = lm, max_batch
        self.speculator = speculator_for(lm) if speculative else None
        if speculative:
            cuda_graphs = False
        self.prefill_chunk, self.use_graphs, self.capacity = run_settings(lm, prefill_chunk, max_seq_len, cuda_graphs)
        self.request_limit = self.capacity  # tokens one request may hold, whatever the pool
        if self.use_graphs:
            pool = kv_tokens or self.capacity
            self.cache = lm.new_cache(page_size, initial_tokens=pool, max_tokens=pool)
            self.capacity = min(self.capacity, pool)
        else:
            initial = min(self.capacity, 1024, kv_tokens or self.capacity)  # never past the pool's bound
            self.cache = lm.new_cache(page_size, initial_tokens=initial, max_tokens=kv_tokens)
        self._graphs = None
        self._held: list[tuple[BatchRequest, GenerationEvent]] = []  # events emitted after the next launch
        self.active: list[BatchRequest] = []
        self.forwards = 0
        self.prefix = self.snapshots = None
        if lm.has_recurrent_state:  # its state is per sequence: reused from whole snapshots, not shared pages
            if prefix_cache:
                self.snapshots = StateSnapshots(self.cache)
                self.cache.reclaim = self.snapshots.evict
                tok = lm.tokenizer
                self._boundary_ids = tok.eos_token_ids | tok.block_end_ids()
        elif prefix_cache:
            # a growing pool (CPU) would grow for cached pages too: their count is capped at two full contexts
            cap = None if self.cache.max_pages is not None else 2 * -(-self.capacity // page_size)
            allocator = self.cache.allocator
            self.prefix = PrefixCache(page_size, allocator.retain, allocator.free, max_pages=cap)
            self.cache.reclaim = self.prefix.evict
            self.cache.remap_hooks.append(self.prefix.renumber)

    def resize_kv(self, tokens: int) -> dict[str, int]:
        """Between steps: the KV pool to `tokens` (whole pages) without dropping a request; cached prefixes go
        first when it shrinks. A request then holds at most the lesser of its limit and the pool."""
        info = self.cache.resize(-(-tokens // self.cache.page_size))
        self.capacity = min(self.request_limit, info["tokens"])
        return info

    def has_room(self) -> bool:
        return len(self.active) < self.max_batch

    def add(self, req: BatchRequest) -> None:
        """Starts a request (it is prefilled over the next steps). Its prompt must fit `capacity`."""
        if not req.prompt_ids:
            raise FreeTokenError("the prompt is empty; give at least one token")
        if len(req.prompt_ids) >= self.capacity:
            raise FreeTokenError(f"the prompt has {len(req.prompt_ids)} tokens; at most {self.capacity - 1} fit")
        budget = min(req.params.max_tokens, self.capacity - len(req.prompt_ids))
        req.reply = Reply(self.lm, len(req.prompt_ids), req.params, budget)
        req.seq = self.snapshots.start(req.prompt_ids) if self.snapshots is not None else None
        if req.seq is not None:
            req.prefilled = req.cached = req.reply.cached_tokens = req.seq.length
        else:
            req.seq = self.cache.new_sequence()
        if self.prefix is not None:
            shared = self.prefix.match(req.prompt_ids)
            if shared:
                self.cache.adopt(req.seq, shared)
                req.prefilled = req.cached = req.reply.cached_tokens = req.seq.length
        if self.snapshots is not None:
            req.boundaries = self._boundaries(req.prompt_ids, req.prefilled)
        self.active.append(req)

    BOUNDARY_SNAPSHOTS = 3  # message and block ends snapshotted per prompt, the last ones (edits come late)

    def _boundaries(self, prompt: list[int], done: int) -> list[int]:
        """Offsets just past the prompt's last few end-of-turn and block-closing tokens (`</think>`,
        `</tool_call>`, ...) beyond `done` and before its end (which is snapshotted anyway)."""
        ends = self._boundary_ids
        found = [i + 1 for i in range(done, len(prompt) - 2) if prompt[i] in ends]
        return found[-self.BOUNDARY_SNAPSHOTS:]

    @torch.inference_mode()
    def step(self) -> list[BatchRequest]:
        """One forward for the batch: every decoding request's next token plus the step's prefill chunks.
        Returns the requests dropped because they were cancelled (their pages are free again)."""
        dropped = self._step()
        if not self.active:
            self._flush()  # no next step to hand them out after
        return dropped

    def _step(self) -> list[BatchRequest]:
        dropped = [r for r in self.active if r.cancelled()]
        for req in dropped:
            self._finish(req)
        decoding = [r for r in self.active if r.decoding]
        # fewest prompt tokens left first (sorted is stable: arrival order among equals)
        prefilling = sorted((r for r in self.active if not r.decoding), key=lambda r: len(r.prompt_ids) - r.prefilled)
        if not decoding and not prefilling:
            return dropped
        if self.speculator is not None:
            self._speculative_step(decoding, prefilling)
            return dropped
        batch, tokens, counts = self._plan(decoding, prefilling, lambda r: [r.next_token])
        hold = self._holds(batch, tokens)
        if not hold:
            self._flush()
        try:
            self._make_room(batch, counts)
        except KVCacheFull:
            return dropped  # _make_room ended the newest request; the others go on next step
        logits = self._forward(batch, tokens, counts)
        self.forwards += 1
        self._flush()  # (held: the last step's events go out while this step's queued GPU work runs)
        for i, (req, n) in enumerate(zip(batch, counts, strict=True)):
            req.steps.append(len(batch))
            if not req.decoding and not self._prefilled(req, n):
                continue  # more prompt to go: these logits pick nothing
            try:
                ev = req.reply.accept(logits[i])
            except Exception as e:  # noqa: BLE001 - one request's sampling failure ends that request only
                req.emit(e)
                self._finish(req)
                continue
            self._deliver(req, ev, hold)
        return dropped

    def _plan(self, decoding: list[BatchRequest], prefilling: list[BatchRequest],
              decode_rows: Callable[[BatchRequest], list[int]]) -> tuple[list[BatchRequest], list[int], list[int]]:
        """A step's requests, tokens and token counts: each decoding request's rows, then prefill chunks (the
        fewest prompt tokens left first) up to `prefill_chunk` tokens in all."""
        batch, tokens, counts = [], [], []
        for r in decoding:
            rows = decode_rows(r)
            batch.append(r)
            tokens += rows
            counts.append(len(rows))
        room = self.prefill_chunk
        for r in prefilling:
            if room <= 0:
                break
            chunk = self._next_chunk(r, room)
            batch.append(r)
            tokens += chunk
            counts.append(len(chunk))
            room -= len(chunk)
        return batch, tokens, counts

    def _next_chunk(self, req: BatchRequest, room: int) -> list[int]:
        """The request's next prompt tokens, at most `room`; a chunk stops at a boundary (the state after it is
        snapshotted)."""
        end = req.prefilled + room
        if req.boundaries and req.prefilled < req.boundaries[0] < end:
            end = req.boundaries[0]
        return req.prompt_ids[req.prefilled:end]

    def _prefilled(self, req: BatchRequest, n: int) -> bool:
        """`n` more prompt tokens are in the cache (snapshotted at a boundary or the prompt's end); whether the
        prompt is complete."""
        req.prefilled += n
        if req.boundaries and req.prefilled == req.boundaries[0]:
            req.boundaries.pop(0)
            self.snapshots.snapshot(req.prompt_ids, req.seq)
        if req.prefilled < len(req.prompt_ids):
            return False
        if self.snapshots is not None:
            self.snapshots.snapshot(req.prompt_ids, req.seq)
        req.reply.prefilled()
        return True

    def _deliver(self, req: BatchRequest, ev: GenerationEvent, hold: bool = False) -> None:
        """Hands `ev` to the request (held until the next launch with `hold`); ends it, or notes its token."""
        if hold:
            self._held.append((req, ev))
        else:
            req.emit(ev)
        if ev.finish_reason is not None:
            self._finish(req, reuse=True)
        else:
            req.next_token = ev.token_ids[0]
            req.fed.append(req.next_token)  # written to the cache by the next step

    def _speculative_step(self, decoding: list[BatchRequest], prefilling: list[BatchRequest]) -> None:
        """A step with speculative decoding: each decoding request's sampled token and draft (one row, or two),
        then prefill chunks, in one forward; then per request the checks, events and MTP rows (speculative.py)."""
        spec, cache = self.speculator, self.cache
        for r in decoding:
            spec.ready(r.drafting, r.next_token, cache, r.seq)
        batch, ids, counts = self._plan(decoding, prefilling, lambda r: [r.next_token] if r.drafting.draft is None
                                        else [r.next_token, r.drafting.draft])
        try:
            self._make_room(batch, counts)
        except KVCacheFull:
            return
        starts, befores = [r.seq.length for r in batch], [dict(r.seq.recurrent) for r in batch]
        firsts = [0, *itertools.accumulate(counts)][:-1]  # each request's first row
        decodes = [r.decoding for r in batch]
        # logits of a decoding request's rows (its token and draft), of a prefill chunk's last row
        rows = [i for lo, n, d in zip(firsts, counts, decodes, strict=True)
                for i in (range(lo, lo + n) if d else [lo + n - 1])]
        tokens = torch.tensor(ids, dtype=torch.long, device=self.lm.device)
        logits, hidden = self.lm.forward_batch_hidden(tokens, cache, [r.seq for r in batch], counts, rows)
        self.forwards += 1
        at = 0
        for r, lo, n, decode, start, before in zip(batch, firsts, counts, decodes, starts, befores, strict=True):
            r.steps.append(len(batch))
            picked = logits[at:at + (n if decode else 1)]
            at += n if decode else 1
            if decode:
                events = spec.checked(r.drafting, r.next_token, picked, hidden[lo:lo + n], start, before, cache,
                                      r.seq, r.reply.accept)
            else:
                spec.prefilled(r.drafting, tokens[lo:lo + n], hidden[lo:lo + n], start, cache, r.seq)
                if not self._prefilled(r, n):
                    continue
                events = (r.reply.accept(row) for row in picked)
            try:
                for ev in events:
                    self._deliver(r, ev)
            except Exception as e:  # noqa: BLE001 - one request's sampling failure ends that request only
                r.emit(e)
                if r in self.active:
                    self._finish(r)

    def _holds(self, batch: list[BatchRequest], tokens: list[int]) -> bool:
        """Whether this step's events wait for the next step's launch (GPU path "emit-after-launch"): a decode step
        replayed whole from a CUDA graph, whose launch returns at once. Emitting wakes the server's event loop,
        whose per-token work (SSE framing, the socket) would otherwise hold the GIL while this thread prepares
        and launches the next step; after the launch it overlaps the GPU's work on that step."""
        return (self._graphed(batch, tokens) and getattr(self.lm.experts, "capturable", True)
                and gpu_paths.enabled("emit-after-launch"))

    def _graphed(self, batch: list[BatchRequest], tokens: list[int]) -> bool:
        """Whether this step replays CUDA graphs: decode tokens only, and one sequence where layers keep recurrent
        state (a batched step's states are per sequence, which no captured batch holds: those steps run eagerly)."""
        return self.use_graphs and len(tokens) == len(batch) and (len(batch) == 1 or not self.lm.has_recurrent_state)

    def _flush(self) -> None:
        held, self._held = self._held, []
        for req, ev in held:
            req.emit(ev)

    def _forward(self, batch: list[BatchRequest], tokens: list[int], counts: list[int]) -> torch.Tensor:
        if self._graphed(batch, tokens):  # decode tokens only: a captured step
            if self._graphs is None:
                from freetoken.engine.cuda_graphs import GraphedDecoder

                self._graphs = GraphedDecoder(self.lm, self.cache)
            if len(batch) == 1:
                return self._graphs.step(batch[0].seq, tokens[0])[None]
            if gpu_paths.enabled("batch-graphs"):
                logits = self._graphs.step_batch([r.seq for r in batch], tokens)
                if logits is not None:
                    return logits
        ids = torch.tensor(tokens, dtype=torch.long, device=self.lm.device)
        if len(batch) == 1:
            return self.lm.forward(ids, self.cache, batch[0].seq, "last")
        return self.lm.forward_batch(ids, self.cache, [r.seq for r in batch], counts)

    def _make_room(self, batch: list[BatchRequest], counts: list[int]) -> None:
        """Ends the newest request with KVCacheFull if the step's tokens do not fit the pool."""
        cache = self.cache
        if cache.max_pages is None:  # the pool grows as needed
            return
        need = sum(max(0, -(-(r.seq.length + n) // cache.page_size) - len(r.seq.pages))
                   for r, n in zip(batch, counts, strict=True))
        free = cache.free_pages(need)  # the prefix cache gives back what it can first
        if cache.max_pages is not None:
            free += max(0, cache.max_pages - cache.allocator.num_pages)
        if need <= free:
            return
        victim = self.active[-1]
        self._flush()  # its earlier tokens first
        victim.emit(KVCacheFull(f"the KV cache is full ({len(self.active)} requests hold it); retry later or "
                                "serve with a larger --kv-cache"))
        self._finish(victim)
        raise KVCacheFull("step skipped")

    def _finish(self, req: BatchRequest, reuse: bool = False) -> None:
        """Ends `req`: its pages go back, but for what later prompts may reuse (the prefix cache's full pages;
        with `reuse`, a request that ended normally, the whole sequence as a snapshot of a recurrent model)."""
        self.active.remove(req)
        seq = req.seq
        if self.prefix is not None and seq.length:
            # the cache holds the prompt and the generated tokens fed back so far (the last sampled one was
            # never fed); a later turn that resends this reply in its history reuses it too
            self.prefix.insert((req.prompt_ids + req.fed)[:seq.length], seq.pages)
        if self.snapshots is not None and reuse and seq.length:
            self.snapshots.keep(req.prompt_ids + req.fed, seq)  # prompt and reply as fed
            return
        self.cache.release(seq)

    def abort_all(self, error: BaseException) -> None:
        self._flush()
        for req in list(self.active):
            req.emit(error)
            self._finish(req)
