"""Decode's next-layer prefetch, a mixin of `OffloadedExpertExecutor`: layer L's MoE input through layer L+1's
router predicts L+1's experts, and their copies start while L still computes, into cache slots, or with no cache
(budget 0) into staging slots held for L+1. The link would otherwise idle while L+1's dense work runs and its
routing reaches the host. Only the share the planner would copy is prefetched; the rest (GPU paths "cpu-warm",
"cpu-warm-owned") may be read into the CPU's caches meanwhile.

Over the executor's state (cache, copier, planner, counters, the prefetch bookkeeping its constructor sets up):
executor.py owns the decode step that consumes what this queued.
"""

from __future__ import annotations

import time

import torch

from freetoken.engine import gpu_paths


class DecodePrefetch:
    def _prefetch_target(self, layer: int) -> int | None:
        """The layer whose experts to prefetch from this layer's input, if any (not for the CPU-only path)."""
        if not self.prefetch or self.miss_path == "cpu":
            return None
        return self._next_layer.get(layer)

    def _prefetch_room(self, ids: list[list[int]]) -> int:
        """Staging slots a budget-0 prefetch may hold: the next layer's own copies need the rest."""
        return self.copier.staging_slots - len(ids) * len(ids[0])

    def _prefetch(self, layer: int, experts: set[int], room: int, after: torch.cuda.Event | None = None) -> None:
        """Starts copies of the predicted experts of `layer` that the cache lacks, behind this layer's copies and
        this layer's compute (a victim's slot may still be read by it). Only the share the planner would copy
        if they were misses: the rest would go to the CPU anyway, and extra copies would crowd the link.
        Without cache slots (budget 0) at most `room` go to staging slots, held until `layer` runs. `after`: an
        event on the compute stream past the last reader of the slots (instead of all the compute queued)."""
        missing = sorted(e for e in experts if (layer, e) not in self.cache.slot_of)
        copier = self.copier
        near = [e for e in missing if copier.stored(layer, e)]  # no link bytes: always made present
        if near:
            missing = [e for e in missing if not copier.stored(layer, e)]
        if self.miss_path == "auto":
            lead = gpu_paths.enabled("prefetch-lead")
            # with "prefetch-lead" the copies are credited with their head start over the CPU share (which starts
            # at the routing) and their queueing, done now, delays neither path
            head_start = (self.prefetch_lead_s or 0.0) if lead else 0.0
            busy = self._copy_backlog() - head_start
            split = self.planner.split(missing, self.expert_bytes, observe=False, copy_busy_s=busy, cpu_first=lead)
            missing = split.copy[:len(split.copy) - self.planner.held_for_probe()]
            to_warm = split.cpu if gpu_paths.enabled("cpu-warm") or gpu_paths.enabled("cpu-warm-owned") else []
        else:
            to_warm = []
        missing = near + missing  # the near ones first: they cost a launch, not the link
        if not missing:
            self._warm(layer, to_warm)
            return
        # staging slots wait for their own last reader; cache slots for the compute queued so far, or `after`
        copier.begin(wait_compute=bool(self.cache.capacity) and after is None)
        if after is not None and self.cache.capacity:
            copier.wait_for(after)
        experts, slots = [], []
        for e in missing:
            if self.cache.capacity:
                # held: a fresh key is the frequency policy's coldest, so each prediction evicted the one before
                # it (H200, D1 at 8-16 GiB: one prefetch a layer-step, against four with no cache)
                admitted = self.cache.admit((layer, e), hold=True)
                if admitted is None:
                    break  # every slot holds this step's experts or the predictions admitted so far
                slot = admitted[0]
            elif len(self._staged_ahead) < room:
                ring = copier.reserve_staging(set(self._staged_ahead.values()))
                self._staged_ahead[(layer, e)] = ring
                slot = self.staging_first + ring
            else:
                break
            experts.append(e)
            slots.append(slot)
        copier.to_slots(layer, experts, self.slots, slots)
        if experts and copier.stream is not None:
            self._prefetch_done = [copier.mark_copies()]
        copier.end()
        if near and self.cache.capacity:
            # a prediction the store served into a cache slot becomes a hit of its step, counted there (not as a
            # store hit as well); one served into a staging slot stays the store-served miss it will be
            from_store = [(layer, e) for e in experts[:len(near)]]
            self.counters.store_hits -= len(from_store)
            self._prefetched_near.update(from_store)
        if experts:
            now = time.perf_counter()
            fetched = max(0, len(experts) - len(near))
            self._link.queued(now, self.planner.copy.predict(fetched * self.expert_bytes))
            self._prefetch_queued = (layer, now)
        self._prefetched.update((layer, e) for e in experts)
        self.counters.prefetched += len(experts)
        self._warm(layer, to_warm)

    def _warm(self, layer: int, experts: list[int]) -> None:
        """GPU path "cpu-warm": the predicted experts the CPU would compute are read into its caches meanwhile
        (after the copies are queued: the link is the longer way)."""
        if experts and self.cpu.warm(layer, experts):
            self._warmed = (layer, set(experts))
            self.counters.cpu_warmed += len(experts)

    LEAD_DECAY = 0.8  # weight of the previous mean in `prefetch_lead_s`
    MAX_LEAD_S = 2e-3  # a longer gap (a prefill, an idle server between steps) says nothing of decode's lead

    def _observe_prefetch_lead(self, layer: int) -> None:
        """At a layer's routing: how long ago its prefetch was queued, into the running mean (GPU path
        "prefetch-lead")."""
        queued, self._prefetch_queued = self._prefetch_queued, None
        if queued is None or queued[0] != layer:
            return
        lead = time.perf_counter() - queued[1]
        if lead <= self.MAX_LEAD_S:
            mean = self.prefetch_lead_s
            self.prefetch_lead_s = lead if mean is None else self.LEAD_DECAY * mean + (1 - self.LEAD_DECAY) * lead

    def _take_staged_ahead(self, layer: int) -> dict[int, int]:
        """expert → ring index of the staging slots prefetched for `layer`. Those of any other layer (a step cut
        short, a prefill in between) are dropped: nothing will read them, so their slots are free again."""
        ahead = {e: ring for (at, e), ring in self._staged_ahead.items() if at == layer}
        self._staged_ahead = {}
        return ahead

    def _copy_backlog(self) -> float:
        """Seconds the link still owes the decode copies queued so far (prefetches and earlier steps'), by the
        copy model, or none once they are known to have landed: copies queued now start after them."""
        now = time.perf_counter()
        if self.copier.idle():
            self._link.drained(now)
        return self._link.backlog(now)

    def _count_prefetch_use(self, layer: int, routed) -> None:
        """`routed`: the experts the layer routed to (any iterable of expert ids)."""
        if self._prefetched:
            self.counters.prefetch_used += sum((layer, e) in self._prefetched for e in routed)
            self._prefetched = {key for key in self._prefetched if key[0] != layer}
            self._prefetched_near = {key for key in self._prefetched_near if key[0] != layer}
