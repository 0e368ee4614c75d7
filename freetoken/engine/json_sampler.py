"""JSON-constrained sampling (`response_format` json_object / json_schema): every sampled token keeps the output
the start of a JSON object, and once the object closes only end-of-sequence (or whitespace) follows.

Rejection sampling over the unconstrained sampler: draw a token; if its text cannot continue the JSON, mask it
out and draw again — a draw from the same filtered distribution renormalised over the tokens that remain, so
greedy stays greedy and sampling keeps its temperature. A model asked for JSON mostly proposes valid tokens,
so a step costs one draw; after MAX_DRAWS refusals the best-scoring valid token among the top FALLBACK_RANKS is
taken. A json_schema's structure is not enforced, only JSON syntax with an object at the top.
"""

from __future__ import annotations

import functools

import torch

from freetoken.engine.json_prefix import JsonPrefix
from freetoken.engine.sampling import Sampler
from freetoken.engine.tokenizer import Tokenizer


class TokenTexts:
    """A token's text as it reads inside a longer output: decoded after a fixed ordinary token and diffed, so a
    sentencepiece token keeps the leading space it loses when decoded first. Cached per id."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.anchor = tokenizer.encode("a")[-1]
        self.anchor_text = tokenizer.decode([self.anchor])
        self._cache: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self._cache.get(token)
        if text is None:
            both = self.tokenizer.decode([self.anchor, token])
            text = both[len(self.anchor_text):] if both.startswith(self.anchor_text) else both
            self._cache[token] = text
        return text


@functools.lru_cache(maxsize=4)
def token_texts(tokenizer: Tokenizer) -> TokenTexts:
    """One cache of token texts per tokenizer, shared by every constrained reply."""
    return TokenTexts(tokenizer)


class JsonSampler:
    MAX_DRAWS = 16
    FALLBACK_RANKS = 8192

    def __init__(self, sampler: Sampler, texts: TokenTexts, eos: frozenset[int]):
        self.sampler, self.texts, self.eos = sampler, texts, eos
        self.state = JsonPrefix()

    def __call__(self, logits: torch.Tensor) -> int:
        """logits [V] → a token id that keeps the output valid (advancing the JSON state)."""
        if self.state.complete and self.eos:  # the object is closed: the reply ends here
            return max(self.eos, key=lambda t: float(logits[t]))
        masked = None
        for _ in range(self.MAX_DRAWS):
            token = self.sampler(logits if masked is None else masked)
            if self._take(token):
                return token
            if masked is None:
                masked = logits.clone()
            masked[token] = float("-inf")
        ranked = torch.argsort(masked, descending=True)[:self.FALLBACK_RANKS].tolist()
        for token in ranked:
            if self._take(token):
                return token
        # nothing among the likeliest tokens continues the JSON (a vocabulary without the characters needed):
        # end the reply rather than emit invalid text
        return min(self.eos) if self.eos else ranked[0]

    def _take(self, token: int) -> bool:
        if token in self.eos:
            return self.state.complete
        text = self.texts(token)
        if not text or not self.state.accepts(text):
            return False
        self.state.feed(text)
        return True
