"""Offloaded prefill is lossless: long chunks streaming the next layer's experts ahead, short chunks (an agent's
next turn) streaming too, chunks that fill free cache slots but evict nothing, each with the resident logits; and
what a chunk tells the planners and the path guard. On CPU the "device" side is the CPU."""

from __future__ import annotations

import pytest
import torch

from freetoken.engine.generator import Generator
from freetoken.engine.loader import load_model
from freetoken.engine.offload.executor import OffloadedExpertExecutor
from freetoken.engine.offload.planner import MissPlanner
from freetoken.engine.sampling import SamplingParams
from support.checkpoints import PARITY_CASES, prompt_ids, write_hf_checkpoint
from support.offload_cases import EVEN_SPLIT


@pytest.mark.parametrize("slots", [0, 6, 64])  # none, fewer than a layer's experts, every expert
@pytest.mark.parametrize("miss_path", ["copy", "auto"])
@pytest.mark.parametrize("sorted_pass", [False, True])
@pytest.mark.parametrize("batches", ["one", "ahead-batches", "ahead-wide"])
def test_prefill_streaming_the_next_layers_experts_ahead_gives_the_same_logits(checkpoint, slots, miss_path,
                                                                               sorted_pass, batches, monkeypatch):
    """With `prefill_ahead`, a long chunk copies each next layer's experts (those the cache lacks: into free cache
    slots, else staging) while this layer computes; that layer computes them from there, the rest releases.
    `sorted_pass`: a layer with no miss left runs as one sorted grouped-matmul pass over the slots (Hopper's path,
    here through torch's CPU fallback). `batches`: one expert a batch, GPU path "ahead-batches" (AHEAD_BATCH experts
    a batch) or "ahead-wide" with it (AHEAD_WIDE: here a whole layer a batch)."""
    from freetoken.engine.offload import prefill

    monkeypatch.setattr(prefill, "grouped_mm_available", lambda hidden: sorted_pass)
    on = {"prefill-ahead", *{"one": (), "ahead-batches": ("ahead-batches",),
                             "ahead-wide": ("ahead-batches", "ahead-wide")}[batches]}
    monkeypatch.setattr(prefill.gpu_paths, "enabled", lambda name: name in on)
    path, resident, _ = checkpoint
    per_expert = resident.moe_spec.bytes_per_expert(torch.float32)
    lm = load_model(path, progress=False, expert_cache=slots * per_expert, prefill_ahead=True)
    ex = lm.experts
    assert ex.prefill_ahead and ex.copier.staging_slots == 2 * ex.num_experts
    ex.miss_path, ex.planner = miss_path, EVEN_SPLIT()
    ex.CPU_MAX_TOKENS = 4  # so that `auto` streams ahead chunks of this tiny model's size
    ex.AHEAD_BATCH = 2  # below this tiny model's experts a layer, so that "ahead-wide" batches are the larger
    assert ex.num_experts > ex.AHEAD_BATCH
    chunk = max(ex.PREFILL_TOKENS, ex.num_experts * max(ex.AHEAD_TOKENS_PER_EXPERT, ex.CPU_MAX_TOKENS) // ex._top_k)
    ids = torch.randint(0, resident.args.decoder.vocab_size, (3 * chunk,),
                        generator=torch.Generator().manual_seed(2)).tolist()
    batch_sizes = []  # experts per batch streamed ahead
    for name in ("to_slots_marked", "to_staging_batch"):
        issue = getattr(ex.copier, name)
        monkeypatch.setattr(ex.copier, name, lambda layer, experts, *a, issue=issue: batch_sizes.append(len(experts))
                            or issue(layer, experts, *a))
    expected = resident.prefill_logits(ids)
    cache = lm.new_cache(page_size=4)
    seq = cache.new_sequence()
    got = []
    with torch.inference_mode():
        for start in range(0, len(ids), chunk):
            got.append(lm.forward(torch.tensor(ids[start:start + chunk]), cache, seq))
    torch.testing.assert_close(torch.cat(got), expected, atol=1e-5, rtol=1e-5)
    c, layers = ex.counters, len(lm.moe_spec.moe_layers)
    assert 0 < c.prefetch_used <= c.prefetched  # streamed ahead, and then used
    if slots == 0:  # each chunk streams every layer after the first whole; only its first layer copies on a miss
        assert c.prefetched == 3 * (layers - 1) * ex.num_experts
        assert c.prefetched * ex.expert_bytes < c.bytes_copied <= (c.prefetched + 3 * ex.num_experts) * ex.expert_bytes
    assert c.evictions == 0
    assert ex._chunk_ahead is None  # the last layer streams nothing ahead
    wide = min(ex.num_experts, ex.AHEAD_WIDE, ex.AHEAD_WIDE_BYTES // ex.expert_bytes)
    assert max(batch_sizes) == {"one": 1, "ahead-batches": ex.AHEAD_BATCH, "ahead-wide": wide}[batches]


@pytest.mark.parametrize("slots", [0, 6])
@pytest.mark.parametrize("with_cpu", [False, True], ids=["link-only", "short-chunks-cpu"])
@pytest.mark.parametrize("sorted_pass", [False, True])
def test_short_chunks_stream_ahead_under_the_gpu_path(checkpoint, slots, with_cpu, sorted_pass, monkeypatch):
    """GPU path "stream-short-chunks" (on by default): in `auto`, a chunk with too few tokens for the long-chunk
    rule (its experts would be split between copies and the CPU) but enough to route to nearly every expert copies
    all its misses and streams each next layer ahead; the logits stay the resident ones and the CPU takes none.
    With "short-chunks-cpu" only the planner's copy share of each next layer streams ahead, and the CPU computes
    part of what is left when the layer routes: the same logits, and the CPU's share counted. `sorted_pass`: a
    layer with nothing left to copy runs its device share as one sorted pass (Hopper's path, here through torch's
    CPU fallback), the CPU's experts pointing at the zero slot."""
    path, resident, _ = checkpoint
    _check_short_chunks(path, resident, slots, with_cpu, sorted_pass, monkeypatch)


@pytest.mark.parametrize("sorted_pass", [False, True])
def test_short_chunks_cpu_share_adds_no_bias_twice(tmp_path, sorted_pass, monkeypatch):
    """"short-chunks-cpu" on a family whose experts have biases (gpt-oss): the CPU adds its experts' biases, so
    the device's pass over the same layer must add none for them (their pairs take the zero bias row)."""
    write_hf_checkpoint("gpt_oss", tmp_path)
    resident = load_model(tmp_path, device="cpu", dtype=torch.float32, progress=False)
    # (its logits are larger: 1e-5 absolute is at fp32's summation-order noise there; a bias added twice is not)
    _check_short_chunks(tmp_path, resident, 0, True, sorted_pass, monkeypatch, tolerance=1e-4, dtype=torch.float32)


def _check_short_chunks(path, resident, slots, with_cpu, sorted_pass, monkeypatch, tolerance=1e-5, **load):
    from freetoken.engine.offload import prefill

    on = {"stream-short-chunks", "short-chunks-cpu"} if with_cpu else {"stream-short-chunks"}
    monkeypatch.setattr(prefill.gpu_paths, "enabled", lambda name: name in on)
    monkeypatch.setattr(prefill, "grouped_mm_available", lambda hidden: sorted_pass)
    per_expert = resident.moe_spec.bytes_per_expert(torch.float32)
    lm = load_model(path, progress=False, expert_cache=slots * per_expert, prefill_ahead=True, **load)
    ex = lm.experts
    ex.miss_path, ex.planner = "auto", EVEN_SPLIT()
    chunk = max(ex.PREFILL_TOKENS, ex.num_experts * ex.AHEAD_TOKENS_PER_EXPERT // ex._top_k)
    assert chunk * ex._top_k / ex.num_experts < ex.CPU_MAX_TOKENS  # short: the default rule would split it
    ids = torch.randint(0, resident.args.decoder.vocab_size, (2 * chunk,),
                        generator=torch.Generator().manual_seed(3)).tolist()
    expected = resident.prefill_logits(ids)
    cache = lm.new_cache(page_size=4)
    seq = cache.new_sequence()
    sorted_layers = []  # one entry per layer that took the sorted pass
    if sorted_pass:
        compute_sorted = ex._compute_sorted
        monkeypatch.setattr(ex, "_compute_sorted", lambda hidden, *a: sorted_layers.append(hidden.shape[0])
                            or compute_sorted(hidden, *a))
    with torch.inference_mode():
        got = [lm.forward(torch.tensor(ids[s:s + chunk]), cache, seq) for s in range(0, len(ids), chunk)]
    torch.testing.assert_close(torch.cat(got), expected, atol=tolerance, rtol=tolerance)
    c = ex.counters
    assert (c.cpu_experts > 0) == with_cpu and 0 < c.prefetch_used <= c.prefetched and c.evictions == 0
    if with_cpu:  # the layers after each chunk's first streamed only part of their missing experts ahead
        assert c.prefetched < 2 * (len(lm.moe_spec.moe_layers) - 1) * ex.num_experts
    if sorted_pass:  # every layer after a chunk's first had all its device share streamed: one pass each
        assert len(sorted_layers) == 2 * (len(lm.moe_spec.moe_layers) - 1)
    monkeypatch.setattr(prefill.gpu_paths, "enabled", lambda name: False)  # off: the same chunk is split
    fresh = lm.new_cache(page_size=4)
    with torch.inference_mode():
        lm.forward(torch.tensor(ids[:chunk]), fresh, fresh.new_sequence())
    assert ex.counters.cpu_experts > 0


@pytest.mark.parametrize("miss_path", ["copy", "auto"])
def test_prefill_chunks_fill_free_slots_but_evict_nothing(checkpoint, miss_path):
    """A prefill chunk (≥ PREFILL_TOKENS tokens) touches nearly every expert once: it takes free cache slots,
    streams the rest, and leaves what the cache held in place, so the next chunk hits it. In `auto`, misses of a
    chunk are split between copies and the CPU (tens of tokens per expert) with the resident logits."""
    path, resident, _ = checkpoint
    per_expert = resident.moe_spec.bytes_per_expert(torch.float32)
    lm = load_model(path, progress=False, expert_cache=4 * per_expert)
    ex = lm.experts
    ex.miss_path, ex.planner = miss_path, EVEN_SPLIT()
    chunk = ex.PREFILL_TOKENS
    ids = torch.randint(0, resident.args.decoder.vocab_size, (2 * chunk,),
                        generator=torch.Generator().manual_seed(0)).tolist()
    expected = resident.prefill_logits(ids)
    cache = lm.new_cache(page_size=4)
    seq = cache.new_sequence()
    with torch.inference_mode():
        first = lm.forward(torch.tensor(ids[:chunk]), cache, seq)
        held, hits = dict(ex.cache.slot_of), ex.counters.hits
        second = lm.forward(torch.tensor(ids[chunk:]), cache, seq)
    torch.testing.assert_close(torch.cat([first, second]), expected, atol=1e-5, rtol=1e-5)
    c = ex.counters
    assert len(held) == 4 and c.evictions == 0 and ex.cache.slot_of == held
    assert c.hits - hits >= 4  # the second chunk found every expert the first one left in the cache
    if miss_path == "auto":
        assert c.cpu_experts > 0 and c.bytes_copied > 0


def test_prefill_chunks_teach_the_prefill_planner_not_the_decode_one(checkpoint):
    """A chunk's copies are paced by its staging ring and compute: their timings (and its CPU work) feed the
    prefill planner's models; the decode planner's link model only learns from decode-sized steps."""
    path, resident, _ = checkpoint
    lm = load_model(path, progress=False, expert_cache=0)
    ex = lm.experts
    ex.planner = MissPlanner(20, 20)  # learning
    ids = torch.randint(0, resident.args.decoder.vocab_size, (ex.PREFILL_TOKENS,),
                        generator=torch.Generator().manual_seed(1)).tolist()
    cache = lm.new_cache(page_size=4)
    with torch.inference_mode():
        lm.forward(torch.tensor(ids), cache, cache.new_sequence())
        ex.forward(0, torch.zeros(1, resident.args.decoder.hidden_size), torch.zeros(1, 1, dtype=torch.long),
                   torch.ones(1, 1))  # collects the last layer's copy timings
    prefill = ex.prefill_planner()
    assert prefill is not ex.planner and prefill.copy is not ex.planner.copy
    assert prefill.copy.samples > 0 and ex.planner.copy.samples == 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU"))])
def test_a_chunks_activations_reach_the_host_as_the_same_fp32_values(device):
    """The prefill CPU share's input: fp32 on the host, bf16 widened exactly. On CUDA the widening runs on the
    device (a blocking copy that changes the dtype widens on the host, where a chunk's >32k values wake torch's
    OpenMP pool, whose threads then spin on the CPU expert kernel's cores)."""
    from freetoken.engine.offload.cpu_experts import HOST_OP_MAX_VALUES, to_host_fp32

    hidden = torch.randn(64, 2048, device=device).bfloat16()
    assert hidden.numel() > HOST_OP_MAX_VALUES
    x = to_host_fp32(hidden)
    assert x.device.type == "cpu" and x.dtype == torch.float32 and x.is_contiguous()
    assert torch.equal(x, hidden.cpu().float())
    fp32 = torch.randn(3, 8, device=device)
    assert torch.equal(to_host_fp32(fp32), fp32.cpu())


@pytest.mark.parametrize("disabled", [False, True])
def test_a_prefill_chunk_rests_the_path_guard_unless_disabled(tmp_path, monkeypatch, disabled):
    """GPU path "guard-rest" (on by default): a chunk of PREFILL_TOKENS or more between decode steps drops the
    guard's window in progress and leaves the next one unmeasured; disabled, the guard only sees decode steps."""
    from freetoken.engine import gpu_paths

    def fresh():
        gpu_paths.enabled.cache_clear()
        gpu_paths._named.cache_clear()

    monkeypatch.setenv("FREETOKEN_DISABLE", "guard-rest" if disabled else "")
    fresh()
    try:
        write_hf_checkpoint(path=tmp_path, **PARITY_CASES["qwen3_moe"])
        spec = load_model(tmp_path, progress=False).moe_spec
        lm = load_model(tmp_path, progress=False, expert_cache=3 * spec.bytes_per_expert(torch.float32))
        rests = []
        monkeypatch.setattr(lm.experts.planner.guard, "rest", lambda: rests.append(1))
        prompt = (prompt_ids() * 8)[:OffloadedExpertExecutor.PREFILL_TOKENS]
        Generator(lm).generate_ids(prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        assert len(rests) == (0 if disabled else len(spec.moe_layers))  # each MoE layer of the one prefill chunk
    finally:
        monkeypatch.delenv("FREETOKEN_DISABLE")
        fresh()
