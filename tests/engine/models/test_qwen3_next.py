"""Qwen3-Next and Qwen3.5/3.6-MoE (hybrid Gated DeltaNet + gated full attention, shared expert) against
transformers on tiny random checkpoints written with transformers' own config classes: fp32 logits within 1e-4,
32 greedy tokens equal to `generate`, across prefill chunks, with the experts offloaded below the pool, and
continued from a recurrent-state snapshot mid-sequence; Qwen3.5 also from the vision-language layout the Hub
ships. The gated delta rule's chunked form equals its recurrent form."""

from __future__ import annotations

import pytest
import torch

from freetoken.engine.generator import Generator
from freetoken.engine.loader import load_model
from freetoken.engine.models.gated_delta import chunked_gated_delta, l2_normalize, recurrent_gated_delta
from freetoken.engine.sampling import SamplingParams
from support.checkpoints import divergence_report, hf_greedy, hf_logits, prompt_ids, write_hf_checkpoint

GREEDY_32 = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


# layer mixers and MoE layers of each tiny config (tests/support/checkpoints.py:tiny_config)
EXPECTED = {
    "qwen3_next": (["linear_attn", "self_attn", "linear_attn", "self_attn"], (0, 1, 3)),
    "qwen3_5_moe": (["linear_attn", "self_attn", "linear_attn", "self_attn"], (0, 1, 2, 3)),
}


@pytest.fixture(scope="module", params=list(EXPECTED))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    reference = write_hf_checkpoint(request.param, path)
    return path, reference, hf_greedy(reference, prompt_ids(), 32), request.param


@pytest.fixture(scope="module")
def lm(checkpoint):
    return load_model(checkpoint[0], device="cpu", dtype=torch.float32, progress=False)


def _random_rule_inputs(t: int, heads: int = 3, dk: int = 8, dv: int = 5, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(t, heads, dk, generator=gen)) * dk ** -0.5
    k = l2_normalize(torch.randn(t, heads, dk, generator=gen))
    v = torch.randn(t, heads, dv, generator=gen)
    g = -torch.rand(t, heads, generator=gen) * 2  # decays between e^-2 and 1
    beta = torch.rand(t, heads, generator=gen)
    state = torch.randn(heads, dk, dv, generator=gen)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("t, chunk", [(1, 64), (5, 64), (37, 8), (64, 16), (70, 64)])
def test_chunked_gated_delta_rule_equals_the_recurrent_one(t, chunk):
    """Including a chunk length that does not divide T and a non-zero starting state."""
    q, k, v, g, beta, state = _random_rule_inputs(t)
    want, want_state = recurrent_gated_delta(q, k, v, g, beta, state)
    got, got_state = chunked_gated_delta(q, k, v, g, beta, state, chunk=chunk)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_state, want_state, atol=1e-5, rtol=1e-5)


def test_the_rule_splits_anywhere():
    """Two calls, the second from the first's state, equal one call over both parts."""
    q, k, v, g, beta, state = _random_rule_inputs(50, seed=1)
    whole, end = chunked_gated_delta(q, k, v, g, beta, state, chunk=16)
    first, mid = chunked_gated_delta(q[:23], k[:23], v[:23], g[:23], beta[:23], state, chunk=16)
    second, end2 = chunked_gated_delta(q[23:], k[23:], v[23:], g[23:], beta[23:], mid, chunk=16)
    torch.testing.assert_close(torch.cat((first, second)), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(end2, end, atol=1e-5, rtol=1e-5)


def test_the_model_is_hybrid_and_recurrent(checkpoint, lm):
    mixers, moe_layers = EXPECTED[checkpoint[3]]
    assert [layer.mixer_name for layer in lm.model.model.layers] == mixers
    assert lm.has_recurrent_state
    spec = lm.moe_spec
    assert (spec.moe_layers, spec.num_experts, spec.top_k, spec.num_shared_experts) == (moe_layers, 8, 2, 1)


def test_prefill_logits_match_transformers(checkpoint, lm):
    ids = prompt_ids()
    torch.testing.assert_close(lm.prefill_logits(ids), hf_logits(checkpoint[1], ids), atol=1e-4, rtol=0)
    torch.testing.assert_close(lm.prefill_logits([5]), hf_logits(checkpoint[1], [5]), atol=1e-4, rtol=0)


def test_greedy_tokens_match_transformers(checkpoint, lm):
    _, reference, expected, _ = checkpoint
    ids = prompt_ids()
    ours = Generator(lm).generate_ids(ids, GREEDY_32)
    assert ours == expected, divergence_report(reference, ids, ours, expected)


def test_greedy_across_prefill_chunks_and_pages(checkpoint, lm):
    """Chunks of 7 into pages of 4: the DeltaNet state and conv window carry across chunk ends."""
    _, reference, expected, _ = checkpoint
    ids = prompt_ids()
    ours = Generator(lm, prefill_chunk=7, page_size=4).generate_ids(ids, GREEDY_32)
    assert ours == expected, divergence_report(reference, ids, ours, expected)


def test_offloaded_experts_give_the_same_greedy_tokens(checkpoint):
    """An expert cache of 5 slots for 24 routed experts: misses on every step, the same tokens."""
    path, reference, expected, _ = checkpoint
    probe = load_model(path, device="cpu", dtype=torch.float32, progress=False)
    per_expert = probe.moe_spec.bytes_per_expert(torch.float32)
    lm = load_model(path, device="cpu", dtype=torch.float32, progress=False, expert_cache=5 * per_expert)
    ours = Generator(lm).generate_ids(prompt_ids(), GREEDY_32)
    assert ours == expected, divergence_report(reference, prompt_ids(), ours, expected)
    counters = lm.experts.counters
    assert counters.misses > 0 and counters.evictions > 0


def test_a_snapshot_taken_mid_sequence_continues_like_a_fresh_run(lm):
    """Prefill half the prompt, snapshot (fork), run on; then continue the snapshot with the other half: the
    same tokens as one run over the whole prompt."""
    gen = Generator(lm)
    ids = prompt_ids()
    half = len(ids) // 2
    cache = gen.cache()
    seq = cache.new_sequence()
    gen.prefill(seq, ids[:half])
    snapshot = cache.fork(seq)
    moved_on = [t for ev in gen.extend(seq, prompt_ids(" something else"), GREEDY_32) for t in ev.token_ids]
    restored = cache.fork(snapshot)
    again = [t for ev in gen.extend(restored, ids[half:], GREEDY_32) for t in ev.token_ids]
    assert again == gen.generate_ids(ids, GREEDY_32) and moved_on
    for s in (seq, snapshot, restored):
        cache.release(s)


def test_a_batched_forward_updates_each_sequences_state_from_its_own_rows(lm):
    """One forward over a decode token of one sequence and prefill chunks of two others (one fresh, one with a
    state already), then one over a decode token of each (their states stacked into one pass): each sequence's
    logits and its state afterwards equal those of running it alone."""
    prompts = [prompt_ids(), prompt_ids("A second prompt beside the first"), prompt_ids("Hi there")]
    lone_cache, batch_cache = lm.new_cache(page_size=4), lm.new_cache(page_size=4)
    lone = [lone_cache.new_sequence() for _ in prompts]
    batch = [batch_cache.new_sequence() for _ in prompts]
    with torch.inference_mode():
        for cache, seqs in ((lone_cache, lone), (batch_cache, batch)):  # the same history in both caches
            lm.forward(torch.tensor(prompts[0]), cache, seqs[0], "last")
            lm.forward(torch.tensor(prompts[2][:3]), cache, seqs[2], "last")
        for new in ([[7], prompts[1], prompts[2][3:]], [[11], [12], [13]]):
            want = torch.cat([lm.forward(torch.tensor(ids), lone_cache, seq, "last")
                              for ids, seq in zip(new, lone, strict=True)])
            got = lm.forward_batch(torch.tensor([t for ids in new for t in ids]), batch_cache, batch,
                                   [len(ids) for ids in new])
            # (within fp32 rounding: the batched projections multiply more rows at once, blocked differently)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for a, b in zip(lone, batch, strict=True):
        assert a.recurrent.keys() == b.recurrent.keys()
        for layer, state in a.recurrent.items():
            for x, y in zip(state, b.recurrent[layer], strict=True):
                torch.testing.assert_close(y, x, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("offload", [False, True])
def test_the_batch_scheduler_batches_hybrid_requests(checkpoint, lm, offload):
    """The server's path: several requests share each forward (decode tokens beside prefill chunks), and each gets
    the tokens it gets alone; also with offloaded experts."""
    from freetoken.engine.batching import BatchRequest, BatchScheduler

    path, _, expected_first, _ = checkpoint
    prompts = [prompt_ids(), prompt_ids("A second prompt beside the first"), prompt_ids("Hi")]
    expected = [expected_first] + [Generator(lm).generate_ids(p, GREEDY_32) for p in prompts[1:]]
    model = lm if not offload else load_model(path, device="cpu", dtype=torch.float32, progress=False,
                                              expert_cache=5 * lm.moe_spec.bytes_per_expert(torch.float32))
    scheduler = BatchScheduler(model, prefill_chunk=4)
    out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    reqs = [BatchRequest(p, GREEDY_32, emit=lambda ev, i=i: out[i].extend(ev.token_ids))
            for i, p in enumerate(prompts)]
    for r in reqs:
        scheduler.add(r)
    while scheduler.active:
        scheduler.step()
    assert [out[i] for i in range(len(prompts))] == expected
    assert max(max(r.steps) for r in reqs) == len(prompts)  # all three in one forward at some step
    if offload:
        assert model.experts.counters.misses > 0


def test_qwen3_5_loads_from_the_vision_language_layout(checkpoint, tmp_path):
    """The Hub's Qwen3.5 checkpoints are the vision-language model: the text model's config under `text_config`,
    its tensors under `model.language_model.`, a vision tower beside. The same text weights saved that way by
    transformers' own Qwen3_5MoeForConditionalGeneration load to the same logits (the tower left out)."""
    path, reference, _, family = checkpoint
    if family != "qwen3_5_moe":
        pytest.skip("Qwen3.5 only")
    import shutil

    from transformers import AutoModelForImageTextToText, Qwen3_5MoeConfig

    text = reference.config.to_dict()
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  temporal_patch_size=2, spatial_merge_size=2)
    vl = AutoModelForImageTextToText.from_config(Qwen3_5MoeConfig(text_config=text, vision_config=vision),
                                                 dtype=torch.float32)
    weights = {k.removeprefix("model."): t for k, t in reference.state_dict().items() if k.startswith("model.")}
    assert not vl.model.language_model.load_state_dict(weights, strict=False).missing_keys
    vl.lm_head.load_state_dict(reference.lm_head.state_dict())
    vl.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (path / name).exists():
            shutil.copy(path / name, tmp_path / name)
    loaded = load_model(tmp_path, device="cpu", dtype=torch.float32, progress=False)
    ids = prompt_ids()
    torch.testing.assert_close(loaded.prefill_logits(ids), hf_logits(reference, ids), atol=1e-4, rtol=0)


def test_the_kv_cache_holds_only_the_attention_layers(lm):
    """DeltaNet layers keep no K/V: their pools stay empty however the cache grows, and the server's KV budget
    counts only the attention layers."""
    from freetoken.engine.offload.budget import kv_bytes_per_token

    gen = Generator(lm, page_size=4)
    cache = gen.cache()
    seq = cache.new_sequence()
    gen.prefill(seq, prompt_ids())
    sizes = [k.shape[0] for k in cache.k]
    assert sizes[0] == sizes[2] == 0 and sizes[1] == sizes[3] >= len(prompt_ids())
    a = lm.args.decoder.attention
    assert kv_bytes_per_token(lm.args, torch.float32) == 2 * 2 * a.n_kv_heads * a.head_dim * 4
    cache.release(seq)


def test_the_static_decode_window_carries_the_recurrent_state(lm):
    """What a captured decode step runs (GPU path "recurrent-graphs"), here eagerly: the DeltaNet state read
    from and written to static buffers, handed back after each step, gives the eager path's logits."""
    from support.decode_checks import static_window_equals_eager

    ctx = static_window_equals_eager(lm, window=64, steps=6, tol=1e-5)
    assert sorted(ctx._state) == [0, 2]  # the DeltaNet layers


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_graph_decode_of_the_hybrid_equals_eager(checkpoint, monkeypatch):
    """GPU path "recurrent-graphs" (on by default): captured decode steps give the eager steps' greedy tokens,
    with the DeltaNet step in torch and (experimental "delta-decode") in Triton."""
    from freetoken.engine import gpu_paths

    for experimental in ("", "delta-decode"):
        monkeypatch.setenv("FREETOKEN_EXPERIMENTAL", experimental)
        gpu_paths.enabled.cache_clear()
        gpu_paths._named.cache_clear()
        try:
            lm = load_model(checkpoint[0], device="cuda", dtype=torch.float32, progress=False)
            assert Generator(lm).use_graphs
            eager = Generator(lm, cuda_graphs=False).generate_ids(prompt_ids(), GREEDY_32)
            graphed = Generator(lm, cuda_graphs=True).generate_ids(prompt_ids(), GREEDY_32)
            assert graphed == eager, experimental
        finally:
            gpu_paths.enabled.cache_clear()
            gpu_paths._named.cache_clear()


# -- GGUF, as llama.cpp's converter writes qwen3next (tests/support/gguf_qwen3next.py) --


@pytest.mark.parametrize("arch", ["QWEN3NEXT", "QWEN35MOE"])
def test_the_gguf_writers_use_gguf_pys_names(arch):
    """The test writers' names are those gguf-py's own map gives the HF names (A_log and dt_bias go through the
    converter's renames first: A_log stays suffix-less, dt_bias becomes dt_proj.bias)."""
    import gguf

    from support import gguf_qwen3next

    ours = {"QWEN3NEXT": gguf_qwen3next.NAMES, "QWEN35MOE": gguf_qwen3next.QWEN35_NAMES}[arch]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch], 4)
    renamed = {"linear_attn.A_log": "linear_attn.A_log", "linear_attn.dt_bias": "linear_attn.dt_proj.bias"}
    for hf, gguf_name in ours.items():
        got = names.get_name(f"model.layers.1.{renamed.get(hf, hf)}", try_suffixes=(".weight", ".bias"))
        assert got == f"blk.1.{gguf_name}", hf


def test_a_gguf_of_the_checkpoint_loads_to_the_same_model(tmp_path):
    """qwen3next GGUFs: the regrouped DeltaNet projection, A as -exp(A_log), the squeezed conv kernel and the
    norms stored as 1 + w undone; same logits and greedy tokens as transformers, resident and offloaded."""
    from support.gguf_qwen3next import write_qwen3next_gguf

    reference = write_hf_checkpoint("qwen3_next", tmp_path / "hf", mlp_only_layers=[])  # (as every release)
    path = write_qwen3next_gguf(tmp_path / "hf", tmp_path / "q3n.gguf")
    _gguf_matches_transformers(path, reference, offloaded_too=True)


def test_a_qwen35moe_gguf_loads_to_the_same_model(tmp_path):
    """qwen35moe GGUFs (Qwen3.5/3.6-MoE): the split projections, and every value-head axis in ggml's tiled order
    (2 key heads, 4 value heads here, so the order matters) put back; same logits and greedy tokens."""
    from support.gguf_qwen3next import write_qwen35moe_gguf

    reference = write_hf_checkpoint("qwen3_5_moe", tmp_path / "hf")
    path = write_qwen35moe_gguf(tmp_path / "hf", tmp_path / "q35.gguf")
    _gguf_matches_transformers(path, reference, offloaded_too=False)


def _gguf_matches_transformers(path, reference, offloaded_too: bool) -> None:
    """The GGUF loads to the hybrid layout (attention at layers 1 and 3, experts everywhere) with the reference's
    logits within 1e-4 and its 32 greedy tokens, resident and (where asked) with 3 experts' worth of cache."""
    lm = load_model(path, device="cpu", dtype=torch.float32, progress=False)
    assert lm.args.full_attention_layers == (1, 3) and lm.args.moe_layers == (0, 1, 2, 3)
    ids = prompt_ids()
    torch.testing.assert_close(lm.prefill_logits(ids), hf_logits(reference, ids), atol=1e-4, rtol=0)
    expected = hf_greedy(reference, ids, 32)
    models = [lm]
    if offloaded_too:
        models.append(load_model(path, device="cpu", dtype=torch.float32, progress=False,
                                 expert_cache=3 * lm.moe_spec.bytes_per_expert(torch.float32)))
    for model in models:
        ours = Generator(model).generate_ids(ids, GREEDY_32)
        assert ours == expected, divergence_report(reference, ids, ours, expected)
