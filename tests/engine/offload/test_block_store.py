"""The block store: quantized experts kept in their block format on the device, behind the dequantized slots.

On the CPU the "device" is the host, so the store's rows are host tensors and dequantization is the plain-torch
reference; the bookkeeping, the paths through it and the tokens are the same as on CUDA, where the fused launch
reads the rows (the CUDA cases below).
"""

from __future__ import annotations

import time

import pytest
import torch

from freetoken.engine.generator import Generator
from freetoken.engine.loader import load_model
from freetoken.engine.offload.block_store import BlockStore
from freetoken.engine.offload.budget import split_expert_budget
from freetoken.engine.offload.planner import MissPlanner
from freetoken.engine.sampling import SamplingParams
from freetoken.engine.stats import snapshot
from support.checkpoints import PARITY_CASES, prompt_ids, write_gguf_from_hf, write_hf_checkpoint
from support.offload_cases import EVEN_SPLIT
from support.servers import start_server

try:
    import httpx2 as httpx
except ImportError:
    import httpx

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def q8_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("block-store")
    write_hf_checkpoint(path=path / "hf", **PARITY_CASES["qwen3_moe"])
    return write_gguf_from_hf(path / "hf", path / "m.gguf", tensor_type="Q8_0")


@pytest.fixture(scope="module")
def expected(q8_gguf):
    return Generator(load_model(q8_gguf, progress=False)).generate_ids(prompt_ids(), GREEDY)


def _offloaded(gguf, slots: int, rows: int, device: str = "cpu", **load):
    """The model with `slots` dequantized slots and `rows` block-store rows (byte budget and share to match)."""
    resident_spec = load_model(gguf, progress=False, device=device, dtype=torch.float32, expert_cache=0).moe_spec
    slot_bytes, row_bytes = resident_spec.bytes_per_expert(torch.float32), resident_spec.bytes_per_expert("Q8_0")
    budget = slots * slot_bytes + rows * row_bytes
    share = rows * row_bytes / budget if budget else 0.0
    lm = load_model(gguf, progress=False, device=device, dtype=torch.float32, expert_cache=budget, block_share=share,
                    **load)
    assert lm.experts.cache.capacity == slots and (lm.experts.copier.store is None) == (rows == 0)
    if rows:
        assert lm.experts.copier.store.capacity == rows
    return lm


def test_rows_are_placed_held_and_kept_through_a_resize():
    store = BlockStore(3, 10, torch.device("cpu"))
    assert store.place(0, [4, 5], evict=True) == [(0, True), (1, True)]  # new: bytes from the host
    store.rows[0].fill_(4)
    store.rows[1].fill_(5)
    assert store.place(0, [5, 6], evict=True) == [(1, False), (2, True)]  # 5 is read from its row
    # full: a prefill chunk (evict=False) takes free rows only; decode gives one up, never one this batch reads
    assert store.place(1, [0], evict=False) == [(None, True)]
    placed = store.place(0, [4, 7], evict=True)
    assert placed[0] == (0, False) and placed[1][1] and placed[1][0] in (1, 2)
    assert store.holds((0, 4)) and store.holds((0, 7))
    kept = {key: bytes(store.rows[row][:1].tolist()) for key, row in store.cache.slot_of.items()}
    store.resize(2)  # the coldest goes, the survivors' bytes move with them
    assert len(store.cache.slot_of) == 2 and store.rows.shape == (2, 10)
    for key, row in store.cache.slot_of.items():
        assert bytes(store.rows[row][:1].tolist()) == kept[key]
    with pytest.raises(ValueError, match="at least one row"):
        store.resize(0)


def test_the_budget_splits_between_slots_and_block_rows():
    assert split_expert_budget(1000, 0.0, 100, 53, 50) == (10, 0)
    assert split_expert_budget(1000, 1.0, 100, 53, 50) == (0, 18)
    assert split_expert_budget(1000, 0.5, 100, 53, 50) == (5, 9)  # 9 rows of 53 bytes, 523 bytes left for slots
    assert split_expert_budget(1000, 0.5, 100, None, 50) == (10, 0)  # dense experts: no block format to keep
    assert split_expert_budget(10**9, 1.0, 100, 53, 50) == (0, 50)  # never more than every expert
    with pytest.raises(ValueError, match="from 0 to 1"):
        split_expert_budget(1000, 1.5, 100, 53, 50)


@pytest.mark.parametrize("gathered", [False, True])
@pytest.mark.parametrize("miss_path", ["copy", "cpu", "auto"])
@pytest.mark.parametrize("slots,rows", [(0, 6), (2, 5)])
def test_experts_from_the_block_store_give_the_resident_tokens(q8_gguf, expected, gathered, miss_path, slots, rows):
    """Slot misses the store holds are dequantized from its rows (never over the link, never on the CPU); the
    others cross the link (or go to the CPU) as without a store. Every miss is one of the three."""
    lm = _offloaded(q8_gguf, slots, rows)
    ex = lm.experts
    ex.miss_path, ex.gather_small_batches = miss_path, gathered
    ex.planner = EVEN_SPLIT()
    assert Generator(lm).generate_ids(prompt_ids(), GREEDY) == expected
    c, per_expert = ex.counters, ex.expert_bytes
    assert c.bytes_copied // per_expert + c.store_hits + c.cpu_experts == c.misses
    if miss_path == "cpu":
        assert c.store_hits == 0 and c.bytes_copied == 0 and not ex.copier.store.cache.slot_of
    else:
        assert c.store_hits > 0 and len(ex.copier.store.cache.slot_of) == rows


def test_a_store_holding_every_expert_ends_the_link_traffic(q8_gguf, expected):
    total = load_model(q8_gguf, progress=False, expert_cache=0).moe_spec.total_routed_experts
    lm = _offloaded(q8_gguf, 1, total)
    ex = lm.experts
    ex.miss_path = "copy"
    assert Generator(lm).generate_ids(prompt_ids(), GREEDY) == expected
    copied, samples = ex.counters.bytes_copied, (ex.planner.copy.samples, ex.prefill_planner().copy.samples)
    assert Generator(lm).generate_ids(prompt_ids(), GREEDY) == expected
    assert ex.counters.bytes_copied == copied  # the second run read every expert from the store
    # and taught the planners nothing about the link: store hits are no link samples
    assert (ex.planner.copy.samples, ex.prefill_planner().copy.samples) == samples
    stats = snapshot(lm).experts
    assert stats.block_rows == stats.block_cached == lm.moe_spec.total_routed_experts
    assert stats.store_hits == ex.counters.store_hits > 0 and set("".join(stats.grid)) == {"#"}


def test_a_prediction_the_store_serves_is_counted_once_and_not_as_link_traffic(q8_gguf, expected):
    """Next-layer prefetch from the store: the expert becomes a hit of its step (not a store hit as well), and
    no prefetch hit (those are counted as link bytes by the decode floor)."""
    total = load_model(q8_gguf, progress=False, expert_cache=0).moe_spec.total_routed_experts
    lm = _offloaded(q8_gguf, 4, total)  # room for a step's two experts and the next layer's two predicted
    ex = lm.experts
    ex.miss_path, ex.prefetch, ex.gather_small_batches = "copy", True, True  # the CUDA defaults
    assert Generator(lm).generate_ids(prompt_ids(), GREEDY) == expected  # fills the store
    c = ex.counters
    before = (c.hits, c.misses, c.store_hits, c.prefetched, c.prefetch_hits, c.bytes_copied)
    assert Generator(lm).generate_ids(prompt_ids(), GREEDY) == expected
    hits, misses, store_hits, prefetched, prefetch_hits, copied = (
        b - a for a, b in zip(before, (c.hits, c.misses, c.store_hits, c.prefetched, c.prefetch_hits,
                                       c.bytes_copied), strict=True))
    assert copied == 0 and prefetched > 0 and hits > 0
    assert store_hits == misses and prefetch_hits == 0


def test_a_link_sample_times_only_the_experts_that_crossed_it(q8_gguf, monkeypatch):
    """The store hits' dequantizing comes before a batch's timing starts: inside it, a batch of hits and fetches
    read as a slow link to the planner."""
    copier = _offloaded(q8_gguf, 2, 4).experts.copier
    dest, layer = copier.allocate(2), next(iter(copier.host))
    copier.begin()
    copier.to_slots(layer, [0], dest, [0])
    copier.end()
    copier.finished_timings()
    slow = copier._rows_into_slots

    def slow_hits(*args):
        time.sleep(0.2)
        slow(*args)

    monkeypatch.setattr(copier, "_rows_into_slots", slow_hits)
    copier.begin()
    copier.to_slots(layer, [0, 1], dest, [0, 1])  # expert 0 from its row, expert 1 over the link
    copier.end()
    [(nbytes, seconds, sample, _)] = copier.finished_timings()
    assert nbytes == copier.expert_bytes and sample and seconds < 0.1
    assert copier.counters.store_hits == 1


def test_a_short_chunk_streams_what_the_store_holds_and_leaves_the_cpu_only_link_misses(q8_gguf, monkeypatch):
    """GPU path "short-chunks-cpu" over a block store: of each next layer's missing experts, the CPU's share is
    taken from those whose bytes cross the link only. Those the store holds stream ahead (a dequantization from
    device memory); left to the CPU they came back at routing as store reads, and the layer lost its one sorted
    pass for the per-expert path. The planner here is one that gives the CPU every miss it may take."""
    from freetoken.engine.offload import prefill

    monkeypatch.setattr(prefill.gpu_paths, "enabled", lambda name: name in {"stream-short-chunks", "short-chunks-cpu"})
    monkeypatch.setattr(prefill, "grouped_mm_available", lambda hidden: True)
    lm = _offloaded(q8_gguf, 0, 12, prefill_ahead=True)  # 16 experts in two MoE layers (0 and 2), 12 rows
    ex, (first, last) = lm.experts, lm.moe_spec.moe_layers
    ex.planner = MissPlanner(1, 1000, copy_fixed_s=0, cpu_fixed_s=0, learn=False)  # the CPU far faster
    chunk = max(ex.PREFILL_TOKENS, ex.num_experts * ex.AHEAD_TOKENS_PER_EXPERT // ex._top_k)
    ids = torch.randint(0, lm.args.decoder.vocab_size, (3 * chunk,),
                        generator=torch.Generator().manual_seed(3)).tolist()
    expected = load_model(q8_gguf, progress=False, dtype=torch.float32).prefill_logits(ids)
    per_expert_layers = []
    copy_and_compute = ex._copy_and_compute
    monkeypatch.setattr(ex, "_copy_and_compute", lambda layer, *a, **k: per_expert_layers.append(layer)
                        or copy_and_compute(layer, *a, **k))
    cache = lm.new_cache(page_size=4)
    seq = cache.new_sequence()
    got = []
    with torch.inference_mode():
        ex.miss_path = "copy"  # the first chunk streams everything: the store's free rows take layer 2's first 4
        got.append(lm.forward(torch.tensor(ids[:chunk]), cache, seq))
        stored = {e for e in range(ex.num_experts) if ex.copier.stored(last, e)}
        assert len(stored) == 4
        ex.miss_path, per_expert_layers[:] = "auto", []
        cpu_before, hits_before = ex.counters.cpu_experts, ex.counters.store_hits
        got += [lm.forward(torch.tensor(ids[s:s + chunk]), cache, seq) for s in (chunk, 2 * chunk)]
    torch.testing.assert_close(torch.cat(got), expected, atol=1e-4, rtol=1e-4)
    assert last not in per_expert_layers and first in per_expert_layers  # (the first is streamed by nothing)
    assert ex.counters.cpu_experts - cpu_before >= 2 * (ex.num_experts - len(stored))  # each chunk: every link miss
    assert ex.counters.store_hits - hits_before >= 2 * len(stored)


def test_a_prefill_chunk_fills_free_rows_but_evicts_none(q8_gguf):
    lm = _offloaded(q8_gguf, 0, 4)
    ex = lm.experts
    ex.miss_path = "copy"
    ids = torch.randint(0, lm.args.decoder.vocab_size, (ex.PREFILL_TOKENS * 2,),
                        generator=torch.Generator().manual_seed(0)).tolist()
    lm.prefill_logits(ids)
    store = ex.copier.store.cache
    assert len(store.slot_of) == 4 and store.counters.evictions == 0


def test_dense_experts_refuse_a_block_store(tmp_path):
    write_hf_checkpoint(path=tmp_path / "hf", **PARITY_CASES["qwen3_moe"])
    lm = load_model(tmp_path / "hf", progress=False, expert_cache=10**6, block_share=1.0)
    assert lm.experts.copier.store is None and lm.experts.cache.capacity > 0  # the whole budget as slots
    from freetoken.engine.offload.transfer import ExpertCopier

    with pytest.raises(ValueError, match="these experts are dense"):
        ExpertCopier(lm.experts.host, torch.device("cpu"), torch.float32, store_rows=3)


def test_the_block_store_resizes_while_serving(q8_gguf):
    lm = _offloaded(q8_gguf, 2, 4)
    row_bytes = lm.experts.expert_bytes
    server = start_server(lm, "tiny")
    try:
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                "temperature": 0}
        before = httpx.post(f"{server.url}/v1/chat/completions", json=chat).json()["choices"][0]["message"]
        budget = 20 * row_bytes
        r = httpx.post(f"{server.url}/admin/expert-cache", json={"size": f"{budget}B"})
        share = lm.experts.block_share
        assert r.status_code == 200 and r.json()["block_rows"] == split_expert_budget(
            budget, share, lm.moe_spec.bytes_per_expert(torch.float32), row_bytes, lm.moe_spec.total_routed_experts)[1]
        assert lm.experts.copier.store.capacity == r.json()["block_rows"]
        after = httpx.post(f"{server.url}/v1/chat/completions", json=chat).json()["choices"][0]["message"]
        assert after == before
        stats = httpx.get(f"{server.url}/v1/stats").json()["engine"]["experts"]
        assert stats["block_rows"] == r.json()["block_rows"] and stats["block_cached"] > 0
        r = httpx.post(f"{server.url}/admin/expert-cache", json={"size": "1B"})
        assert r.status_code == 400 and "block format" in r.json()["error"]["message"]
    finally:
        server.stop()


def test_the_cli_rejects_a_share_outside_zero_to_one(capsys):
    from freetoken.engine.commands import generate

    with pytest.raises(SystemExit):
        generate(["hi", "--block-cache", "2"])
    assert "is no share: give a fraction from 0 to 1" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("miss_path", ["copy", "auto"])
def test_on_cuda_the_fused_launch_reads_the_block_store(q8_gguf, expected, miss_path):
    """On CUDA the store's rows are read by the fused dequantizer (source rows from the device, graph replays per
    batch size); tokens as resident, and the graphs reading the store are the ones used."""
    lm = _offloaded(q8_gguf, 1, 6, device="cuda")
    ex = lm.experts
    ex.miss_path = miss_path
    assert ex.copier.fused
    for _ in range(2):
        assert Generator(lm).generate_ids(prompt_ids(), GREEDY) == expected
    assert ex.counters.store_hits > 0 and any(stored for _, stored in ex.copier._dequant_graphs)
