"""Choosing the next token from logits: greedy, temperature, top-k, top-p, min-p, with a seedable generator.

Filters apply in the order temperature → top-k → top-p → min-p, as Hugging Face's generation does, so the same
parameters mean the same thing here and there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from freetoken.errors import FreeTokenError

GREEDY_BELOW = 1e-4  # a temperature this low scales a one-logit lead to e^10000: the top token, always


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    json_object: bool = False  # the reply must be one JSON object (constrained: see json_sampler.py)
    json_schema: str = ""  # with json_object: a JSON schema (as JSON text) that object must also satisfy
    # tool calls constrained to the offered tools (see json_sampler.py): "hermes" (JSON in <tool_call>) or
    # "qwen-xml" (Qwen3-Coder); `call_opening`: the reply starts inside a call, after this text the prompt wrote
    # (a forced call); `call_tools`: (name, parameter names) of each offered tool
    call_format: str = ""
    call_opening: str | None = None
    call_tools: tuple[tuple[str, tuple[str, ...]], ...] = ()
    call_schemas: tuple[tuple[str, str], ...] = ()  # (name, parameters schema as JSON text): arguments checked too
    call_single: bool = False  # at most one call, and the reply ends with it (parallel calls turned off)

    def __post_init__(self) -> None:
        checks = [
            (self.max_tokens >= 1, f"max_tokens must be ≥ 1, got {self.max_tokens}"),
            (self.temperature >= 0, f"temperature must be ≥ 0, got {self.temperature}"),
            (self.top_k >= 0, f"top_k must be ≥ 0, got {self.top_k}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
        ]
        for ok, message in checks:
            if not ok:
                raise FreeTokenError(message)
        self.stop = tuple(s for s in self.stop if s)

    @property
    def greedy(self) -> bool:
        """Temperatures below GREEDY_BELOW sample the top token anyway (and dividing by them overflows)."""
        return self.temperature < GREEDY_BELOW or self.top_k == 1


class Sampler:
    def __init__(self, params: SamplingParams, device: torch.device):
        self.params = params
        self.generator = torch.Generator(device=device)
        if params.seed is not None:  # APIs take any integer; torch seeds are 64-bit
            self.generator.manual_seed(params.seed % 2**64)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        """logits [V] → token id."""
        p = self.params
        if p.greedy:
            return int(torch.argmax(logits))
        probs = filtered_probs(logits.float() / p.temperature, p.top_k, p.top_p, p.min_p)
        return int(torch.multinomial(probs, 1, generator=self.generator))


def filtered_probs(scores: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Temperature-scaled scores [V] → renormalised probabilities with the filtered tokens at zero."""
    if top_k > 0 and top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        cumulative = torch.softmax(sorted_scores, -1).cumsum(-1)
        # Drop a token once the mass *before* it already reaches top_p; the top token always survives.
        drop_sorted = (cumulative - torch.softmax(sorted_scores, -1)) >= top_p
        drop_sorted[0] = False  # also when top_p rounds to 0 in the scores' dtype
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    probs = torch.softmax(scores, -1)
    if min_p > 0:
        probs = probs.masked_fill(probs < min_p * probs.max(), 0.0)
        probs = probs / probs.sum()
    return probs
