"""GLM-5 (`glm_moe_dsa`) specifics: DeepSeek Sparse Attention's indexer keys ride in the latent cache row, the
selection really narrows attention past `index_topk` tokens, a shared layer reuses its full layer's choice, and a
long chunk's selection in query blocks equals one block (the family's parity with transformers, offloaded and
batched, is in test_grouped_routing.py)."""

from __future__ import annotations

import pytest
import torch

from freetoken.engine import attention
from freetoken.engine.loader import load_model
from freetoken.engine.models.glm_moe_dsa import SharedKeys, TopKeys
from support.checkpoints import hf_logits, prompt_ids, write_hf_checkpoint

TOPK = 8  # the tiny config's index_topk (tests/support/checkpoints.py)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("glm_moe_dsa")
    return path, write_hf_checkpoint("glm_moe_dsa", path)


@pytest.fixture
def lm(checkpoint):
    return load_model(checkpoint[0], device="cpu", dtype=torch.float32, progress=False)


def _dense(lm) -> None:
    """Every key selected, whatever the length."""
    for layer in lm.model.model.layers:
        if hasattr(layer.self_attn, "indexer"):
            layer.self_attn.indexer.ia.topk = 10**6


def test_the_cache_row_holds_latent_rotary_and_indexer_keys(lm):
    """One KV "head" of kv_lora_rank + rotary width + indexer dim: 32 + 8 + 16 numbers a token."""
    a = lm.args.decoder.attention
    assert (a.n_kv_heads, a.head_dim) == (1, 56)
    assert lm.args.indexer.full == (True, True, False)


def test_the_selection_narrows_attention_past_topk_tokens(checkpoint, lm):
    """The first TOPK positions see every earlier key either way; later ones see only the chosen TOPK, so the
    logits part from dense attention's there, and dense attention matches transformers' dense model."""
    ids = prompt_ids()
    assert len(ids) > 2 * TOPK
    sparse = lm.prefill_logits(ids)
    _dense(lm)
    dense = lm.prefill_logits(ids)
    torch.testing.assert_close(sparse[:TOPK], dense[:TOPK], atol=1e-5, rtol=0)
    assert (sparse[TOPK:] - dense[TOPK:]).abs().max() > 1e-2
    reference = checkpoint[1]
    reference.config.index_topk = 10**6
    for layer in reference.model.layers:
        if layer.self_attn.indexer is not None:
            layer.self_attn.indexer.index_topk = 10**6
    try:
        torch.testing.assert_close(dense, hf_logits(reference, ids), atol=1e-4, rtol=0)
    finally:
        reference.config.index_topk = TOPK
        for layer in reference.model.layers:
            if layer.self_attn.indexer is not None:
                layer.self_attn.indexer.index_topk = TOPK


def test_a_shared_layer_has_no_indexer_and_reuses_the_full_layers_choice(lm, monkeypatch):
    layers = lm.model.model.layers
    assert hasattr(layers[1].self_attn, "indexer") and not hasattr(layers[2].self_attn, "indexer")
    seen = []
    original = SharedKeys.visible

    def spy(self, rows, keys, visible):
        out = original(self, rows, keys, visible)
        seen.append((self.source, out))
        return out

    monkeypatch.setattr(SharedKeys, "visible", spy)
    lm.prefill_logits(prompt_ids())
    assert len(seen) == 1
    source, chosen = seen[0]
    assert isinstance(source, TopKeys) and chosen is source.chosen[0]
    assert (chosen.sum(-1) <= TOPK).all() and (chosen.sum(-1)[TOPK:] == TOPK).all()


def test_a_long_chunks_selection_in_query_blocks_equals_one_block(lm, monkeypatch):
    ids = prompt_ids()
    whole = lm.prefill_logits(ids)
    monkeypatch.setattr(attention, "SELECTION_SCORES", 8 * 64)  # 64 keys × 8 heads: one query a block
    # the same selection; only the fp32 summation order of the blocked scores differs (1.2e-5 on an AMD EPYC)
    torch.testing.assert_close(lm.prefill_logits(ids), whole, atol=1e-5, rtol=1e-5)


def test_static_window_decode_selects_as_eager_decode(lm):
    """The graph-capturable decode step (a fixed window of slots, the unused ones masked) selects among the
    sequence's keys only: its logits equal eager decode's past index_topk tokens."""
    from support.decode_checks import static_window_equals_eager

    assert len(prompt_ids()) > TOPK
    static_window_equals_eager(lm, window=64, steps=6, tol=1e-5)


def test_a_static_batch_step_selects_as_each_sequence_alone(lm):
    """What a captured batched decode step runs, eagerly: each row selects among its own sequence's keys (past
    index_topk for the longer prompt, densely for the shorter one), padding rows beside them."""
    from support.decode_checks import static_batch_equals_alone

    static_batch_equals_alone(lm, [prompt_ids(), prompt_ids("Hi")])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_on_cuda_graph_decode_selects_as_eager_decode(checkpoint, monkeypatch):
    """The selection inside captured decode graphs (fixed windows of 128 and 256 slots) and in the batched
    step picks what eager decode picks: the same greedy tokens, offloaded too."""
    from freetoken.engine import cuda_graphs
    from freetoken.engine.batching import BatchRequest, BatchScheduler
    from freetoken.engine.generator import Generator
    from freetoken.engine.sampling import SamplingParams

    monkeypatch.setattr(cuda_graphs, "MIN_WINDOW", 64)  # the tiny model's context is only 256
    ids = (prompt_ids() * 20)[:100]  # 100 + 40 tokens crosses the 128-slot window into the 256 one
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    lm = load_model(checkpoint[0], device="cuda", dtype=torch.float32, progress=False)
    expected = Generator(lm, cuda_graphs=False).generate_ids(ids, params)
    graphed = Generator(lm, cuda_graphs=True, max_seq_len=1024)
    assert graphed.generate_ids(ids, params) == expected
    assert set(graphed._graphs.captured) == {(1, 128), (1, 256)}
    offloaded = load_model(checkpoint[0], device="cuda", dtype=torch.float32, progress=False,
                           expert_cache=3 * lm.moe_spec.bytes_per_expert(torch.float32))
    assert Generator(offloaded, cuda_graphs=True, max_seq_len=1024).generate_ids(ids, params) == expected
    shorter = Generator(lm, cuda_graphs=False).generate_ids(ids[:60], params)
    for graphs in (False, True):  # eager batched steps, then captured ones
        scheduler = BatchScheduler(lm, cuda_graphs=graphs)
        out = {0: [], 1: []}
        for i, p in enumerate((ids, ids[:60])):
            scheduler.add(BatchRequest(p, params, emit=lambda ev, i=i, out=out: out[i].extend(ev.token_ids)))
        while scheduler.active:
            scheduler.step()
        assert out[0] == expected and out[1] == shorter
    assert {(2, 128), (2, 256)} <= set(scheduler._graphs.captured)


# -- GGUF, as llama.cpp's converter writes glm-dsa (tests/support/gguf_deepseek.py) --


def test_the_gguf_writer_uses_gguf_pys_names_for_glm_dsa():
    """The test writer's indexer names are those gguf-py's own map gives the HF names (the converter's source)."""
    import gguf

    from support.gguf_deepseek import _INDEXER_NAMES, _NAMES

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GLM_DSA, 4)
    for hf, ours in (_NAMES | _INDEXER_NAMES).items():
        assert names.get_name(f"model.layers.1.{hf}.weight", try_suffixes=(".weight",)) == f"blk.1.{ours}.weight"


def test_a_glm_dsa_gguf_loads_to_the_same_model(checkpoint, tmp_path):
    """deepseek2's MLA tensors plus the indexer's, its sizes from `attention.indexer.*`, the shared layer read
    from the tensors it lacks: transformers' logits and greedy tokens, resident and offloaded."""
    from support.decode_checks import gguf_matches_transformers
    from support.gguf_deepseek import write_deepseek_gguf

    path, reference = checkpoint
    lm = gguf_matches_transformers(write_deepseek_gguf(path, tmp_path / "glm5.gguf"), reference)
    ia = lm.args.indexer
    assert (ia.heads, ia.dim, ia.topk, ia.full) == (8, 16, TOPK, (True, True, False))
