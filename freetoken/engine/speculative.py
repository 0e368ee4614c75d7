"""Speculative decoding with the model's own multi-token-prediction layer (models/mtp.py): each step checks the
sampled token `a` and the MTP layer's draft `d` of the token after it in one forward of two tokens. The reply's
sampler then picks the token after `a` from the first row's logits exactly as plain decoding would; when it picks
`d`, the second row's logits (computed with `d` in place) give the next token too — two tokens for one pass
over the weights, which is what offloaded decode pays for. When it does not, `d`'s cache row is dropped.

Lossless by construction: every emitted token is the sampler's pick from the logits plain decoding would give it
(the same sampler state, called once per token in the same order). A drafted token is accepted with probability
p(d) under the sampler's distribution p — which is also the acceptance rate of speculative sampling with a greedy
draft — so sampling needs no separate rejection rule.

The MTP layer's row at position i needs the main model's hidden state at i and the token at i + 1, so it runs
one position behind the main layers: after each forward, over the positions whose next token is now known. A
sequence extended after tokens it got elsewhere (an earlier turn, a shared prefix) has no MTP row for its last
old position, and a row written at the end of a full page that a fork shares shows in the fork too: both only
change later drafts, never a token (the main layers' rows are untouched).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from freetoken.engine.kv_cache import PagedKVCache, SequenceKV
from freetoken.engine.loader import LoadedModel


@dataclass(slots=True)
class DraftStats:
    proposed: int = 0  # verification passes (one draft each)
    accepted: int = 0  # drafts the sampler picked too

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


class MtpSpeculator:
    """Drives one sequence's prefill and decode through the MTP layer (`lm.has_mtp`); `Generator(speculative=True)`
    owns one."""

    def __init__(self, lm: LoadedModel):
        self.lm = lm
        self.stats = DraftStats()

    def prefill(self, new_ids: list[int], cache: PagedKVCache, seq: SequenceKV, chunk: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Appends `new_ids` in chunks; the MTP layer fills its rows one position behind. Returns the last token's
        logits [V] and its hidden state [1, Hd] (its MTP row waits for the sampled token)."""
        tokens = torch.tensor(new_ids, dtype=torch.long, device=self.lm.device)
        pending = None  # the hidden state of the last position appended, whose next token was not yet known
        logits = None
        for begin in range(0, len(new_ids), chunk):
            part = tokens[begin:begin + chunk]
            first = seq.length
            logits, hidden = self.lm.forward_hidden(part, cache, seq, logits_for="last")
            if pending is not None:  # rows first - 1 .. end - 2
                self.lm.draft(torch.cat((pending, hidden[:-1])), part, cache, seq, first - 1)
            elif part.shape[0] > 1:  # the sequence's earlier rows came from elsewhere: its MTP rows start here
                self.lm.draft(hidden[:-1], part[1:], cache, seq, first)
            pending = hidden[-1:]
        return logits[0], pending

    def decode(self, reply, first_logits: torch.Tensor, pending: torch.Tensor, cache: PagedKVCache,
               seq: SequenceKV) -> Iterator:
        """Yields the reply's events from the prompt's last logits on. On return `seq` holds every emitted token
        but the last (never fed back), as plain decoding leaves it."""
        lm = self.lm
        ev = reply.accept(first_logits)
        yield ev
        if ev.finish_reason is not None:
            return
        token = ev.token_ids[0]
        draft = self._draft(pending, [token], cache, seq, seq.length - 1)
        while True:
            at = seq.length
            logits, hidden = lm.forward_hidden(torch.tensor([token, draft], device=lm.device), cache, seq)
            ev = reply.accept(logits[0])
            right = ev.token_ids == [draft]
            self.stats.proposed += 1
            self.stats.accepted += right
            yield ev
            if ev.finish_reason is not None:
                cache.truncate(seq, at + 1)
                return
            picked = ev.token_ids[0]
            if not right:  # the draft's row goes; the MTP row at `at` gets the token picked instead
                cache.truncate(seq, at + 1)
                token, draft = picked, self._draft(hidden[:1], [picked], cache, seq, at)
                continue
            ev = reply.accept(logits[1])
            yield ev
            if ev.finish_reason is not None:
                return
            token = ev.token_ids[0]
            draft = self._draft(hidden, [picked, token], cache, seq, at)

    def _draft(self, hidden: torch.Tensor, next_ids: list[int], cache: PagedKVCache, seq: SequenceKV,
               start: int) -> int:
        """Fills the MTP rows from `start` and returns the greedy draft of the last one."""
        next_tokens = torch.tensor(next_ids, dtype=torch.long, device=self.lm.device)
        return int(self.lm.draft(hidden, next_tokens, cache, seq, start)[-1].argmax())
