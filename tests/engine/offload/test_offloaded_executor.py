"""Offloaded experts are lossless: with a cache far smaller than the expert pool, greedy tokens equal the fully
resident run for every MoE family, and the hit/miss/eviction counts add up. On CPU the "device" side is the CPU."""

from __future__ import annotations

import pytest
import torch

from freetoken.engine.generator import Generator
from freetoken.engine.loader import attach_experts, load_model
from freetoken.engine.offload.executor import OffloadedExpertExecutor
from freetoken.engine.offload.path_guard import PathGuard
from freetoken.engine.offload.planner import MissPlanner
from freetoken.engine.sampling import SamplingParams
from support.checkpoints import PARITY_CASES, prompt_ids, write_hf_checkpoint
from support.offload_cases import EVEN_SPLIT, GREEDY, MOE_FAMILIES


@pytest.mark.parametrize("slots", [0, 3, 9])
@pytest.mark.parametrize("policy, miss_path", [("freq", "copy"), ("lru", "copy"), ("freq-admit", "copy"),
                                               ("freq", "cpu"), ("freq", "auto")])
def test_greedy_tokens_equal_the_resident_run(checkpoint, slots, policy, miss_path):
    path, resident, expected = checkpoint
    per_expert = resident.moe_spec.bytes_per_expert(torch.float32)
    lm = load_model(path, progress=False, expert_cache=slots * per_expert, expert_policy=policy)
    assert isinstance(lm.experts, OffloadedExpertExecutor) and lm.experts.cache.capacity == slots
    lm.experts.miss_path, lm.experts.planner = miss_path, EVEN_SPLIT()
    assert Generator(lm).generate_ids(prompt_ids(), GREEDY) == expected
    c, spec = lm.experts.counters, lm.moe_spec
    steps = 1 + GREEDY.max_tokens - 1  # the prefill and one decode step per token but the last
    assert c.hits + c.misses >= steps * len(spec.moe_layers)  # every step looks up ≥ 1 expert per layer
    copies = c.bytes_copied // per_expert
    assert copies + c.cpu_experts == c.misses  # every miss is exactly one copy or one CPU computation
    if miss_path == "cpu":
        assert copies == 0 and c.hits == 0 and not lm.experts.cache.slot_of  # the CPU path never fills the cache
    elif miss_path == "copy":
        assert c.cpu_experts == 0
    else:
        assert c.cpu_experts > 0 and copies > 0  # the planner used both paths
    if slots == 0:
        assert c.hits == 0 and c.evictions == 0  # everything streams through staging
    elif miss_path != "cpu":
        assert c.hits > 0 and c.evictions > 0 and len(lm.experts.cache.slot_of) == slots


@pytest.mark.parametrize("slots", [0, 3])
@pytest.mark.parametrize("miss_path", ["copy", "cpu", "auto"])
def test_the_gathered_decode_path_gives_the_resident_tokens(checkpoint, slots, miss_path):
    """Decode steps gather their experts' slots (cache, staging and the zero slot for CPU pairs) into one batched
    matmul; on CUDA that is the default for small batches, here it is switched on to check it on the CPU."""
    path, resident, expected = checkpoint
    per_expert = resident.moe_spec.bytes_per_expert(torch.float32)
    lm = load_model(path, progress=False, expert_cache=slots * per_expert)
    lm.experts.miss_path, lm.experts.gather_small_batches, lm.experts.planner = miss_path, True, EVEN_SPLIT()
    lm.experts.prefetch = True  # the CUDA default; off on CPU-only machines, where it overlaps nothing
    calls = []
    gathered = lm.experts._forward_gathered
    lm.experts._forward_gathered = lambda *a: calls.append(1) or gathered(*a)
    assert Generator(lm).generate_ids(prompt_ids(), GREEDY) == expected
    assert len(calls) == (GREEDY.max_tokens - 1) * len(lm.moe_spec.moe_layers)  # every decode step, no prefill
    c = lm.experts.counters
    copies = c.bytes_copied // per_expert
    assert c.layer_steps == len(calls) and c.host_seconds > 0  # the step-time breakdown the bench reports
    assert (c.cpu_wait_seconds > 0) == (miss_path != "copy") and c.gpu_wait_seconds > 0
    # the decode steps' CPU share is counted apart from the prefill's (the prompt's misses went to the CPU too)
    assert (c.step_cpu_experts > 0) == (c.step_cpu_seconds > 0) == (miss_path != "copy")
    assert c.step_cpu_experts < c.cpu_experts or miss_path == "copy"
    assert not any(t.abs().sum() for t in lm.experts.slots.weights_of(lm.experts.zero_slot))
    if miss_path == "cpu":  # nothing is copied, so nothing is prefetched
        assert c.prefetched == 0 and copies == 0
        return
    assert 0 < c.prefetch_used <= c.prefetched  # next-layer prefetch ran, and some predictions came true
    if slots:  # prefetched into cache slots: a used prefetch is a hit, every prefetch one extra copy
        assert copies + c.cpu_experts == c.misses + c.prefetched
    else:  # no cache: held in staging slots; a used one is still a miss, but needs no copy of its own
        assert c.hits == 0 and copies + c.cpu_experts == c.misses + c.prefetched - c.prefetch_used


class _EagerBoundaries:
    """Makes the executor's graph-boundary calls in the order a replayed CUDA-graph decode step makes them, but
    eagerly (CPU): the segment's routing copies, the host work (which replays the experts' "graph" after writing
    the slot map), then the next segment's head adding the CPU share. Prefill goes to the executor as usual."""

    capturable = False

    def __init__(self, executor: OffloadedExpertExecutor):
        self.executor, self.boundaries = executor, 0

    def forward(self, layer, hidden, topk_ids, topk_weights):
        ex = self.executor
        if hidden.shape[0] != 1:
            return ex.forward(layer, hidden, topk_ids, topk_weights)
        return self._boundary(layer, hidden, topk_ids, topk_weights)

    def _boundary(self, layer, hidden, topk_ids, topk_weights, rows=None):
        ex = self.executor
        ex.prepare_graph_io(hidden.shape[0])
        route = ex.capture_route(layer, hidden, topk_ids, topk_weights)
        gpu_share = []
        ex.run_boundary(route, lambda: gpu_share.append(ex.capture_experts(route)), rows)
        self.boundaries += 1
        return ex.capture_combine(route, gpu_share[0])


@pytest.mark.parametrize("slots", [0, 3])
@pytest.mark.parametrize("miss_path", ["copy", "cpu", "auto"])
@pytest.mark.parametrize("gpu_path", [None, "prefetch-early", "prefetch-with-cpu", "cpu-prewake", "cpu-first",
                                      "prefetch-lead", "cpu-tree-wake", "cpu-warm", "cpu-warm-owned"],
                         ids=["defaults", "prefetch-early", "prefetch-with-cpu", "cpu-prewake", "cpu-first",
                              "prefetch-lead", "cpu-tree-wake", "cpu-warm", "cpu-warm-owned"])
def test_the_graph_boundary_calls_give_the_resident_tokens(checkpoint, slots, miss_path, gpu_path, monkeypatch):
    """The calls CUDA-graph decode makes instead of `forward` (cuda_graphs.py), checked for numerics and
    bookkeeping on the CPU: same tokens, every miss copied or computed once, prefetches used; the prefetch
    queued at the next boundary, at the end of the host work (GPU path "prefetch-early") or while the CPU share
    runs ("prefetch-with-cpu"), sized with its head start over the CPU share ("prefetch-lead"); the CPU kernel's
    workers woken as a tree ("cpu-tree-wake"), or before each routing wait (GPU path "cpu-prewake"); the experts
    predicted for the CPU read into its caches ahead ("cpu-warm"), each by the worker that then computes it
    ("cpu-warm-owned"); the CPU share started before the copies (GPU path "cpu-first", on by default; the
    "defaults" row turns every path off, so it queues the copies first)."""
    from freetoken.engine import gpu_paths

    monkeypatch.setattr(gpu_paths, "enabled", lambda name: name == gpu_path)
    path, resident, expected = checkpoint
    per_expert = resident.moe_spec.bytes_per_expert(torch.float32)
    lm = load_model(path, progress=False, expert_cache=slots * per_expert)
    ex = lm.experts
    ex.miss_path, ex.planner, ex.prefetch = miss_path, EVEN_SPLIT(), True
    ex.MAX_LEAD_S = 60.0  # a slow machine's layer may take longer than a GPU's gap between a prefetch and its use
    driver = _EagerBoundaries(ex)
    attach_experts(lm.model, driver)
    try:
        assert Generator(lm).generate_ids(prompt_ids(), GREEDY) == expected
    finally:  # the kernel is the process's: owned rows ("cpu-warm-owned") stay off for other tests
        if ex.cpu.kernel is not None:
            ex.cpu.kernel.set_owned_rows(False)
    assert driver.boundaries == (GREEDY.max_tokens - 1) * len(lm.moe_spec.moe_layers)
    c = ex.counters
    assert c.layer_steps == driver.boundaries
    copies = c.bytes_copied // per_expert
    staged = 0 if slots else c.prefetch_used
    assert copies + c.cpu_experts == c.misses + c.prefetched - staged
    assert (c.cpu_experts > 0) == (miss_path != "copy") and (copies > 0) == (miss_path != "cpu")
    assert (c.prefetch_used > 0) == (miss_path != "cpu")
    if miss_path != "cpu":  # the lead is measured whenever a prefetch ran: from its queueing to its layer's routing
        assert 0 < ex.prefetch_lead_s < ex.MAX_LEAD_S
    if slots:  # a used prefetch into a cache slot is a hit whose copy was the step's own
        assert c.prefetch_hits == c.prefetch_used
    else:
        assert c.prefetch_hits == 0
    # "cpu-warm": the predicted experts the planner would give the CPU were read ahead (whether the CPU then ran
    # them depends on the predictions, which a random router makes badly)
    kernel = ex.cpu.kernel
    warms = gpu_path in ("cpu-warm", "cpu-warm-owned") and miss_path == "auto" and kernel is not None and \
        kernel.threads > 1
    assert (c.cpu_warmed > 0) == warms and c.cpu_warm_used <= c.cpu_warmed


class _PaddedEagerBoundaries(_EagerBoundaries):
    """The graph-boundary calls of a captured batched step replayed for fewer sequences than it was captured for:
    N decode rows padded to the next power of two, the padding rows routed to an expert that does not exist (any
    lookup, copy or CPU run of theirs would fail), the host work told that only the first N rows are real."""

    def forward(self, layer, hidden, topk_ids, topk_weights):
        from freetoken.engine.cuda_graphs import batch_size_for

        ex, n = self.executor, hidden.shape[0]
        batch = batch_size_for(n)
        if n == 1 or batch == n or not ex.graph_boundaries(batch):
            return ex.forward(layer, hidden, topk_ids, topk_weights)
        pad = batch - n
        hidden = torch.cat((hidden, hidden.new_zeros(pad, hidden.shape[1])))
        topk_ids = torch.cat((topk_ids, topk_ids.new_full((pad, topk_ids.shape[1]), ex.num_experts + 7)))
        topk_weights = torch.cat((topk_weights, topk_weights.new_zeros(pad, topk_weights.shape[1])))
        return self._boundary(layer, hidden, topk_ids, topk_weights, rows=n)[:n]


@pytest.mark.parametrize("miss_path", ["copy", "cpu", "auto"])
def test_padding_rows_of_a_batched_step_cost_no_expert_work(checkpoint, miss_path):
    """Three sequences decoding together through the calls a captured batch of four makes: each gets its own
    resident tokens and the padding row's (non-existent) experts are never touched."""
    from freetoken.engine.batching import BatchRequest, BatchScheduler

    path, resident, _ = checkpoint
    texts = ["The quick brown fox", "Hi", "A longer prompt with a few more words in it"]
    expected = [Generator(resident).generate_ids(prompt_ids(t), GREEDY) for t in texts]
    # prefill_ahead: a staging ring of two layers' experts, so four rows' pairs fit a gathered step
    lm = load_model(path, progress=False, expert_cache=3 * resident.moe_spec.bytes_per_expert(torch.float32),
                    prefill_ahead=True)
    ex = lm.experts
    ex.miss_path, ex.planner, ex.prefetch = miss_path, EVEN_SPLIT(), True
    ex.gather_small_batches = True  # the CUDA default, which two-phase boundaries need
    driver = _PaddedEagerBoundaries(ex)
    attach_experts(lm.model, driver)
    scheduler = BatchScheduler(lm)
    out = [[] for _ in texts]
    for i, t in enumerate(texts):
        scheduler.add(BatchRequest(prompt_ids(t), GREEDY, emit=lambda ev, i=i: out[i].extend(ev.token_ids)))
    while scheduler.active:
        scheduler.step()
    assert out == expected
    assert driver.boundaries >= (GREEDY.max_tokens - 2) * len(lm.moe_spec.moe_layers)  # the 3-row decode steps


@pytest.mark.parametrize("slots", [0, 3])
def test_every_way_the_path_guard_measures_gives_the_resident_tokens(checkpoint, slots):
    """`auto` with a learning planner: the guard times the decode layer-steps and sends windows of them down each
    pure path in turn (windows of 3 steps here); every way, and every change between them mid-token (prefetches
    planned by one way, arriving under another), is lossless and accounts for each miss once."""
    path, resident, expected = checkpoint
    per_expert = resident.moe_spec.bytes_per_expert(torch.float32)
    lm = load_model(path, progress=False, expert_cache=slots * per_expert)
    ex = lm.experts
    ex.miss_path, ex.planner, ex.prefetch = "auto", MissPlanner(20, 20), True
    ex.planner.guard = PathGuard(window=3, explore_every=1)
    driver = _EagerBoundaries(ex)
    attach_experts(lm.model, driver)
    assert Generator(lm).generate_ids(prompt_ids(), GREEDY) == expected
    assert set(ex.planner.guard.seconds_per_miss) == {"split", "cpu", "copy"}
    c = ex.counters
    copies = c.bytes_copied // per_expert
    assert copies + c.cpu_experts == c.misses + c.prefetched - (0 if slots else c.prefetch_used)


def test_the_path_guard_counts_a_prefetched_expert_as_the_miss_it_was(checkpoint):
    """With cache slots a prefetched expert is a hit by the time its layer runs, but its copy is still that
    step's cost: the guard's unit counts it, or the ways that prefetch (split, copy) look far dearer per miss
    than the CPU way, which does not prefetch (H200, 16 GiB: 0.7 against 5.6 misses a step, the CPU way kept at
    0.86x the split's speed)."""
    path, resident, expected = checkpoint
    per_expert = resident.moe_spec.bytes_per_expert(torch.float32)
    lm = load_model(path, progress=False, expert_cache=3 * per_expert)
    ex = lm.experts
    # a CPU that the split judges far too slow to use, and never learns otherwise, so the split (and the prefetch,
    # sized by it) copies every miss whatever this machine's CPU kernel does; the guard's cpu way still runs
    ex.miss_path, ex.planner, ex.prefetch = "auto", MissPlanner(20, 1e-3, learn=False), True
    seen = []  # at each observed step: the misses it reported, and cache misses + used prefetches so far

    class Recording(PathGuard):
        def observe(self, seconds: float, misses: int) -> None:
            seen.append((misses, ex.counters.misses + ex.counters.prefetch_used))
            super().observe(seconds, misses)

    ex.planner.guard = Recording(window=3, explore_every=1)
    attach_experts(lm.model, _EagerBoundaries(ex))
    assert Generator(lm).generate_ids(prompt_ids(), GREEDY) == expected
    assert ex.counters.prefetch_used > 0
    assert sum(m for m, _ in seen[1:]) == seen[-1][1] - seen[0][1]


def test_a_cache_holding_every_expert_misses_each_expert_once(checkpoint):
    path, resident, expected = checkpoint
    spec = resident.moe_spec
    lm = load_model(path, progress=False, expert_cache=spec.total_routed_experts * spec.bytes_per_expert(torch.float32))
    assert Generator(lm).generate_ids(prompt_ids(), GREEDY) == expected
    c = lm.experts.counters
    assert c.evictions == 0 and c.misses == len(lm.experts.cache.slot_of) <= spec.total_routed_experts


def test_resizing_while_serving_keeps_results_and_evicts_only_when_shrinking(checkpoint):
    path, resident, expected = checkpoint
    per_expert = resident.moe_spec.bytes_per_expert(torch.float32)
    lm = load_model(path, progress=False, expert_cache=6 * per_expert)
    gen = Generator(lm)
    assert gen.generate_ids(prompt_ids(), GREEDY) == expected
    cached = dict(lm.experts.cache.slot_of)
    lm.experts.resize(10)
    assert set(lm.experts.cache.slot_of) == set(cached)  # growing keeps everything
    assert gen.generate_ids(prompt_ids(), GREEDY) == expected
    lm.experts.resize(2)
    assert len(lm.experts.cache.slot_of) == 2
    assert gen.generate_ids(prompt_ids(), GREEDY) == expected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_on_cuda_pinned_host_experts_give_the_resident_tokens(family, tmp_path):
    write_hf_checkpoint(path=tmp_path, **PARITY_CASES[family])
    resident = load_model(tmp_path, device="cuda", dtype=torch.float32, progress=False)
    expected = Generator(resident).generate_ids(prompt_ids(), GREEDY)
    per_expert = resident.moe_spec.bytes_per_expert(torch.float32)
    lm = load_model(tmp_path, device="cuda", dtype=torch.float32, progress=False, expert_cache=4 * per_expert)
    host = next(iter(lm.experts.host.values()))
    assert host.gate_proj.is_pinned() and lm.experts.slots.gate_proj.is_cuda
    lm.experts.miss_path = "copy"  # every miss through the cache first (auto's split depends on this machine)
    gen = Generator(lm)
    assert gen.use_graphs  # captured in segments cut at each expert call (host-side routing runs eagerly)
    assert gen.generate_ids(prompt_ids(), GREEDY) == expected
    entry = next(iter(gen._graphs.captured.values()))
    assert len(entry.graphs) == len(entry.boundaries) + 1 == len(lm.moe_spec.moe_layers) + 1
    assert all(b.route is not None and b.experts_graph is not None for b in entry.boundaries)  # two-phase
    assert lm.experts.counters.evictions > 0
    for miss_path in ("cpu", "auto"):
        lm.experts.miss_path = miss_path
        assert gen.generate_ids(prompt_ids(), GREEDY) == expected
    lm.experts.resize(2)  # new slot tensors: the graphs that read the old ones are captured again
    assert gen.generate_ids(prompt_ids(), GREEDY) == expected
    assert next(iter(gen._graphs.captured.values())).slots_version == lm.experts.slots_version == 1


@pytest.mark.parametrize("gather", [False, True])
def test_without_the_native_kernel_the_cpu_path_falls_back_to_torch(checkpoint, gather):
    """No C compiler (or FREETOKEN_CPU_KERNEL=0): CPU misses run through torch on the host weights, same tokens."""
    path, resident, expected = checkpoint
    lm = load_model(path, progress=False, expert_cache=0)
    lm.experts.miss_path, lm.experts.gather_small_batches = "cpu", gather
    lm.experts.cpu.kernel = None
    assert not lm.experts.cpu.uses_kernel
    assert Generator(lm).generate_ids(prompt_ids(), GREEDY) == expected
    assert lm.experts.counters.cpu_experts == lm.experts.counters.misses > 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU"))])
def test_a_pinned_layer_stays_on_the_device_and_the_tokens_stay_the_residents(device, tmp_path):
    """`pin_layer` (the dashboard's pin key): every expert of the layer copied into a slot, exactly the host's
    weights, kept there through decode while the other layers take turns in the slots left; unpinned, they go."""
    write_hf_checkpoint(path=tmp_path, **PARITY_CASES["qwen3_moe"])
    resident = load_model(tmp_path, device=device, dtype=torch.float32, progress=False)
    expected = Generator(resident).generate_ids(prompt_ids(), GREEDY)
    spec = resident.moe_spec
    lm = load_model(tmp_path, device=device, dtype=torch.float32, progress=False,
                    expert_cache=(spec.num_experts + 2) * spec.bytes_per_expert(torch.float32))
    layer, cache = spec.moe_layers[-1], lm.experts.cache
    keys = {(layer, e) for e in range(spec.num_experts)}
    assert lm.experts.pin_layer(layer, spec.num_experts, True) == spec.num_experts
    for e in range(spec.num_experts):
        copied = lm.experts.slots.weights_of(cache.slot_of[(layer, e)])
        for d, s in zip(copied, lm.experts.host[layer].weights_of(e), strict=True):
            assert torch.equal(d.cpu(), s.cpu())
    assert Generator(lm).generate_ids(prompt_ids(), GREEDY) == expected
    assert keys <= set(cache.slot_of)
    with pytest.raises(ValueError, match="pinned"):
        lm.experts.resize(spec.num_experts - 1)
    lm.experts.pin_layer(layer, spec.num_experts, False)
    lm.experts.resize(1)
    assert len(cache.slot_of) == 1
    assert Generator(lm).generate_ids(prompt_ids(), GREEDY) == expected


def test_a_prefetch_into_a_full_cache_admits_every_prediction_that_fits(tmp_path):
    """The frequency policy (the default) ranks a freshly admitted expert coldest, so each prediction a prefetch
    admitted used to evict the one admitted just before: one prefetched expert a layer-step whatever the
    prediction (H200, D1 at 8-16 GiB: 47 prefetches a token over 48 layers, 190 with no cache)."""
    write_hf_checkpoint(path=tmp_path, **PARITY_CASES["qwen3_moe"])
    per_expert = load_model(tmp_path, progress=False).moe_spec.bytes_per_expert(torch.float32)
    lm = load_model(tmp_path, progress=False, expert_cache=6 * per_expert, expert_policy="freq")
    ex = lm.experts
    ex.miss_path = "copy"
    Generator(lm).generate_ids(prompt_ids(), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert len(ex.cache.slot_of) == 6
    layer = lm.moe_spec.moe_layers[0]
    uncached = [e for e in range(8) if (layer, e) not in ex.cache.slot_of][:3]
    before = ex.counters.prefetched
    ex._prefetch(layer, set(uncached), room=0)
    assert ex.counters.prefetched - before == 3 and all((layer, e) in ex.cache.slot_of for e in uncached)


@pytest.mark.parametrize("waits", [False, True])
def test_a_gpu_process_sizes_the_cpu_kernel_around_its_driving_thread(waits, monkeypatch):
    """`gpu_host_kernel`: by default one core is left to the thread that drives the GPU, which runs tasks while it
    waits; GPU path "cpu-caller-waits" gives the pool that core's worker and tells the kernel the caller only
    waits."""
    from freetoken.engine import gpu_paths
    from freetoken.engine.offload import cpu_experts

    asked, told = [], []

    class Kernel:
        def set_caller_joins(self, joins):
            told.append(joins)
            return True

    monkeypatch.setattr(gpu_paths, "enabled", lambda name: waits and name == "cpu-caller-waits")
    monkeypatch.setattr(cpu_experts.CpuExpertKernel, "get", lambda threads=None: asked.append(threads) or Kernel())
    monkeypatch.setenv("FREETOKEN_CPU_THREADS", "16")
    assert isinstance(cpu_experts.gpu_host_kernel(), Kernel)
    assert asked == [16 if waits else 15] and told == [not waits]
