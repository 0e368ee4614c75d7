"""DeepSeek-V4 (`deepseek_v4`) against transformers on a tiny random checkpoint written with its own config class
(tests/support/checkpoints.py: one HCA, two CSA and one sliding layer, windows of 8 keys, 4 hyper-connection
streams, two hash-routed layers): fp32 logits within 1e-4, 32 greedy tokens equal to `generate` (also across
prefill chunks of 7, which split compress windows), offloaded below the pool; the indexer's selection really
narrows attention; a snapshot taken mid-prompt (windows still open) continues as the sequence would."""

from __future__ import annotations

import pytest
import torch

from freetoken.engine.generator import Generator
from freetoken.engine.loader import load_model
from freetoken.engine.models import deepseek_v4
from freetoken.engine.sampling import SamplingParams
from freetoken.engine.state_snapshots import StateSnapshots
from freetoken.errors import ModelLoadError
from support.checkpoints import divergence_report, hf_greedy, hf_logits, prompt_ids, write_hf_checkpoint

GREEDY_32 = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
TOPK = 3  # the tiny config's index_topk; CSA makes an entry every 4 tokens


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek_v4")
    reference = write_hf_checkpoint("deepseek_v4", path)
    return path, reference, hf_greedy(reference, prompt_ids(), 32)


@pytest.fixture(scope="module")
def lm(checkpoint):
    return load_model(checkpoint[0], device="cpu", dtype=torch.float32, progress=False)


def test_the_config_reads_every_layer_kind(lm):
    a, r = lm.args.attention, lm.args.routing
    assert a.kinds == (deepseek_v4.HCA, deepseek_v4.CSA, deepseek_v4.SLIDING, deepseek_v4.CSA)
    assert (a.rates, a.window, a.rope_dim, a.index_topk) == ({deepseek_v4.CSA: 4, deepseek_v4.HCA: 8}, 8, 8, TOPK)
    assert (r.hash_layers, r.scoring, lm.args.hc_mult) == ((0, 1), "sqrtsoftplus", 4)
    assert lm.args.attention.compress_rope.rope_type == "yarn"
    spec = lm.moe_spec
    assert (spec.moe_layers, spec.num_experts, spec.top_k, spec.num_shared_experts) == ((0, 1, 2, 3), 8, 2, 1)


def test_prefill_logits_match_transformers(checkpoint, lm):
    ids = prompt_ids()
    torch.testing.assert_close(lm.prefill_logits(ids), hf_logits(checkpoint[1], ids), atol=1e-4, rtol=0)


def test_greedy_tokens_match_transformers(checkpoint, lm):
    path, reference, expected = checkpoint
    ids = prompt_ids()
    for gen in (Generator(lm), Generator(lm, prefill_chunk=7, page_size=4)):
        ours = gen.generate_ids(ids, GREEDY_32)
        assert ours == expected, divergence_report(reference, ids, ours, expected)


@torch.inference_mode()
def test_chunked_prefill_equals_whole(lm):
    """Chunks of 1, 3, 5, 7 and 11 tokens (decode-sized and longer, ending inside and on window edges) give the
    logits of one whole prefill: the open windows and the overlap carry across calls."""
    ids = prompt_ids()
    whole = lm.prefill_logits(ids)
    for size in (1, 3, 5, 7, 11):
        cache = lm.new_cache(page_size=4, initial_tokens=len(ids))
        seq = cache.new_sequence()
        tokens = torch.tensor(ids)
        parts = [lm.forward(tokens[i:i + size], cache, seq) for i in range(0, len(ids), size)]
        # chunks sum in another order than one pass: a few ulps of fp32 at logits near 0.1 exceed 1e-5 on some CPUs
        torch.testing.assert_close(torch.cat(parts), whole, atol=1e-4, rtol=0)


def test_the_indexer_narrows_attention(checkpoint, lm):
    """Queries that see at most TOPK CSA entries (positions below 4·(TOPK+1) - 1) attend to all of them either
    way; later ones only to the chosen TOPK, so the logits part from dense selection's there; dense selection
    matches transformers' model with the same change."""
    ids = prompt_ids()
    sparse = lm.prefill_logits(ids)
    indexers = [layer.attn.indexer for layer in lm.model.model.layers if hasattr(layer.attn, "indexer")]
    reference = [layer.self_attn.compressor.indexer for layer in checkpoint[1].model.layers
                 if layer.self_attn.layer_type == deepseek_v4.CSA]
    assert len(indexers) == len(reference) == 2
    try:
        for ours, theirs in zip(indexers, reference, strict=True):
            ours.topk = theirs.index_topk = 10**6
        dense = lm.prefill_logits(ids)
        torch.testing.assert_close(dense, hf_logits(checkpoint[1], ids), atol=1e-4, rtol=0)
    finally:
        for ours, theirs in zip(indexers, reference, strict=True):
            ours.topk = theirs.index_topk = TOPK
    first_sparse = 4 * (TOPK + 1) - 1
    torch.testing.assert_close(sparse[:first_sparse], dense[:first_sparse], atol=1e-5, rtol=0)
    assert (sparse[first_sparse:] - dense[first_sparse:]).abs().max() > 1e-2


def test_the_routers_match_transformers(checkpoint, lm):
    """Hash layers take tid2eid's experts for each token id, top-k layers the best biased scores; both weigh
    them by the renormalised, scaled sqrt-softplus scores."""
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    tokens = torch.arange(16) * 7
    for i in (0, 2):
        reference = checkpoint[1].model.layers[i].mlp.gate
        _, want_w, want_ids = reference(x, tokens) if i == 0 else reference(x)
        weights, ids = lm.model.model.layers[i].ffn.gate(x, tokens)
        order, want_order = ids.sort(dim=-1), want_ids.sort(dim=-1)
        assert torch.equal(order.values, want_order.values)
        torch.testing.assert_close(weights.gather(1, order.indices), want_w.gather(1, want_order.indices))
    assert torch.equal(lm.model.model.layers[0].ffn.gate(x, tokens)[1],
                       checkpoint[1].model.layers[0].mlp.gate.tid2eid[tokens])


def test_the_clamped_swiglu_matches_transformers(checkpoint, tmp_path):
    """Experts and the shared expert clamp the gate above and the up projection both ways at swiglu_limit; with
    a limit that bites, prefill (the torch expert paths) still matches transformers."""
    reference = write_hf_checkpoint("deepseek_v4", tmp_path, swiglu_limit=0.5)
    lm = load_model(tmp_path, device="cpu", dtype=torch.float32, progress=False)
    g, u = torch.randn(2, 64, 32, generator=torch.Generator().manual_seed(2)) * 3
    experts = reference.model.layers[0].mlp.experts
    torch.testing.assert_close(deepseek_v4.clamped_swiglu(0.5).activate(g, u),
                               experts._apply_gate(torch.cat((g, u), dim=-1)))
    ids = prompt_ids()
    ours, want = lm.prefill_logits(ids), hf_logits(reference, ids)
    torch.testing.assert_close(ours, want, atol=1e-4, rtol=0)
    assert (want - hf_logits(checkpoint[1], ids)).abs().max() > 1e-2  # the clamp changed the model


def test_offloaded_greedy_tokens_are_the_same(checkpoint, lm):
    """Three experts' worth of device cache for 32 routed experts: hash-routed layers look their experts up
    by token id before the executor sees them, so offloading changes nothing."""
    path, _, expected = checkpoint
    offloaded = load_model(path, device="cpu", dtype=torch.float32, progress=False,
                           expert_cache=3 * lm.moe_spec.bytes_per_expert(torch.float32))
    assert Generator(offloaded).generate_ids(prompt_ids(), GREEDY_32) == expected
    assert offloaded.experts.counters.evictions > 0


def test_offloaded_misses_clamp_like_the_resident_model(tmp_path):
    """With a swiglu_limit that bites, misses copied to the device and misses computed on the CPU (the native
    kernel's V4 activation, or its torch reference) give the resident model's greedy tokens."""
    write_hf_checkpoint("deepseek_v4", tmp_path, swiglu_limit=0.5)
    resident = load_model(tmp_path, device="cpu", dtype=torch.float32, progress=False)
    expected = Generator(resident).generate_ids(prompt_ids(), GREEDY_32)
    unclamped = deepseek_v4.clamped_swiglu(1e9)
    for miss_path in ("copy", "cpu"):
        lm = load_model(tmp_path, device="cpu", dtype=torch.float32, progress=False,
                        expert_cache=3 * resident.moe_spec.bytes_per_expert(torch.float32))
        lm.experts.miss_path = miss_path
        assert Generator(lm).generate_ids(prompt_ids(), GREEDY_32) == expected, miss_path
        assert lm.experts.counters.misses > 0
    # the limit changes the routed experts' outputs here, so the equality above has teeth
    g, u = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(0)) * 3
    assert not torch.allclose(deepseek_v4.clamped_swiglu(0.5).activate(g, u), unclamped.activate(g, u))


def test_the_state_is_per_sequence_not_paged(lm):
    """The paged pools stay empty; the windows, compressed entries and open windows are recurrent state, so the
    engine runs the model one sequence at a time and reuses snapshots, not shared pages."""
    assert lm.has_recurrent_state
    cache = lm.new_cache(page_size=4, initial_tokens=8)
    assert all(k.numel() == 0 for k in cache.k)


def test_a_snapshot_mid_prompt_continues_as_the_sequence(lm):
    """A semantic checkpoint taken after 23 tokens (an HCA window, a CSA window and the indexer's half open),
    restored after the live sequence moved on, continues with the same greedy tokens as one uninterrupted run."""
    ids = prompt_ids()
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = Generator(lm).generate_ids(ids, params)
    gen = Generator(lm, page_size=4)
    cache = gen.cache()
    snapshots = StateSnapshots(cache)
    seq = cache.new_sequence()
    gen.prefill(seq, ids[:23])
    snapshots.snapshot(ids[:23], seq)
    moved_on = [t for ev in gen.extend(seq, prompt_ids("Something else entirely"), params) for t in ev.token_ids]
    restored = snapshots.start(ids)
    assert restored is not None and restored.length == 23 and moved_on
    ours = [t for ev in gen.extend(restored, ids[23:], params) for t in ev.token_ids]
    assert ours == expected
    for s in (seq, restored):
        cache.release(s)


def test_hub_names_map_to_the_models():
    """DeepSeek's own top-level names and the MTP layers; block scales that reach the family (no fp8
    quantization_config, so the reader kept them) are refused by name."""
    args = deepseek_v4.ModelArgs.from_config(write_config())
    name = deepseek_v4.checkpoint_name
    assert name("embed.weight", args) == "model.embed_tokens.weight"
    assert name("head.weight", args) == "lm_head.weight"
    assert name("hc_head_fn", args) == "model.hc_head.hc_fn"
    assert name("layers.3.attn.wq_a.weight", args) == "model.layers.3.attn.wq_a.weight"
    assert name("layers.4.attn.wq_a.weight", args) is None and name("mtp.0.e_proj.weight", args) is None
    with pytest.raises(ModelLoadError, match="no quantization_config"):
        name("layers.0.ffn.experts.0.w1.scale", args)


def write_config() -> dict:
    from support.checkpoints import tiny_config

    return tiny_config("deepseek_v4").to_dict()


def test_decode_never_takes_cuda_graphs(lm):
    """Its attention cannot be captured (the state grows as windows close), so even on a CUDA device the
    generator and the batch scheduler default to eager decode."""
    import dataclasses

    from freetoken.engine.generator import run_settings

    assert lm.decodes_eagerly
    on_cuda = dataclasses.replace(lm, device=torch.device("cuda"))
    assert run_settings(on_cuda, None, None, None)[1] is False


def test_ft_info_names_the_attention_kinds(checkpoint):
    from freetoken.engine.model_info import describe

    text = describe(str(checkpoint[0]))
    assert "1 HCA (1 entry per 8 tokens), 2 CSA (1 per 4, top-3 entries), 1 sliding only" in text
    assert "56 B of compressed history per token" in text and "DeltaNet" not in text


def test_the_batch_scheduler_serves_two_requests_as_each_alone(checkpoint, lm):
    """The server's path: the two requests share forwards (a decode token beside the other's prefill chunks),
    each sequence's attention state updated from its own rows, and each gets the tokens it gets alone; the second
    starts from no snapshot of the first."""
    from freetoken.engine.batching import BatchRequest, BatchScheduler

    scheduler = BatchScheduler(lm, prefill_chunk=4)
    out: dict[int, list[int]] = {0: [], 1: []}
    other = prompt_ids("A second prompt beside the first")
    reqs = [BatchRequest(ids, GREEDY_32, emit=lambda ev, i=i: out[i].extend(ev.token_ids))
            for i, ids in enumerate((prompt_ids(), other))]
    for r in reqs:
        scheduler.add(r)
    while scheduler.active:
        scheduler.step()
    assert max(max(r.steps) for r in reqs) == 2  # both in one forward
    assert out[0] == checkpoint[2] and out[1] == Generator(lm).generate_ids(other, GREEDY_32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_cuda_the_hyper_sinkhorn_kernel_gives_the_same_model(checkpoint, monkeypatch):
    """GPU path "hyper-sinkhorn": the model's logits and greedy tokens with the Triton hyper-connection weights
    equal the plain-torch ones (fp32)."""
    from freetoken.engine import gpu_paths

    path, _, expected = checkpoint
    runs = []
    for named in ("hyper-sinkhorn", ""):
        monkeypatch.setenv("FREETOKEN_DISABLE", named)
        gpu_paths.enabled.cache_clear()
        gpu_paths._named.cache_clear()
        lm = load_model(path, device="cuda", dtype=torch.float32, progress=False)
        runs.append((lm.prefill_logits(prompt_ids()).cpu(), Generator(lm).generate_ids(prompt_ids(), GREEDY_32)))
    gpu_paths.enabled.cache_clear()
    gpu_paths._named.cache_clear()
    torch.testing.assert_close(runs[1][0], runs[0][0], atol=1e-4, rtol=0)
    assert runs[0][1] == runs[1][1] == expected
