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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("offload", [False, True])
def test_on_cuda_batched_requests_get_their_own_tokens(model, offload):
    """The CUDA path: one request decoding alone replays a CUDA graph (on the scheduler's own up-front KV pool),
    several share eager forwards, offloaded experts go through the copy stream."""
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
    got, _ = _run(scheduler, prompts, join_late=True)
    assert got == expected
    alone, _ = _run(scheduler, prompts[:1])  # one request: its decode replays the graph
    assert alone == expected[:1]
    assert _all_pages_back(scheduler)
