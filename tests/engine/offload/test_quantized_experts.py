"""Offloaded GGUF experts stay in their block format in host memory: fewer bytes per miss, same tokens."""

from __future__ import annotations

import contextlib

import pytest
import torch

from freetoken.engine.generator import Generator
from freetoken.engine.loader import load_model
from freetoken.engine.offload.quantized import QuantizedExperts
from freetoken.engine.sampling import SamplingParams
from support.checkpoints import PARITY_CASES, prompt_ids, write_gguf_from_hf, write_hf_checkpoint
from support.offload_cases import EVEN_SPLIT

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _tiny_gguf(tmp_path, tensor_type: str = "Q8_0"):
    """The tiny qwen3_moe checkpoint written as a GGUF of `tensor_type`."""
    write_hf_checkpoint(path=tmp_path / "hf", **PARITY_CASES["qwen3_moe"])
    return write_gguf_from_hf(tmp_path / "hf", tmp_path / "m.gguf", tensor_type=tensor_type)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral"])
@pytest.mark.parametrize("miss_path", ["copy", "cpu", "auto"])
def test_quantized_host_experts_give_the_resident_tokens_with_fewer_bytes(family, miss_path, tmp_path):
    write_hf_checkpoint(path=tmp_path / "hf", **PARITY_CASES[family])
    gguf = write_gguf_from_hf(tmp_path / "hf", tmp_path / "m.gguf", tensor_type="Q8_0")
    resident = load_model(gguf, progress=False)
    expected = Generator(resident).generate_ids(prompt_ids(), GREEDY)
    spec = resident.moe_spec
    lm = load_model(gguf, progress=False, expert_cache=3 * spec.bytes_per_expert(torch.float32))
    lm.experts.miss_path = miss_path
    lm.experts.planner = EVEN_SPLIT()
    host = next(iter(lm.experts.host.values()))
    assert isinstance(host, QuantizedExperts) and host.type_names["gate_proj"] == "Q8_0"
    assert lm.experts.expert_bytes == spec.bytes_per_expert("Q8_0") < spec.bytes_per_expert(torch.float32) / 3
    torch.testing.assert_close(lm.prefill_logits(prompt_ids()), resident.prefill_logits(prompt_ids()),
                               atol=1e-5, rtol=0)
    assert Generator(lm).generate_ids(prompt_ids(), GREEDY) == expected
    c = lm.experts.counters
    assert c.bytes_copied // spec.bytes_per_expert("Q8_0") + c.cpu_experts == c.misses
    if miss_path == "copy":
        assert c.cpu_experts == 0 and c.evictions > 0
    elif miss_path == "cpu":
        assert c.bytes_copied == 0


def test_dense_gguf_experts_are_kept_dense(tmp_path):
    write_hf_checkpoint(path=tmp_path / "hf", **PARITY_CASES["mixtral"])
    gguf = write_gguf_from_hf(tmp_path / "hf", tmp_path / "m.gguf", tensor_type="F16")
    lm = load_model(gguf, progress=False, expert_cache=0)
    assert not isinstance(next(iter(lm.experts.host.values())), QuantizedExperts)


@pytest.mark.parametrize("slots", [0, 3])
def test_gathered_decode_dequantizes_a_step_of_q8_0_experts_together(slots, tmp_path):
    """The decode path copies a step's Q8_0 experts and dequantizes them in one batch (into cache or staging
    slots); the result equals the resident run. On CUDA that is the default, here it is switched on."""
    gguf = _tiny_gguf(tmp_path)
    resident = load_model(gguf, progress=False)
    expected = Generator(resident).generate_ids(prompt_ids(), GREEDY)
    spec = resident.moe_spec
    lm = load_model(gguf, progress=False, expert_cache=slots * spec.bytes_per_expert(torch.float32))
    lm.experts.miss_path, lm.experts.gather_small_batches = "copy", True
    batches = []
    to_slots = lm.experts.copier.to_slots
    lm.experts.copier.to_slots = lambda layer, experts, *a: batches.append(len(experts)) or to_slots(layer, experts, *a)
    assert Generator(lm).generate_ids(prompt_ids(), GREEDY) == expected
    assert max(batches) >= 2  # several experts of one step went through one dequantization
    c = lm.experts.counters
    staged = 0 if slots else c.prefetch_used  # with no cache, a used prefetch is a miss that needs no copy
    assert c.bytes_copied // spec.bytes_per_expert("Q8_0") == c.misses + c.prefetched - staged


def test_a_prefetch_into_a_small_cache_never_copies_two_experts_into_one_slot(tmp_path):
    """Admitting the next layer's predictions can evict one admitted a moment before (a cache of a few slots):
    that slot must then hold the later one only. A batch of quantized copies writes its slots in no particular
    order, so the same slot twice in one batch used to leave the wrong expert there (seen on CUDA)."""
    gguf = _tiny_gguf(tmp_path)
    resident = load_model(gguf, progress=False)
    expected = Generator(resident).generate_ids(prompt_ids(), GREEDY)
    lm = load_model(gguf, progress=False, expert_cache=3 * resident.moe_spec.bytes_per_expert(torch.float32))
    ex = lm.experts
    ex.miss_path, ex.gather_small_batches, ex.prefetch = "copy", True, True  # prefetch is off on CPU by default
    batches = []
    to_slots = ex.copier.to_slots
    ex.copier.to_slots = lambda layer, experts, dest, slots: batches.append(slots) or to_slots(layer, experts, dest,
                                                                                               slots)
    assert Generator(lm).generate_ids(prompt_ids(), GREEDY) == expected
    assert ex.counters.prefetched > 0 and all(len(set(b)) == len(b) for b in batches)
    with pytest.raises(ValueError, match="one slot twice"):
        ex.copier.to_slots(0, [0, 1], ex.slots, [0, 0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("miss_path", ["copy", "auto"])
def test_on_cuda_q8_0_experts_cross_in_blocks_and_dequantize_in_one_launch(miss_path, tmp_path):
    gguf = _tiny_gguf(tmp_path)
    resident = load_model(gguf, device="cuda", dtype=torch.float32, progress=False)
    expected = Generator(resident).generate_ids(prompt_ids(), GREEDY)
    spec = resident.moe_spec
    lm = load_model(gguf, device="cuda", dtype=torch.float32, progress=False,
                    expert_cache=3 * spec.bytes_per_expert(torch.float32))
    lm.experts.miss_path = miss_path
    copier = lm.experts.copier
    assert copier.fused and copier._direct  # pinned block bytes through the runtime, Triton dequantizes
    assert Generator(lm).generate_ids(prompt_ids(), GREEDY) == expected
    assert lm.experts.counters.bytes_copied > 0
    torch.testing.assert_close(lm.prefill_logits(prompt_ids()), resident.prefill_logits(prompt_ids()),
                               atol=1e-4, rtol=0)


@contextlib.contextmanager
def _experimental(monkeypatch, *paths: str):
    """The GPU paths named in FREETOKEN_EXPERIMENTAL inside the block (the cached switches cleared on both sides,
    so no other test sees them)."""
    from freetoken.engine import gpu_paths

    monkeypatch.setenv("FREETOKEN_EXPERIMENTAL", ",".join(paths))
    gpu_paths.enabled.cache_clear()
    gpu_paths._named.cache_clear()
    try:
        yield
    finally:
        monkeypatch.delenv("FREETOKEN_EXPERIMENTAL")
        gpu_paths.enabled.cache_clear()
        gpu_paths._named.cache_clear()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("tensor_type", ["Q8_0", "F32"])
def test_on_cuda_prefill_streams_the_next_layer_ahead_in_batches(tensor_type, tmp_path):
    """GPU path "ahead-batches" (on by default): a chunk long enough to route to every expert streams each next
    layer's experts ahead, AHEAD_BATCH experts a batch (one event each and, for Q8_0, one dequantizing launch), into
    free slots and the staging ring; the logits stay the resident ones."""
    gguf = _tiny_gguf(tmp_path, tensor_type)
    resident = load_model(gguf, device="cuda", dtype=torch.float32, progress=False)
    lm = load_model(gguf, device="cuda", dtype=torch.float32, progress=False, prefill_ahead=True,
                    expert_cache=3 * resident.moe_spec.bytes_per_expert(torch.float32))
    ex = lm.experts
    ex.miss_path = "copy"
    tokens = 2 * ex.num_experts * ex.AHEAD_TOKENS_PER_EXPERT // ex._top_k
    ids = torch.randint(0, resident.args.decoder.vocab_size, (tokens,),
                        generator=torch.Generator().manual_seed(1)).tolist()
    torch.testing.assert_close(lm.prefill_logits(ids), resident.prefill_logits(ids), atol=1e-4, rtol=0)
    c = ex.counters
    assert c.prefetched >= ex.AHEAD_BATCH and 0 < c.prefetch_used <= c.prefetched


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("tensor_type", ["Q8_0", "F32"])
def test_on_cuda_batched_copies_give_the_resident_tokens(tensor_type, tmp_path, monkeypatch):
    """GPU paths "copy-batch" (dense projections straight into their slots, on by default) and
    "copy-batch-blocks" (Q8_0 block bytes into the dequantizer's rows, experimental): a batch's copies queued by one
    cudaMemcpyBatchAsync."""
    from freetoken.engine.offload import cudart

    with _experimental(monkeypatch, *(["copy-batch-blocks"] if tensor_type == "Q8_0" else [])):
        gguf = _tiny_gguf(tmp_path, tensor_type)
        resident = load_model(gguf, device="cuda", dtype=torch.float32, progress=False)
        expected = Generator(resident).generate_ids(prompt_ids(), GREEDY)
        lm = load_model(gguf, device="cuda", dtype=torch.float32, progress=False,
                        expert_cache=3 * resident.moe_spec.bytes_per_expert(torch.float32))
        lm.experts.miss_path = "copy"
        if not cudart.batch_available():
            pytest.skip("this CUDA runtime has no cudaMemcpyBatchAsync (12.8+)")
        assert lm.experts.copier._batches_copies() and lm.experts.copier._direct
        batches = []
        call = cudart.copy_batch_to_device
        monkeypatch.setattr(cudart, "copy_batch_to_device", lambda copies, stream: batches.append(len(copies))
                            or call(copies, stream))
        assert Generator(lm).generate_ids(prompt_ids(), GREEDY) == expected
        assert max(batches) >= 6  # two experts' three projections, or more, in one call


@pytest.mark.parametrize(("paths", "in_decode", "in_prefill"), [
    ((), False, False), (("copy-batch-prefill",), False, True), (("copy-batch-blocks",), True, True)])
def test_block_format_copies_are_batched_where_their_path_says(paths, in_decode, in_prefill, tmp_path, monkeypatch):
    """"copy-batch-blocks" batches every block-format copy into one runtime call, "copy-batch-prefill" only a
    prefill chunk's (decode measured slower batched). The runtime's batch call is a CUDA one: the copier is told
    it has it."""
    lm = load_model(_tiny_gguf(tmp_path), device="cpu", dtype=torch.float32, progress=False, expert_cache=0)
    copier = lm.experts.copier
    monkeypatch.setattr(copier, "_can_batch", True)
    with _experimental(monkeypatch, *paths):
        copier.begin(prefill=False)
        assert copier._batches_copies() is in_decode
        copier.end()
        copier.begin(prefill=True)
        assert copier._batches_copies() is in_prefill
        copier.end()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_cuda_graphed_dequantization_writes_each_batch_into_its_own_slots(tmp_path):
    """From the second batch of a size on, the fused launch replays from a CUDA graph: the slot numbers and the
    block bytes of every later batch must still land where that batch says, also after the slots moved."""
    from freetoken.engine.offload import row_dequant

    gguf = _tiny_gguf(tmp_path)
    lm = load_model(gguf, device="cuda", dtype=torch.bfloat16, progress=False, expert_cache=0)
    copier, host = lm.experts.copier, lm.experts.host[0]
    assert copier.fused and row_dequant.DEQUANT_GRAPHS
    dest = copier.allocate(8)
    generator = torch.Generator().manual_seed(0)
    for round_ in range(6):
        if round_ == 4:
            dest = copier.allocate(8)  # new slot storage: the graphs captured for the old one must not be used
        n = 1 + round_ % 2 * 2  # sizes 1 and 3, each seen several times
        slots = torch.randperm(8, generator=generator)[:n].tolist()
        experts = torch.randperm(host.num_experts, generator=generator)[:n].tolist()
        copier.begin()
        copier.to_slots(0, experts, dest, slots)
        copier.end()
        torch.cuda.synchronize()
        for e, slot in zip(experts, slots, strict=True):
            for p, got in zip(("gate_proj", "up_proj", "down_proj"), dest.weights_of(slot), strict=True):
                want = host.dequantized(e, p, torch.bfloat16, host.raw[p][e].cuda())
                assert torch.equal(got, want), (round_, e, slot, p)
    assert set(copier._dequant_graphs) == {(1, False), (3, False)}
