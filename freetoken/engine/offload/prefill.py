"""The prefill path of `OffloadedExpertExecutor` (any batch too large to gather): experts one by one, copies
pipelined against compute, and (`prefill_ahead`) the next layer's experts streamed while this layer computes and
the next one runs its attention, so the link never waits for a layer's routing.

A mixin over the executor's state (cache, copier, slots, planner, routers): the decode path and the graph
boundaries live in executor.py, this file owns how a long chunk streams the experts it routes to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from freetoken.engine import experts, gpu_paths
from freetoken.engine.experts import (
    PADDED_GROUP_BYTES,
    PADDED_MAX_TOKENS,
    ExpertGroup,
    expert_mlp,
    group_by_expert,
    grouped_mm_available,
    host_ints_to,
    run_groups_padded,
    sorted_expert_forward,
)
from freetoken.engine.offload.planner import MissPlanner


@dataclass(slots=True)
class _Ahead:
    """An expert of the next layer copied while this layer computed: where it lands and when."""

    slot: int  # absolute slot (a staging slot, or a free cache slot it was admitted into)
    ring: int | None  # its staging ring index (released once computed), None for a cache slot
    done: object  # what `copier.wait` needs before computing from it


@dataclass(slots=True)
class _ChunkAhead:
    """A layer's experts streamed before it routes: by the layer before it, or (a chunk's first) by itself."""

    layer: int
    experts: dict[int, _Ahead]
    done: object  # what `copier.wait` needs before computing from any of them: the last batch's mark
    complete: bool  # every expert the cache lacked is among them or left to the CPU: nothing else to copy


class PrefillPath:
    # A miss with more tokens than this is a large matrix product: the GPU's, whatever the link costs. Below it
    # (a short chunk: an agent's next turn, an edit's suffix) the CPU's tiles can take part of a layer's misses
    # while the link streams the rest; the prefill planner learns what that costs here.
    CPU_MAX_TOKENS = 128
    # A batch of at least this many tokens is a prefill chunk: it fills free cache slots but evicts nothing
    PREFILL_TOKENS = 64
    PREFILL_PROBE_EVERY = 8  # a prefill is a few hundred layer-steps: re-probe an unused path sooner than decode
    # A chunk whose experts have at most PADDED_MAX_TOKENS tokens each computes them in padded groups of up to
    # PADDED_GROUP experts (and PADDED_GROUP_BYTES of gathered weights): its cost is the host's launches.
    PADDED_MAX_TOKENS = PADDED_MAX_TOKENS
    PADDED_GROUP = 8
    PADDED_GROUP_BYTES = PADDED_GROUP_BYTES
    # Layer-ahead streaming needs no prediction once a chunk averages this many tokens per expert: its next layer
    # then routes to (nearly) every expert, so all those the cache lacks are copied.
    AHEAD_TOKENS_PER_EXPERT = 8
    AHEAD_BATCH = 8  # experts a batch of copies streamed ahead holds (one event, one dequantizing launch)
    # GPU path "ahead-wide": up to this many experts a batch, within AHEAD_WIDE_BYTES of block bytes (a batch of
    # block-format experts lands in device rows of that size first)
    AHEAD_WIDE = 32
    AHEAD_WIDE_BYTES = 256 << 20

    def _forward_grouped(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
                         topk_weights: torch.Tensor) -> torch.Tensor:
        self._form = self.form_of(layer)  # the layer's biases and activation, for the computes below
        staged_ahead = self._take_staged_ahead(layer)  # decode's budget-0 prefetch (a decode step cut short)
        chunk_ahead = self._take_chunk_ahead(layer)
        cpu_share = self._short_chunk_cpu_share(topk_ids)
        streams = self._streams_ahead(topk_ids)
        if streams and chunk_ahead is None and not staged_ahead and gpu_paths.enabled("stream-early"):
            # a chunk's first MoE layer, which no layer streamed: its misses stream now, in batches as the later
            # layers' do, instead of one by one once it routes
            self._stream_layer(layer, cpu_share)
            chunk_ahead = self._take_chunk_ahead(layer)
        ahead = chunk_ahead.experts if chunk_ahead is not None else {}
        left = self._take_left_to_cpu(layer)  # the CPU's by the split made when the previous layer streamed
        # GPU path "stream-early": the next layer's copies are queued before this layer's routing is waited for,
        # so the host's queueing overlaps the GPU's work up to the routing instead of following it
        early = streams and self._streams_early(layer, chunk_ahead)
        if early:
            self._stream_next_layer(layer, cpu_share, held={a.ring for a in ahead.values() if a.ring is not None})
        groups = group_by_expert(topk_ids, topk_weights, self.num_experts, hidden.dtype)
        self._count_prefetch_use(layer, [g.expert for g in groups])
        keys = [(layer, g.expert) for g in groups]
        self.cache.begin_step(keys)
        self.cache.record_uses(layer, keys)  # what a lookup per key counts, in one call (nothing is admitted here)
        hits, misses, near, streamed = [], [], [], []
        slot_of = self.cache.slot_of
        for g, key in zip(groups, keys, strict=True):
            slot = slot_of.get(key)
            if g.expert in ahead:  # copied while the previous layer computed (into staging or a free slot)
                streamed.append((g, ahead.pop(g.expert)))
            elif slot is not None:
                hits.append((g, slot))
            elif g.expert in staged_ahead:
                streamed.append((g, _Ahead(self.staging_first + staged_ahead[g.expert], staged_ahead.pop(g.expert),
                                           self._prefetch_done[0] if self._prefetch_done else None)))
            elif self.copier.stored(layer, g.expert):  # in the block store: dequantized on the device
                near.append(g)
            else:
                misses.append(g)
        # streamed ahead for nothing: staging slots are free again (an admitted one stays cached, unused)
        self.copier.release(*staged_ahead.values(), *(a.ring for a in ahead.values() if a.ring is not None))
        limit = self.CPU_MAX_TOKENS if self.miss_path == "auto" else float("inf")
        if self.miss_path == "auto" and self._streams_short(topk_ids) and cpu_share is None:
            limit = 0  # the link takes the whole layer
        planner = self.prefill_planner()
        given = [g for g in misses if g.expert in left and len(g.tokens) <= limit]
        to_copy, to_cpu = self._plan([g for g in misses if g.expert not in left and len(g.tokens) <= limit],
                                     lambda g: len(g.tokens), planner=planner)
        to_copy, to_cpu = near + to_copy + [g for g in misses if len(g.tokens) > limit], to_cpu + given
        on_cpu = self.cpu.submit(layer, hidden, to_cpu) if to_cpu else None
        # every expert on the device (hits, or streamed ahead), the CPU's share aside: one sorted pass
        if not to_copy and grouped_mm_available(hidden):
            out = self._compute_sorted(hidden, topk_ids, topk_weights, hits, streamed,
                                       chunk_ahead.done if early else None)
        else:
            out = self._copy_and_compute(layer, hidden, hits, to_copy, streamed,
                                         evict=hidden.shape[0] < self.PREFILL_TOKENS)
        if streams and not early:
            self._stream_next_layer(layer, cpu_share)
        weighed = sum(planner.cpu_bytes(self.expert_bytes, len(g.tokens)) for g in to_cpu)
        return self._add_cpu(out, on_cpu, len(to_cpu), planner=planner, weighed_bytes=weighed)

    def prefill_planner(self) -> MissPlanner:
        """The planner of prefill splits, with cost models of its own, seeded from the decode planner's: tens of
        tokens per expert cost the CPU arithmetic as well as reads, and a chunk's copies are paced by its staging
        ring and by the host launching their compute, so neither path costs what decode measured. It learns from
        the chunks' CPU work and copy batches. Rebuilt when the decode planner is replaced."""
        base = self.planner
        if getattr(self, "_prefill_planner_of", None) is not base:
            planner = MissPlanner(base.copy.gb_s, base.cpu.gb_s, copy_fixed_s=base.copy.fixed,
                                  cpu_fixed_s=base.cpu.fixed, learn=base.learn, issue_s=base.issue.per_copy,
                                  issue_fixed_s=base.issue.fixed, probe_every=self.PREFILL_PROBE_EVERY,
                                  guard=False)
            self._prefill_planner_obj, self._prefill_planner_of = planner, base
        return self._prefill_planner_obj

    # -- layer-ahead streaming: the link works through the next layer's attention --

    def _streams_ahead(self, topk_ids: torch.Tensor) -> bool:
        """Whether this chunk copies the next layer's experts before that layer routes: on when `prefill_ahead`,
        for chunks long enough that the next layer uses nearly every expert, and whose misses would all be
        copied anyway (in `auto`, the CPU takes experts of up to CPU_MAX_TOKENS tokens)."""
        if not self.prefill_ahead or self.miss_path == "cpu":
            return False
        least = max(self.CPU_MAX_TOKENS, self.AHEAD_TOKENS_PER_EXPERT) if self.miss_path == "auto" and \
            not self._streams_short(topk_ids) else self.AHEAD_TOKENS_PER_EXPERT
        return topk_ids.numel() / self.num_experts >= least

    def _streams_short(self, topk_ids: torch.Tensor) -> bool:
        """GPU path "stream-short-chunks": a chunk that routes to nearly every expert (AHEAD_TOKENS_PER_EXPERT a
        expert on average) but too few tokens for the long-chunk rule copies all its misses and streams ahead."""
        return self.prefill_ahead and gpu_paths.enabled("stream-short-chunks") and \
            topk_ids.numel() / self.num_experts >= self.AHEAD_TOKENS_PER_EXPERT

    def _short_chunk_cpu_share(self, topk_ids: torch.Tensor) -> float | None:
        """GPU path "short-chunks-cpu": a short chunk that streams ahead (`_streams_short`) leaves part of each next
        layer's missing experts to the CPU, which computes them once the layer routes while the link streams the
        layer after. Returns the tokens an expert averages (what the CPU's share is weighed by), or None."""
        tokens = topk_ids.numel() / self.num_experts
        if self.miss_path != "auto" or tokens >= self.CPU_MAX_TOKENS or not self._streams_short(topk_ids) or \
                not gpu_paths.enabled("short-chunks-cpu"):
            return None  # (a long chunk's experts are the GPU's: CPU_MAX_TOKENS)
        return tokens

    def _compute_sorted(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                        hits: list, streamed: list, landed=None) -> torch.Tensor:
        """A layer whose experts are all on the device, hits or streamed ahead: one sorted grouped-matmul pass
        over the slot tensor (each pair's id is its expert's slot) once the layer's copies have landed. With the
        layer streamed during the previous one, that wait is short, and a few launches replace ~9 per expert.
        Experts in neither list (the CPU's share of the layer) point at the zero slot: their pairs add nothing
        here, nor their biases (`_bias_owners`). `landed`: what `copier.wait` needs for this layer's last copy,
        when the copy stream already holds the next layer's (stream-early); else every copy queued counts."""
        table = [self.zero_slot] * self.num_experts
        for g, slot in hits:
            table[g.expert] = slot
        for g, a in streamed:
            table[g.expert] = a.slot
        if landed is not None:
            self.copier.wait(landed)
        elif streamed:
            self.copier.wait_all()  # the copy stream holds this layer's copies and nothing after them yet
        slot_ids = host_ints_to(hidden.device, table)[topk_ids]
        owners = self._bias_owners(self._form, slot_ids, topk_ids)
        out = sorted_expert_forward(self.slots, hidden, slot_ids, topk_weights, self._form,
                                    topk_ids if owners is None else owners, self._row_pairs(topk_ids, hits, streamed))
        self.copier.release(*(a.ring for _, a in streamed if a.ring is not None))
        return out

    def _row_pairs(self, topk_ids: torch.Tensor, hits: list, streamed: list) -> list[int] | None:
        """Pairs per slot, known on the host since the routing, where the slot tensor has more rows than one grouped
        call takes: the sorted pass cuts it into windows by them instead of by a sync, which would wait for the
        layer's copies to land. None where one call takes every slot."""
        if self.slots.num_experts <= experts.GROUPED_MM_GROUPS:
            return None
        pairs = [0] * self.slots.num_experts
        for g, slot in (*hits, *((g, a.slot) for g, a in streamed)):
            pairs[slot] += len(g.tokens)
        pairs[self.zero_slot] += topk_ids.numel() - sum(pairs)  # the CPU's share
        return pairs

    def _streams_early(self, layer: int, chunk_ahead: _ChunkAhead | None) -> bool:
        """GPU path "stream-early": whether the next layer may stream before this layer's routing is waited for.
        Only when this layer has nothing left to copy (its compute waits for its own last copy, not for the next
        layer's, which queue behind it) and the staging ring holds the next layer's misses beside this one's."""
        next_layer = self._next_layer.get(layer)
        if chunk_ahead is None or not chunk_ahead.complete or next_layer is None or \
                not gpu_paths.enabled("stream-early"):
            return False
        held = sum(a.ring is not None for a in chunk_ahead.experts.values())
        missing = sum((next_layer, e) not in self.cache.slot_of for e in range(self.num_experts))
        return missing - self.cache.fillable(next_layer, self._spread()) <= self.copier.staging_slots - held

    def _stream_next_layer(self, layer: int, cpu_tokens: float | None = None, held: set[int] = frozenset()) -> None:
        """Queues copies of every expert of the next MoE layer the cache lacks, behind this layer's copies: into
        free cache slots while there are any (the chunk evicts nothing), else into the staging ring, whose slots
        wait for their last reader (this layer's compute, already queued). No routing is predicted: a long chunk
        routes to nearly all of them, and asking would cost a host sync per layer. `cpu_tokens` (GPU path
        "short-chunks-cpu"): the prefill planner splits those whose bytes cross the link now, for experts averaging
        that many tokens (it cannot know the layer's routing yet), and only its copy share streams; the rest is the
        CPU's when the layer routes, while the link streams the layer after. Those the block store holds always
        stream: dequantized from device memory, they cost less than any CPU work, and one left to the CPU would
        come back at routing as a store read, taking the layer off its one sorted pass. `held`: staging ring
        indices this layer's own streamed experts still hold (stream-early: queued before this layer computes)."""
        next_layer = self._next_layer.get(layer)
        if next_layer is not None:
            self._stream_layer(next_layer, cpu_tokens, held)

    def _stream_layer(self, target: int, cpu_tokens: float | None = None, held: set[int] = frozenset()) -> None:
        """`_stream_next_layer`'s work for the layer `target` (a chunk's first MoE layer streams itself)."""
        missing = [e for e in range(self.num_experts) if (target, e) not in self.cache.slot_of]
        # the split of that layer's misses over the link, made now (probes included)
        far = [e for e in missing if not self.copier.stored(target, e)] if cpu_tokens is not None else []
        if far:
            split = self.prefill_planner().split(far, self.expert_bytes, tokens_of=lambda e: cpu_tokens,
                                                 min_copy=len(self.cache.free_slots))  # free slots: worth filling
            left = set(split.cpu)
            missing = [e for e in missing if e not in left]
            self._left_to_cpu = (target, left)
        copier, ahead, ring_left = self.copier, {}, self.copier.staging_slots - len(held)
        cached, staged, complete, spread = [], [], True, self._spread()
        for e in missing:
            admitted = self.cache.admit((target, e)) if self.cache.fillable(target, spread) else None
            if admitted is not None:
                cached.append((e, admitted[0]))
            elif ring_left:  # never around the ring: a slot streamed ahead is held until the next layer reads it
                ring_left -= 1
                staged.append(e)
            else:
                complete = False
                break
        # No wait for the queued compute: the cache slots taken are free ones, staging slots wait for their own
        # last reader; waiting would hold these copies behind this layer's experts and idle the link. GPU path
        # "ahead-batches": copies go AHEAD_BATCH experts at a time, since the host's cost per expert (runtime
        # calls, a dequantizing launch for block formats) may bound a layer of small (Q8_0) experts below the link.
        batch, done = self._ahead_batch(), None
        copier.begin(wait_compute=False, prefill=True, store_evicts=False, store_spread=self._spread())
        for i in range(0, len(cached), batch):
            part = cached[i:i + batch]
            done = copier.to_slots_marked(target, [e for e, _ in part], self.slots, [slot for _, slot in part])
            ahead.update((e, _Ahead(slot, None, done)) for e, slot in part)
        for i in range(0, len(staged), batch):
            part = staged[i:i + batch]
            rings, done = copier.to_staging_batch(target, part, self.slots, self.staging_first, held)
            ahead.update((e, _Ahead(self.staging_first + r, r, done)) for e, r in zip(part, rings, strict=True))
        copier.end()
        self._chunk_ahead = _ChunkAhead(target, ahead, done, complete)
        self._prefetched.update((target, e) for e in ahead)
        self.counters.prefetched += len(ahead)

    def _spread(self) -> int | None:
        """GPU path "prefill-spread": a chunk fills free cache slots (and block-store rows) up to an even share
        per layer, not in layer order: filled in order, a turn's first layers are all cached and idle the link
        while the later ones all stream, bound by it (evals/results/reuse-qwen3-30b-a3b-20k-h200.md)."""
        return len(self.host) if gpu_paths.enabled("prefill-spread") else None

    def _ahead_batch(self) -> int:
        """Experts a batch streamed ahead holds. "ahead-wide" (experimental): fewer, larger batches, for a turn
        whose layer-ahead streaming may be bound by the host's cost per batch (its store bookkeeping, index
        copies and launches), not by the link."""
        batch = self.AHEAD_BATCH if gpu_paths.enabled("ahead-batches") else 1
        if gpu_paths.enabled("ahead-wide"):
            batch = max(batch, min(self.AHEAD_WIDE, self.AHEAD_WIDE_BYTES // self.expert_bytes))
        return batch

    def _take_left_to_cpu(self, layer: int) -> set[int]:
        left, self._left_to_cpu = self._left_to_cpu, None
        return left[1] if left is not None and left[0] == layer else set()

    def _take_chunk_ahead(self, layer: int) -> _ChunkAhead | None:
        """What the previous layer streamed for `layer`; streamed for another layer (a forward cut short), its
        staging slots are released: nothing will read them."""
        pending, self._chunk_ahead = self._chunk_ahead, None
        if pending is None or pending.layer == layer:
            return pending
        self.copier.release(*(a.ring for a in pending.experts.values() if a.ring is not None))
        return None

    def _copy_and_compute(self, layer: int, hidden: torch.Tensor, hits: list, to_copy: list[ExpertGroup],
                          streamed: list | None = None, evict: bool = True):
        """Issues the copies first (side stream), computes the hits meanwhile, then each copied expert once its
        bytes have landed. Staged experts are interleaved so the ring of staging slots never overruns.
        `streamed`: (group, _Ahead) of experts copied before this layer ran: computed right after the hits, each
        once its own copy has landed, its staging slot released at once for this layer's own streaming.
        `evict=False`: copies only fill free cache slots. A short chunk's experts are computed `group` at a time
        (one padded batched matmul each); staged ones then in halves of the ring, so one half streams while the
        other computes."""
        copier = self.copier
        out = torch.zeros_like(hidden)
        group = self._compute_group([g for g, _ in hits] + to_copy + [g for g, _ in streamed or ()])
        if streamed:
            self._compute(hidden, hits, out, group)
            hits = []
            for i in range(0, len(streamed), group):
                part = streamed[i:i + group]
                for _, a in part:
                    copier.wait(a.done)
                self._compute(hidden, [(g, a.slot) for g, a in part], out, group)
                copier.release(*(a.ring for _, a in part if a.ring is not None))
        # paced by compute freeing staging slots: the prefill planner's copy sample. Only a chunk that may evict
        # waits for the compute queued so far (a victim's slot may still be read); free slots and staging slots
        # (their own release events) need no wait, which would hold the link behind this layer's experts.
        copier.begin(wait_compute=evict, prefill=True, store_evicts=evict, store_spread=self._spread())
        cached, staged, spread = [], [], self._spread()
        for g in to_copy:
            # a prefill chunk takes free slots only: it touches nearly every expert once, so evicting for it would
            # churn the cache (the next chunk, turn or decode step would find none of what it held); the rest
            # streams through staging, and the policy has still counted every use (lookup) for decode's admissions
            admitted = self.cache.admit((layer, g.expert)) if evict or self.cache.fillable(layer, spread) else None
            if admitted is None:
                staged.append(g)
            else:
                cached.append((g, admitted[0], copier.to_slot(layer, g.expert, self.slots, admitted[0])))
        ring = copier.staging_slots
        in_flight = [copier.to_staging(layer, g.expert, self.slots, self.staging_first) for g in staged[:ring]]
        self._compute(hidden, hits, out, group)
        for i in range(0, len(cached), group):
            for _, _, done in cached[i:i + group]:
                copier.wait(done)
            self._compute(hidden, [(g, slot) for g, slot, _ in cached[i:i + group]], out, group)
        step = max(1, min(group, ring // 2))
        for i in range(0, len(staged), step):
            indices = []
            for index, done in in_flight[i:i + step]:
                copier.wait(done)
                indices.append(index)
            self._compute(hidden, [(g, self.staging_first + index) for g, index in
                                   zip(staged[i:i + step], indices, strict=True)], out, step)
            copier.release(*indices)
            in_flight += [copier.to_staging(layer, g.expert, self.slots, self.staging_first)
                          for g in staged[i + ring:i + ring + step]]
        copier.end()  # the copy stream holds only copies, so this marks the last one's completion
        return out

    def _compute_group(self, groups: list[ExpertGroup]) -> int:
        """Experts per padded batched matmul for this chunk: 1 (one by one) once an expert has more than
        PADDED_MAX_TOKENS tokens (its matmuls are large enough to hide their launches, and padding would waste
        work), else as many as PADDED_GROUP_BYTES of gathered weights allow, at most PADDED_GROUP."""
        if not groups or max(len(g.tokens) for g in groups) > self.PADDED_MAX_TOKENS:
            return 1
        return max(1, min(self.PADDED_GROUP, self.PADDED_GROUP_BYTES // self.expert_bytes))

    def _compute(self, hidden: torch.Tensor, pairs: list, out: torch.Tensor, group: int) -> None:
        """Adds to `out` the (expert group, slot) pairs' outputs, `group` experts per batched matmul."""
        for i in range(0, len(pairs), group):
            part = pairs[i:i + group]
            if len(part) > 1:
                run_groups_padded(hidden, [g for g, _ in part], self.slots, [slot for _, slot in part], out,
                                  self._form)
            else:
                for g, slot in part:
                    y = expert_mlp(hidden[g.tokens], *self.slots.weights_of(slot), self._form, g.expert)
                    out.index_add_(0, g.tokens, y * g.weights[:, None])
