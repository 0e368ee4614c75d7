"""Single-sequence generation: chunked prefill, then one decode step per token through the paged KV cache,
streaming `GenerationEvent`s with text deltas, honouring EOS, stop strings and the token budget.

The continuous-batching scheduler of the server drives the same model runner; this is the in-process path
used by `ft generate`, `ft chat` and the parity tests.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from freetoken.engine import gpu_paths
from freetoken.engine.kv_cache import PagedKVCache, SequenceKV
from freetoken.engine.loader import LoadedModel
from freetoken.engine.sampling import Sampler, SamplingParams
from freetoken.engine.stops import StopMatcher
from freetoken.errors import FreeTokenError

if TYPE_CHECKING:
    from freetoken.engine.cuda_graphs import GraphedDecoder

__all__ = ["GenerationEvent", "Generator", "Reply", "SamplingParams"]


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
    stop_sequence: str | None = None  # the stop string that ended it, if one did
    cached_tokens: int = 0  # prompt tokens whose K/V came from an earlier request (not computed)


class Generator:
    """Generates for one sequence at a time over a KV cache it keeps between calls.

    On CUDA, decode steps replay captured CUDA graphs (`cuda_graphs=None` means: when the model is on CUDA;
    with offloaded experts the graphs are cut at each expert call, which runs eagerly);
    that needs the KV cache allocated up front, for `max_seq_len` tokens (default: the model's context, at most
    `DEFAULT_GRAPH_CAPACITY`). Elsewhere the cache grows with the sequence."""

    DEFAULT_GRAPH_CAPACITY = 16384

    def __init__(self, lm: LoadedModel, *, prefill_chunk: int | None = None, page_size: int = 16,
                 max_seq_len: int | None = None, cuda_graphs: bool | None = None, pool_tokens: int | None = 0,
                 speculative: bool = False):
        """Defaults as `run_settings` gives them. `pool_tokens`: tokens all sequences of this generator hold
        together (0: one sequence's capacity; None: unbounded where the pool can grow, i.e. without graphs).
        `speculative`: decode two tokens a pass where the model's multi-token-prediction layer guesses right
        (engine/speculative.py; the model loaded with `mtp=True`; eager steps, no CUDA graphs yet)."""
        self.lm, self.page_size = lm, page_size
        self._speculator = None
        if speculative:
            from freetoken.engine.speculative import speculator_for

            self._speculator = speculator_for(lm)
            cuda_graphs = False
        self.prefill_chunk, self.use_graphs, self.capacity = run_settings(lm, prefill_chunk, max_seq_len, cuda_graphs)
        self.pool_tokens = self.capacity if pool_tokens == 0 or (pool_tokens is None and self.use_graphs) \
            else pool_tokens
        self._cache: PagedKVCache | None = None
        self._graphs: GraphedDecoder | None = None

    @property
    def draft_stats(self):
        """Speculative decoding's drafts proposed and accepted so far (None without it)."""
        return None if self._speculator is None else self._speculator.stats

    def generate_ids(self, prompt_ids: list[int], params: SamplingParams) -> list[int]:
        return [t for ev in self.stream(prompt_ids, params, decode_text=False) for t in ev.token_ids]

    def generate_text(self, prompt_ids: list[int], params: SamplingParams) -> tuple[str, GenerationEvent]:
        parts, last = [], GenerationEvent()
        for ev in self.stream(prompt_ids, params):
            parts.append(ev.text)
            last = ev
        return "".join(parts), last

    def cache(self, n_tokens: int = 0) -> PagedKVCache:
        """The generator's KV cache (created on first use, for at least `n_tokens`); sequences of one generator
        live in it together, so they can share pages (forks, sessions)."""
        return self._cache_for(max(n_tokens, 1))

    def _cache_for(self, n_tokens: int) -> PagedKVCache:
        if self._cache is None:
            initial = self.pool_tokens if self.use_graphs else n_tokens
            self._cache = self.lm.new_cache(self.page_size, initial_tokens=initial, max_tokens=self.pool_tokens)
            if self.use_graphs:
                from freetoken.engine.cuda_graphs import GraphedDecoder

                self._graphs = GraphedDecoder(self.lm, self._cache)
        return self._cache

    @torch.inference_mode()
    def stream(self, prompt_ids: list[int], params: SamplingParams, *,
               decode_text: bool = True) -> Iterator[GenerationEvent]:
        if not prompt_ids:
            raise FreeTokenError("the prompt is empty; give at least one token")
        if len(prompt_ids) >= self.capacity:
            raise FreeTokenError(f"the prompt has {len(prompt_ids)} tokens; this generator holds at most "
                                 f"{self.capacity} (the model's context is {self.lm.context_length})")
        cache = self._cache_for(len(prompt_ids) + min(params.max_tokens, self.capacity - len(prompt_ids)))
        seq = cache.new_sequence()
        try:
            yield from self.extend(seq, prompt_ids, params, decode_text=decode_text)
        finally:
            cache.release(seq)

    @torch.inference_mode()
    def prefill(self, seq: SequenceKV, new_ids: list[int]) -> None:
        """Appends `new_ids` to `seq` without generating (a prompt taken in segments)."""
        if seq.length + len(new_ids) >= self.capacity:
            raise FreeTokenError(f"the prompt has {seq.length + len(new_ids)} tokens; this generator holds at most "
                                 f"{self.capacity} (the model's context is {self.lm.context_length})")
        if new_ids:
            self._prefill(new_ids, self._cache_for(seq.length + len(new_ids)), seq)

    @torch.inference_mode()
    def extend(self, seq: SequenceKV, new_ids: list[int], params: SamplingParams, *, decode_text: bool = True,
               cached_tokens: int = 0) -> Iterator[GenerationEvent]:
        """Prefills `new_ids` after the tokens `seq` already holds (in this generator's cache), then generates.
        The generated tokens stay in `seq`, all but the last sampled one (never fed back); the caller owns `seq`.
        `cached_tokens` is what the events report as reused (the tokens `seq` held that the prompt shares)."""
        if not new_ids:
            raise FreeTokenError("nothing new to prefill; give at least one token")
        total = seq.length + len(new_ids)
        if total >= self.capacity:
            raise FreeTokenError(f"the prompt has {total} tokens; this generator holds at most {self.capacity} "
                                 f"(the model's context is {self.lm.context_length})")
        budget = min(params.max_tokens, self.capacity - total)
        cache = self._cache_for(total + budget)
        reply = Reply(self.lm, total, params, budget, decode_text)
        reply.cached_tokens = cached_tokens
        if self._speculator is not None:
            yield from self._speculator.extend(reply, new_ids, cache, seq, self.prefill_chunk)
            return
        logits = self._prefill(new_ids, cache, seq)
        reply.prefilled()
        while True:
            ev = reply.accept(logits)
            yield ev
            if ev.finish_reason is not None:
                return
            logits = self._decode(ev.token_ids[0], cache, seq)

    def _prefill(self, prompt_ids: list[int], cache: PagedKVCache, seq) -> torch.Tensor:
        tokens = torch.tensor(prompt_ids, dtype=torch.long, device=self.lm.device)
        logits = None
        for start in range(0, len(prompt_ids), self.prefill_chunk):
            logits = self.lm.forward(tokens[start:start + self.prefill_chunk], cache, seq, logits_for="last")
        return logits[0]

    def _decode(self, token: int, cache: PagedKVCache, seq) -> torch.Tensor:
        if self._graphs is not None:
            return self._graphs.step(seq, token)
        step = torch.tensor([token], dtype=torch.long, device=self.lm.device)
        return self.lm.forward(step, cache, seq, logits_for="last")[0]


def run_settings(lm: LoadedModel, prefill_chunk: int | None, max_seq_len: int | None,
                 cuda_graphs: bool | None) -> tuple[int, bool, int]:
    """(prefill chunk, CUDA graphs on, tokens per sequence), defaults filled in: chunks of 2048 tokens, 8192 with
    offloaded experts (a chunk streams every expert the cache lacks once, so longer chunks amortise the PCIe
    traffic); graphs on CUDA; the model's context, at most DEFAULT_GRAPH_CAPACITY with graphs (their KV pool is
    allocated at full size up front)."""
    offloaded = not getattr(lm.experts, "capturable", True)
    default_graphs = lm.device.type == "cuda" and not lm.decodes_eagerly and \
        (not lm.has_recurrent_state or gpu_paths.enabled("recurrent-graphs"))
    use_graphs = default_graphs if cuda_graphs is None else cuda_graphs
    default = min(lm.context_length, Generator.DEFAULT_GRAPH_CAPACITY) if use_graphs else lm.context_length
    return prefill_chunk or (8192 if offloaded else 2048), use_graphs, min(max_seq_len or default, lm.context_length)


class Reply:
    """One sequence's reply as it is generated: samples each next token from its logits and turns it into a
    `GenerationEvent`, honouring EOS, stop strings and the token budget. The single-sequence generator and the
    continuous-batching scheduler both drive it, so a reply ends the same way whichever runs it."""

    def __init__(self, lm: LoadedModel, prompt_tokens: int, params: SamplingParams, budget: int,
                 decode_text: bool = True):
        self.prompt_tokens, self.budget = prompt_tokens, budget
        self.sampler = Sampler(params, lm.device)
        self.eos = frozenset() if params.ignore_eos else frozenset(lm.tokenizer.eos_token_ids if lm.tokenizer else ())
        if params.json_object or params.call_format:
            from freetoken.engine.json_sampler import ConstrainedSampler, language_for, literal_chars

            self.sampler = ConstrainedSampler(self.sampler, lm.tokenizer.token_bytes, self.eos, language_for(params),
                                              literal_chars(params))
        self.detok = _text_pipeline(lm, params) if decode_text else None
        self.timings = Timings()
        self.produced = 0
        self.cached_tokens = 0  # set by the caller when the prompt starts on a cached prefix
        self.started = time.perf_counter()

    def prefilled(self) -> None:
        self.timings.prefill_s = time.perf_counter() - self.started

    def accept(self, logits: torch.Tensor) -> GenerationEvent:
        """Samples the next token from `logits` [V]; the event's `token_ids` holds it unless it was EOS."""
        token = self.sampler(logits)
        self.produced += 1
        if self.produced == 1:
            self.timings.first_token_s = time.perf_counter() - self.started
        detok, text, finish = self.detok, "", None
        if token in self.eos:
            finish = "stop"
            text = detok.flush() if detok is not None else ""
        elif detok is not None:
            text, stopped = detok.push(token)
            finish = "stop" if stopped else None
        if finish is None and self.produced >= self.budget:
            finish = "length"
            text += detok.flush() if detok is not None else ""
        ids = [] if token in self.eos else [token]
        if finish is None:
            return GenerationEvent(ids, text, None, self.prompt_tokens, self.produced,
                                   cached_tokens=self.cached_tokens)
        self.timings.decode_s = time.perf_counter() - self.started - self.timings.prefill_s
        matched = detok.stops.matched if detok is not None else None
        return GenerationEvent(ids, text, finish, self.prompt_tokens, self.produced, self.timings, matched,
                               self.cached_tokens)


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
