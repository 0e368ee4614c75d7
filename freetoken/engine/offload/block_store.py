"""Experts kept in their block format on the device: the expert cache's second tier, for quantized experts.

The slot cache holds experts dequantized (bf16: 2 bytes a weight). A Q8_0 expert is 1.06 bytes a weight in its
block format (MXFP4 0.53), so rows of block bytes hold about twice (four times) the experts the same bytes of
slots hold. An expert the slots lack but a row holds is dequantized from device memory into its slot, a few µs of
HBM traffic, instead of crossing PCIe (~100 µs for a Q8_0 Qwen3-30B-A3B expert at 50 GB/s). Copies from the host
land in a row whenever the store admits the expert, so the next time the slots have let it go it is still here.

Rows are written (copies from the host) and read (the dequantizing launch) on the copier's stream only, in
order: a row can be given to another expert as soon as the batch that read it last is queued. Within one batch
the rows it reads and fills are protected from each other's admissions.

Shapes: R rows, B block bytes of one expert (gate, up and down back to back).
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from freetoken.engine.offload.expert_cache import ExpertCache
from freetoken.engine.offload.policy import make_policy


class BlockStore:
    def __init__(self, rows: int, expert_bytes: int, device: torch.device, policy: str = "freq"):
        if rows < 1:
            raise ValueError(f"a block store needs at least one row, got {rows}")
        self.expert_bytes, self.policy_name = expert_bytes, policy
        self.cache = ExpertCache(rows, make_policy(policy))
        self.rows = torch.empty((rows, expert_bytes), dtype=torch.uint8, device=device)  # [R, B]

    @property
    def capacity(self) -> int:
        return self.cache.capacity

    def holds(self, key: Hashable) -> bool:
        return key in self.cache.slot_of

    def place(self, layer: int, experts: list[int], evict: bool,
              spread: int | None = None) -> list[tuple[int | None, bool]]:
        """Per expert of one batch: (its row, or None where the store takes it not; whether its bytes must come
        from the host). Experts the store holds are read from their rows; the others are admitted where a row is
        free or (`evict`) the policy gives one up. A prefill chunk passes `evict=False`: it touches nearly every
        expert once, and evicting for it would churn out what decode keeps using. `spread` (with `evict=False`):
        the layers sharing the store, each filling free rows up to an even share (`ExpertCache.fillable`)."""
        keys = [(layer, e) for e in experts]
        slot_of = self.cache.slot_of
        self.cache.begin_step(k for k in keys if k in slot_of)  # the batch's reads: not given away below
        self.cache.record_uses(layer, keys)
        placed = []
        for key in keys:
            row = slot_of.get(key)
            if row is not None:
                placed.append((row, False))
                continue
            # held: a later admission of this batch must not take the row this one is about to fill
            admitted = self.cache.admit(key, hold=True) if evict or self.cache.fillable(layer, spread) else None
            placed.append((None if admitted is None else admitted[0], True))
        return placed

    def resize(self, rows: int) -> None:
        """Grows (keeping every row) or shrinks (evicting the coldest, moving the survivors down). The caller
        has drained the copy stream: no queued copy or launch may still touch the old rows."""
        if rows < 1:
            raise ValueError(f"a block store needs at least one row, got {rows}")
        moves = self.cache.resize(rows)
        new = torch.empty((rows, self.expert_bytes), dtype=torch.uint8, device=self.rows.device)
        moved_from = {new_row: old for _, old, new_row in moves}
        for row in self.cache.slot_of.values():
            new[row].copy_(self.rows[moved_from.get(row, row)])
        self.rows = new
