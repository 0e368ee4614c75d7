"""Continuous batching: sequences sharing forwards get what each would get alone, join and leave between steps,
free their KV pages when done or cancelled, and a full KV pool ends the newest request, not the server."""

from __future__ import annotations

import pytest
import torch

from freetoken.engine.batching import BatchRequest, BatchScheduler, KVCacheFull
from freetoken.engine.generator import Generator
from freetoken.engine.loader import load_model
from freetoken.engine.sampling import SamplingParams
from support.checkpoints import PARITY_CASES, prompt_ids, write_hf_checkpoint
from support.decode_checks import batched_equals_alone

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
TEXTS = ["The quick brown fox", "A longer prompt that takes several prefill chunks to get through", "Hi"]


@pytest.fixture(scope="module", params=["llama", "qwen3_moe"])
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    write_hf_checkpoint(path=path, **PARITY_CASES[request.param])
    return path


def _all_pages_back(scheduler: BatchScheduler) -> bool:
    """Every page is free once the prefix cache lets go of what it kept (and it kept only full pages)."""
    allocator = scheduler.cache.allocator
    held = allocator.num_pages - allocator.num_free
    kept = len(scheduler.prefix) if scheduler.prefix is not None else 0
    if scheduler.prefix is not None:
        scheduler.prefix.clear()
    return held == kept and allocator.num_free == allocator.num_pages and not allocator.refs


def _run(scheduler: BatchScheduler, prompts: list[list[int]], params=GREEDY, join_late: bool = False):
    """Runs the prompts through the scheduler (the last one joining after two steps if `join_late`); returns
    each request's tokens and the requests."""
    out = [[] for _ in prompts]
    reqs = [BatchRequest(p, params, emit=lambda ev, i=i: out[i].extend(ev.token_ids)) for i, p in enumerate(prompts)]
    for r in reqs[:-1] if join_late else reqs:
        scheduler.add(r)
    steps = 0
    while scheduler.active or (join_late and steps <= 2):
        scheduler.step()
        steps += 1
        if join_late and steps == 2:
            scheduler.add(reqs[-1])
    return out, reqs


def test_batched_logits_equal_one_sequence_at_a_time(model):
    batched_equals_alone(load_model(model, progress=False), [prompt_ids(t) for t in TEXTS])


@pytest.mark.parametrize("offload", [False, True])
def test_interleaved_prefill_and_decode_give_each_request_its_own_tokens(model, offload):
    lm = load_model(model, progress=False)
    prompts = [prompt_ids(t) for t in TEXTS]
    expected = [Generator(lm).generate_ids(p, GREEDY) for p in prompts]
    if offload:
        if lm.moe_spec is None:
            pytest.skip("a dense model has no experts to offload")
        lm = load_model(model, progress=False, expert_cache=3 * lm.moe_spec.bytes_per_expert(torch.float32))
    scheduler = BatchScheduler(lm, prefill_chunk=4)  # the long prompt takes several chunks between decodes
    got, reqs = _run(scheduler, prompts, join_late=True)
    assert got == expected
    assert max(max(r.steps) for r in reqs) >= 2  # decodes shared forwards with prefill chunks
    assert scheduler.forwards < sum(len(r.steps) for r in reqs)  # fewer forwards than requests' steps
    short = [prompt_ids(t) for t in ("Hi", "Oh", "Yes")]
    got, reqs = _run(scheduler, short)
    assert got == [Generator(lm).generate_ids(p, GREEDY) for p in short]
    assert max(max(r.steps) for r in reqs) == 3  # all three decode in one forward
    assert _all_pages_back(scheduler)
    if offload:
        assert lm.experts.counters.misses > 0


@pytest.mark.parametrize("offload", [False, True])
def test_a_short_prompt_beside_a_long_one_is_prefilled_in_the_first_step(model, offload):
    """Prefill tokens go to the prompts with the fewest left first, packed into one step: the short request's
    first token comes after one forward, the long prompt takes the rest of each step's tokens, and both get the
    tokens they would get alone."""
    lm = load_model(model, progress=False)
    long_prompt = prompt_ids(" ".join(TEXTS) * 2)
    short_prompt = prompt_ids("Hi")
    chunk = 8
    assert len(short_prompt) < chunk < len(long_prompt) - chunk
    expected = [Generator(lm).generate_ids(p, GREEDY) for p in (long_prompt, short_prompt)]
    if offload:
        if lm.moe_spec is None:
            pytest.skip("a dense model has no experts to offload")
        lm = load_model(model, progress=False, expert_cache=3 * lm.moe_spec.bytes_per_expert(torch.float32))
    scheduler = BatchScheduler(lm, prefill_chunk=chunk)
    first_token_step = {}
    out = [[], []]

    def emit(i):
        def on_event(ev):
            first_token_step.setdefault(i, scheduler.forwards)
            out[i].extend(ev.token_ids)
        return on_event

    reqs = [BatchRequest(p, GREEDY, emit=emit(i)) for i, p in enumerate((long_prompt, short_prompt))]
    for r in reqs:  # the long one arrives first
        scheduler.add(r)
    scheduler.step()
    assert first_token_step == {1: 1}  # the short prompt was answered by the first forward
    assert reqs[0].prefilled == chunk - len(short_prompt)  # the long one took the rest of that step's tokens
    while scheduler.active:
        scheduler.step()
    assert out == expected
    assert first_token_step[0] == -(-(len(long_prompt) + len(short_prompt)) // chunk)  # no step left tokens unused
    assert _all_pages_back(scheduler)


def test_a_cancelled_request_leaves_and_frees_its_pages(model):
    lm = load_model(model, progress=False)
    scheduler = BatchScheduler(lm)
    stop = {"now": False}
    events = []
    long_params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    scheduler.add(BatchRequest(prompt_ids(), long_params, emit=events.append, cancelled=lambda: stop["now"]))
    other = []
    scheduler.add(BatchRequest(prompt_ids("Hi"), GREEDY, emit=other.append))
    for _ in range(3):
        scheduler.step()
    stop["now"] = True
    dropped = scheduler.step()
    assert len(dropped) == 1 and len(events) < 50 and len(scheduler.active) == 1
    while scheduler.active:
        scheduler.step()
    assert other[-1].finish_reason == "length" and other[-1].completion_tokens == 10
    assert _all_pages_back(scheduler)


def test_a_full_kv_pool_ends_the_newest_request_only(model):
    lm = load_model(model, progress=False)
    scheduler = BatchScheduler(lm, kv_tokens=64, max_seq_len=64, page_size=4)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    first, second = [], []
    scheduler.add(BatchRequest(prompt_ids(), params, emit=first.append))
    scheduler.add(BatchRequest(prompt_ids(), params, emit=second.append))
    while scheduler.active:
        scheduler.step()
    assert isinstance(second[-1], KVCacheFull) and "--kv-cache" in str(second[-1])
    assert first[-1].finish_reason == "length"  # the older request ran to its end


def test_a_request_whose_sampling_fails_ends_alone(model):
    lm = load_model(model, progress=False)
    scheduler = BatchScheduler(lm)
    bad, good = [], []
    scheduler.add(BatchRequest(prompt_ids(), GREEDY, emit=bad.append))
    scheduler.add(BatchRequest(prompt_ids("Hi"), GREEDY, emit=good.append))

    def broken(logits):
        raise RuntimeError("sampling failed")

    scheduler.active[0].reply.accept = broken
    while scheduler.active:
        scheduler.step()
    assert isinstance(bad[-1], RuntimeError) and len(bad) == 1
    assert good[-1].finish_reason == "length" and good[-1].completion_tokens == 10


def test_held_events_go_out_after_the_next_steps_launch_in_order(model):
    """GPU path "emit-after-launch" (forced here: on the CPU no step is a graph replay): each step's events are
    handed out right after the next step's forward, every request's in order, the last ones when nothing is left
    to run, and the tokens are the same."""
    lm = load_model(model, progress=False)
    prompts = [prompt_ids(t) for t in TEXTS[:2]]
    expected = [Generator(lm).generate_ids(p, GREEDY) for p in prompts]
    scheduler = BatchScheduler(lm)
    scheduler._holds = lambda batch, tokens: True
    log = []
    forward = scheduler._forward
    scheduler._forward = lambda *a: log.append("F") or forward(*a)
    out = [[] for _ in prompts]

    def emit(i, ev):
        log.append(i)
        out[i].extend(ev.token_ids)

    for i, p in enumerate(prompts):
        scheduler.add(BatchRequest(p, GREEDY, emit=lambda ev, i=i: emit(i, ev)))
    while scheduler.active:
        scheduler.step()
    assert out == expected
    steps = GREEDY.max_tokens  # one prefill forward (both prompts) and a decode forward per token but the last
    assert log == ["F"] + ["F", 0, 1] * (steps - 1) + [0, 1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("offload", [False, True])
def test_on_cuda_batched_requests_get_their_own_tokens(model, offload):
    """The CUDA path: decode-only steps replay CUDA graphs (one request's, or a batch's: two, or three padded to
    four) on the scheduler's own up-front KV pool, steps with prefill chunks run eagerly, offloaded experts go
    through the copy stream."""
    lm = load_model(model, device="cuda", dtype=torch.float32, progress=False)
    prompts = [prompt_ids(t) for t in TEXTS]
    expected = [Generator(lm).generate_ids(p, GREEDY) for p in prompts]
    if offload:
        if lm.moe_spec is None:
            pytest.skip("a dense model has no experts to offload")
        lm = load_model(model, device="cuda", dtype=torch.float32, progress=False,
                        expert_cache=3 * lm.moe_spec.bytes_per_expert(torch.float32))
    scheduler = BatchScheduler(lm, prefill_chunk=4)
    assert scheduler.use_graphs
    got, _ = _run(scheduler, prompts, join_late=True)  # (4-token chunks: at most one request decodes at a time)
    assert got == expected
    scheduler.prefill_chunk = 512  # every prompt in the first step: then all decode together
    for n in (3, 2):
        together, _ = _run(scheduler, prompts[:n])
        assert together == expected[:n]
    assert {2, 4} <= {b for b, _ in scheduler._graphs.captured}
    alone, _ = _run(scheduler, prompts[:1])  # one request: its decode replays the graph
    assert alone == expected[:1]
    assert _all_pages_back(scheduler)
