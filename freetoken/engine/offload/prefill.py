"""The prefill path of `OffloadedExpertExecutor` (any batch too large to gather): experts one by one, copies
pipelined against compute, and optionally the next layer's experts streamed ahead during its attention.

A mixin over the executor's state (cache, copier, slots, planner, routers): the decode path and the graph
boundaries live in executor.py, this file owns how a long chunk streams the experts it routes to.
"""

from __future__ import annotations

import torch

from freetoken.engine.experts import ExpertGroup, group_by_expert, run_groups
from freetoken.engine.offload.planner import MissPlanner


class PrefillPath:
    # A miss with more tokens than this is a large matrix product: the GPU's, whatever the link costs. Below it
    # (a short chunk: an agent's next turn, an edit's suffix) the CPU's tiles can take part of a layer's misses
    # while the link streams the rest; the prefill planner learns what that costs here.
    CPU_MAX_TOKENS = 128
    # A batch of at least this many tokens is a prefill chunk: it fills free cache slots but evicts nothing
    PREFILL_TOKENS = 64
    PREFILL_PROBE_EVERY = 8  # a prefill is a few hundred layer-steps: re-probe an unused path sooner than decode

    def _forward_grouped(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
                         topk_weights: torch.Tensor) -> torch.Tensor:
        groups = group_by_expert(topk_ids, topk_weights, self.num_experts, hidden.dtype)
        ahead = self._take_staged_ahead(layer)
        self._count_prefetch_use(layer, [g.expert for g in groups])
        self.cache.begin_step((layer, g.expert) for g in groups)
        hits, misses, staged = [], [], []
        for g in groups:
            slot = self.cache.lookup((layer, g.expert))
            if slot is not None:
                hits.append((g, slot))
            elif g.expert in ahead:  # a miss of the cache already in a staging slot (streamed ahead)
                staged.append((g, ahead.pop(g.expert)))
            else:
                misses.append((g, slot))
        self.copier.release(*ahead.values())  # streamed ahead for nothing: the slots are free again
        limit = self.CPU_MAX_TOKENS if self.miss_path == "auto" else float("inf")
        planner = self._prefill_planner()
        to_copy, to_cpu = self._plan([g for g, _ in misses if len(g.tokens) <= limit], lambda g: len(g.tokens),
                                     planner=planner)
        to_copy += [g for g, _ in misses if len(g.tokens) > limit]
        on_cpu = self.cpu.submit(layer, hidden, to_cpu) if to_cpu else None
        out = self._copy_and_compute(layer, hidden, hits, to_copy, staged,
                                     evict=hidden.shape[0] < self.PREFILL_TOKENS)
        if self.prefill_ahead and self.miss_path != "cpu":
            self._stream_ahead(layer, hidden)
        weighed = sum(planner.cpu_bytes(self.expert_bytes, len(g.tokens)) for g in to_cpu)
        return self._add_cpu(out, on_cpu, len(to_cpu), planner=planner, weighed_bytes=weighed)

    def _prefill_planner(self) -> MissPlanner:
        """The planner of prefill splits: its own CPU model (tens of tokens per expert cost the CPU arithmetic as
        well as reads, so decode's per-expert timings do not carry over), the decode planner's model of the link
        (a copy costs the same for any number of tokens). Rebuilt when the decode planner is replaced."""
        base = self.planner
        if getattr(self, "_prefill_planner_of", None) is not base:
            planner = MissPlanner(base.copy.gb_s, base.cpu.gb_s, cpu_fixed_s=base.cpu.fixed, learn=base.learn,
                                  issue_s=base.issue_s, probe_every=self.PREFILL_PROBE_EVERY)
            planner.copy = base.copy  # shared: decode's copy timings keep it current
            self._prefill_planner_obj, self._prefill_planner_of = planner, base
        return self._prefill_planner_obj

    def _stream_ahead(self, layer: int, hidden: torch.Tensor) -> None:
        """Queues copies of the next layer's experts its router picks for this chunk (as this layer's input
        predicts them, most tokens first), behind this layer's copies; staging slots wait for their last reader."""
        next_layer = self._next_layer.get(layer)
        if next_layer is None or next_layer not in self._routers:
            return
        weight, k = self._routers[next_layer]
        counts = torch.bincount(torch.topk(hidden @ weight.t(), k, dim=-1).indices.flatten(),
                                minlength=self.num_experts)
        order = [e for e in torch.argsort(counts, descending=True, stable=True).tolist() if counts[e] > 0]
        room = self.copier.staging_slots - 1
        self._prefetch(next_layer, set(order[:room] if not self.cache.capacity else order), room, plan=False)

    def _copy_and_compute(self, layer: int, hidden: torch.Tensor, hits: list, to_copy: list[ExpertGroup],
                          ahead: list | None = None, evict: bool = True):
        """Issues the copies first (side stream), computes the hits meanwhile, then each copied expert once its
        bytes have landed. Staged experts are interleaved so the ring of staging slots never overruns. `ahead`:
        (group, ring index) of experts streamed into staging slots before this layer ran: computed first, each
        slot released at once for this layer's own streaming. `evict=False`: copies only fill free cache slots."""
        copier = self.copier
        out = None
        if ahead:
            if self._prefetch_done:
                copier.wait(self._prefetch_done[0])
            for g, index in ahead:
                y = run_groups(hidden, [g], lambda e, s=self.staging_first + index: self.slots.weights_of(s))
                out = y if out is None else out + y
                copier.release(index)
        copier.begin(sample=False)  # staged copies wait for compute to free their slots: no sample of the link
        cached, staged = [], []
        for g in to_copy:
            # a prefill chunk takes free slots only: it touches nearly every expert once, so evicting for it would
            # churn the cache (the next chunk, turn or decode step would find none of what it held); the rest
            # streams through staging, and the policy has still counted every use (lookup) for decode's admissions
            admitted = self.cache.admit((layer, g.expert)) if evict or self.cache.free_slots else None
            if admitted is None:
                staged.append(g)
            else:
                cached.append((g, admitted[0], copier.to_slot(layer, g.expert, self.slots, admitted[0])))
        ring = copier.staging_slots
        in_flight = [copier.to_staging(layer, g.expert, self.slots, self.staging_first) for g in staged[:ring]]
        slot_of = {g.expert: slot for g, slot in hits}
        y = run_groups(hidden, [g for g, _ in hits], lambda e: self.slots.weights_of(slot_of[e]))
        out = y if out is None else out + y
        for g, slot, done in cached:
            copier.wait(done)
            out += run_groups(hidden, [g], lambda e, s=slot: self.slots.weights_of(s))
        for i, g in enumerate(staged):
            index, done = in_flight[i]
            copier.wait(done)
            out += run_groups(hidden, [g], lambda e, s=self.staging_first + index: self.slots.weights_of(s))
            copier.release(index)
            if i + ring < len(staged):
                in_flight.append(copier.to_staging(layer, staged[i + ring].expert, self.slots, self.staging_first))
        copier.end()  # the copy stream holds only copies, so this marks the last one's completion
        self.counters.bytes_copied += len(to_copy) * self.expert_bytes
        return out
