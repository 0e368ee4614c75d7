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

Layers with recurrent state (Qwen3-Next's Gated DeltaNet, DeepSeek-V4's attention windows) cannot drop the draft's
token from their state: for them a pass keeps the states from before it, and a rejected draft costs one more pass
over the sampled token alone from there (`DraftStats.redone`), so they gain less from each draft than
attention-only models.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from freetoken.engine.kv_cache import PagedKVCache, SequenceKV
from freetoken.engine.loader import LoadedModel
from freetoken.errors import FreeTokenError


@dataclass(slots=True)
class DraftStats:
    proposed: int = 0  # verification passes that carried a draft
    accepted: int = 0  # drafts the sampler picked too
    redone: int = 0  # passes of one token again after a rejected draft (models with recurrent state)

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


@dataclass(slots=True)
class Drafting:
    """One sequence's speculative state: the hidden state of its last fed position, whose MTP row waits for the
    token after it (None once that row ran, or where it cannot: after a step that computed no hidden states), and
    the draft of the token after the next one (None: the next pass checks no draft)."""

    pending: torch.Tensor | None = None
    draft: int | None = None


def speculator_for(lm: LoadedModel) -> MtpSpeculator:
    """The speculator of a model loaded with its multi-token-prediction layer, or a clear error."""
    if not lm.has_mtp:
        raise FreeTokenError("speculative decoding needs the model's multi-token-prediction layer: load it with "
                             "mtp=True (a checkpoint that has one: DeepSeek-V3/V4, GLM-4.5/5, Qwen3-Next, Qwen3.5)")
    return MtpSpeculator(lm)


class MtpSpeculator:
    """Speculative decoding's steps for sequences of one model with an MTP layer (`lm.has_mtp`), each sequence's
    state in its own `Drafting`. `Generator(speculative=True)` drives one sequence through `extend`; the
    continuous-batching scheduler runs one forward for several sequences and hands each its rows (`ready`,
    `prefilled`, `checked`)."""

    def __init__(self, lm: LoadedModel):
        self.lm = lm
        self.stats = DraftStats()

    def prefill_chunk(self, state: Drafting, tokens: torch.Tensor, cache: PagedKVCache, seq: SequenceKV
                      ) -> torch.Tensor:
        """Appends prompt tokens [T]; the MTP layer fills its rows one position behind. Returns the last token's
        logits [V] (its MTP row waits for the sampled token)."""
        first = seq.length
        logits, hidden = self.lm.forward_hidden(tokens, cache, seq, logits_for="last")
        self.prefilled(state, tokens, hidden, first, cache, seq)
        return logits[0]

    def prefilled(self, state: Drafting, tokens: torch.Tensor, hidden: torch.Tensor, first: int,
                  cache: PagedKVCache, seq: SequenceKV) -> None:
        """After a forward appended prompt tokens [T] at `first` (their hidden states [T, Hd]): the MTP rows whose
        next token is now known."""
        if state.pending is not None:  # rows first - 1 .. end - 2
            self.lm.draft(torch.cat((state.pending, hidden[:-1])), tokens, cache, seq, first - 1)
        elif tokens.shape[0] > 1:  # no hidden state for the row before: the MTP rows start here
            self.lm.draft(hidden[:-1], tokens[1:], cache, seq, first)
        state.pending, state.draft = hidden[-1:], None

    def ready(self, state: Drafting, token: int, cache: PagedKVCache, seq: SequenceKV) -> None:
        """Before a pass over `token`: the draft after it, where the last step left an MTP row waiting."""
        if state.draft is None and state.pending is not None:
            self.sampled(state, token, cache, seq)

    def sampled(self, state: Drafting, token: int, cache: PagedKVCache, seq: SequenceKV) -> None:
        """`token` follows the sequence's last fed one: the waiting MTP row runs, drafting the token after it."""
        state.draft = None
        if state.pending is not None:
            state.draft = self._draft(state.pending, [token], cache, seq, seq.length - 1)
        state.pending = None

    def verify(self, state: Drafting, token: int, cache: PagedKVCache, seq: SequenceKV, accept: Callable
               ) -> Iterator:
        """One pass over `token` (sampled, not yet fed) and the draft: yields the reply's events, `accept(logits)`
        making each — the token after `token`, and after it the one after the draft if the draft was picked. On
        return `seq` holds `token` and, if it was picked, the draft; `state` drafts for the last event's token."""
        at = seq.length
        ids = [token] if state.draft is None else [token, state.draft]
        before = dict(seq.recurrent)  # layers' states are replaced by each forward, never changed in place
        logits, hidden = self.lm.forward_hidden(torch.tensor(ids, device=self.lm.device), cache, seq)
        yield from self.checked(state, token, logits, hidden, at, before, cache, seq, accept)

    def checked(self, state: Drafting, token: int, logits: torch.Tensor, hidden: torch.Tensor, at: int,
                before: dict, cache: PagedKVCache, seq: SequenceKV, accept: Callable) -> Iterator:
        """`verify` after its forward: `logits`, `hidden` the rows of `token` at `at` and of the draft (if any),
        `before` the recurrent states from before the pass."""
        draft = state.draft
        ev = accept(logits[0])
        right = draft is not None and ev.token_ids == [draft]
        self.stats.proposed += draft is not None
        self.stats.accepted += right
        if draft is not None and (not right or ev.finish_reason is not None):
            # the draft's row goes (a picked draft that ends the reply is not fed either)
            if before:  # recurrent state holds the draft: back to before the pass, then `token` alone
                cache.truncate(seq, at, recurrent=before)
                _, hidden = self.lm.forward_hidden(torch.tensor([token], device=self.lm.device), cache, seq)
                self.stats.redone += 1
            else:
                cache.truncate(seq, at + 1)
        yield ev
        if ev.finish_reason is not None:
            return
        if not right:  # the MTP row at `at` gets the token picked
            state.pending = hidden[:1]
            self.sampled(state, ev.token_ids[0], cache, seq)
            return
        ev = accept(logits[1])
        yield ev
        state.pending = None
        state.draft = None if ev.finish_reason is not None else \
            self._draft(hidden, [draft, ev.token_ids[0]], cache, seq, at)

    def extend(self, reply, new_ids: list[int], cache: PagedKVCache, seq: SequenceKV, chunk: int) -> Iterator:
        """Prefills `new_ids` after what `seq` holds, then yields the reply's events to its end. On return `seq`
        holds every emitted token but the last (never fed back), as plain decoding leaves it."""
        state = Drafting()
        tokens = torch.tensor(new_ids, dtype=torch.long, device=self.lm.device)
        for begin in range(0, len(new_ids), chunk):
            logits = self.prefill_chunk(state, tokens[begin:begin + chunk], cache, seq)
        reply.prefilled()
        ev = reply.accept(logits)
        yield ev
        while ev.finish_reason is None:
            token = ev.token_ids[-1]
            self.ready(state, token, cache, seq)
            for ev in self.verify(state, token, cache, seq, reply.accept):
                yield ev

    def _draft(self, hidden: torch.Tensor, next_ids: list[int], cache: PagedKVCache, seq: SequenceKV,
               start: int) -> int:
        """Fills the MTP rows from `start` and returns the greedy draft of the last one."""
        next_tokens = torch.tensor(next_ids, dtype=torch.long, device=self.lm.device)
        return int(self.lm.draft(hidden, next_tokens, cache, seq, start)[-1].argmax())
