"""Single-sequence generation: chunked prefill, then one decode step per token through the paged KV cache,
streaming `GenerationEvent`s with text deltas, honouring EOS, stop strings and the token budget.

The continuous-batching scheduler of the server drives the same model runner; this is the in-process path
used by `ft generate`, `ft chat` and the parity tests.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from freetoken.engine.loader import LoadedModel
from freetoken.engine.sampling import Sampler, SamplingParams
from freetoken.engine.stops import StopMatcher
from freetoken.errors import FreeTokenError

__all__ = ["GenerationEvent", "Generator", "SamplingParams"]


@dataclass(slots=True)
class Timings:
    prefill_s: float = 0.0
    decode_s: float = 0.0
    first_token_s: float = 0.0  # time to first token, from the call


@dataclass(slots=True)
class GenerationEvent:
    """One step of a generation: new token ids, the text they complete, and on the last event why it ended."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" (EOS or stop string) or "length"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    timings: Timings | None = None


class Generator:
    def __init__(self, lm: LoadedModel, *, prefill_chunk: int = 2048, page_size: int = 16):
        self.lm, self.prefill_chunk, self.page_size = lm, prefill_chunk, page_size

    def generate_ids(self, prompt_ids: list[int], params: SamplingParams) -> list[int]:
        return [t for ev in self.stream(prompt_ids, params, decode_text=False) for t in ev.token_ids]

    def generate_text(self, prompt_ids: list[int], params: SamplingParams) -> tuple[str, GenerationEvent]:
        parts, last = [], GenerationEvent()
        for ev in self.stream(prompt_ids, params):
            parts.append(ev.text)
            last = ev
        return "".join(parts), last

    @torch.inference_mode()
    def stream(self, prompt_ids: list[int], params: SamplingParams, *,
               decode_text: bool = True) -> Iterator[GenerationEvent]:
        if not prompt_ids:
            raise FreeTokenError("the prompt is empty; give at least one token")
        context = self.lm.context_length
        if len(prompt_ids) >= context:
            raise FreeTokenError(f"the prompt has {len(prompt_ids)} tokens; the model's context is {context}")
        budget = min(params.max_tokens, context - len(prompt_ids))
        lm, t0 = self.lm, time.perf_counter()
        cache = lm.new_cache(self.page_size, initial_tokens=len(prompt_ids) + budget)
        seq = cache.new_sequence()
        sampler = Sampler(params, lm.device)
        eos = frozenset() if params.ignore_eos else frozenset(lm.tokenizer.eos_token_ids if lm.tokenizer else ())
        detok = _text_pipeline(lm, params) if decode_text else None
        timings = Timings()

        logits = self._prefill(prompt_ids, cache, seq)
        timings.prefill_s = time.perf_counter() - t0
        produced, finish = 0, None
        try:
            while finish is None:
                token = sampler(logits)
                produced += 1
                if produced == 1:
                    timings.first_token_s = time.perf_counter() - t0
                text, finish = "", None
                if token in eos:
                    finish = "stop"
                    text = detok.flush() if detok is not None else ""
                elif detok is not None:
                    text, stopped = detok.push(token)
                    finish = "stop" if stopped else None
                if finish is None and produced >= budget:
                    finish = "length"
                if finish == "length" and detok is not None:
                    text += detok.flush()
                ids = [] if token in eos else [token]
                if finish is not None:
                    timings.decode_s = time.perf_counter() - t0 - timings.prefill_s
                    yield GenerationEvent(ids, text, finish, len(prompt_ids), produced, timings)
                    return
                yield GenerationEvent(ids, text, None, len(prompt_ids), produced)
                step = torch.tensor([token], dtype=torch.long, device=lm.device)
                logits = lm.model(step, cache, seq, logits_for="last")[0]
        finally:
            cache.release(seq)

    def _prefill(self, prompt_ids: list[int], cache, seq) -> torch.Tensor:
        tokens = torch.tensor(prompt_ids, dtype=torch.long, device=self.lm.device)
        logits = None
        for start in range(0, len(prompt_ids), self.prefill_chunk):
            logits = self.lm.model(tokens[start:start + self.prefill_chunk], cache, seq, logits_for="last")
        return logits[0]


class _TextPipeline:
    """Token ids → text deltas with stop strings held back and cut."""

    def __init__(self, decoder, stops: StopMatcher):
        self.decoder, self.stops = decoder, stops

    def push(self, token: int) -> tuple[str, bool]:
        return self.stops.feed(self.decoder.push(token))

    def flush(self) -> str:
        text, _ = self.stops.feed(self.decoder.flush())
        return text + self.stops.flush()


def _text_pipeline(lm: LoadedModel, params: SamplingParams) -> _TextPipeline:
    from freetoken.engine.tokenizer import IncrementalDecoder

    return _TextPipeline(IncrementalDecoder(lm.tokenizer, skip_special_tokens=True), StopMatcher(params.stop))
