"""DeepSeek-V3 (`deepseek_v3`) specifics: what its latent cache holds, and YaRN in DeepSeek's own spelling (the
family's parity with transformers is in test_grouped_routing.py)."""

from __future__ import annotations

import math

import pytest
import torch

from freetoken.engine.loader import load_model
from support.checkpoints import hf_logits, prompt_ids, write_hf_checkpoint


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek_v3")
    write_hf_checkpoint("deepseek_v3", path)
    return load_model(path, device="cpu", dtype=torch.float32, progress=False)


def test_the_cache_holds_the_latent_not_per_head_keys(lm):
    """One KV "head" per layer of kv_lora_rank + rotary width: 40 numbers a token here (32 + 8), where
    expanded keys and values would take 4 heads × (24 + 12)."""
    a = lm.args.decoder.attention
    assert (a.n_kv_heads, a.head_dim) == (1, 40)
    cache = lm.new_cache(page_size=4, initial_tokens=8)
    assert cache.k[0].shape[1:] == (1, 40)


def test_the_latent_is_cached_once_and_read_as_keys_and_values(lm):
    """The values are the keys (the output's latent columns are the weighted latents): one pool per layer, which
    grows, copies on write and survives a resize as one, and the KV budget counts it once."""
    from freetoken.engine.generator import Generator
    from freetoken.engine.offload.budget import kv_bytes_per_token
    from freetoken.engine.sampling import SamplingParams

    assert kv_bytes_per_token(lm.args, torch.float32) == 3 * 40 * 4  # 3 layers, one 40-wide row each
    gen = Generator(lm, page_size=4)
    cache = gen.cache()
    assert all(v is k for k, v in zip(cache.k, cache.v, strict=True))
    seq = cache.new_sequence()
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ids = prompt_ids()
    first = [t for ev in gen.extend(seq, ids, params) for t in ev.token_ids]  # grows the pool past 8 tokens
    fork = cache.fork(seq)
    again = [t for ev in gen.extend(fork, prompt_ids(" more"), params) for t in ev.token_ids]  # copy on write
    cache.resize(cache.allocator.num_pages + 8)
    assert all(v is k for k, v in zip(cache.k, cache.v, strict=True)) and first and again
    assert first == Generator(lm).generate_ids(ids, params)
    for s in (seq, fork):
        cache.release(s)


def test_a_static_batch_step_reads_each_rows_latents(lm):
    """What a captured batched decode step runs, eagerly: latent rows as keys and values, padding rows beside
    (fp32 to 3e-5 here: four rows take other GEMM blocking than one; a leak from a padding row would be O(1))."""
    from support.decode_checks import static_batch_equals_alone

    static_batch_equals_alone(lm, [prompt_ids(), prompt_ids("Hi")], tol=1e-4)


def test_yarn_scaled_checkpoints_match_transformers(tmp_path):
    """DeepSeek-V3 ships YaRN with mscale_all_dim: interpolated frequencies and a softmax scale grown by mscale²
    (1.87× at factor 40)."""
    reference = write_hf_checkpoint("deepseek_v3", tmp_path, rope="yarn")
    lm = load_model(tmp_path, device="cpu", dtype=torch.float32, progress=False)
    assert lm.args.latent.softmax_scale == pytest.approx((16 + 8) ** -0.5 * (0.1 * math.log(40) + 1) ** 2)
    ids = prompt_ids()
    torch.testing.assert_close(lm.prefill_logits(ids), hf_logits(reference, ids), atol=1e-4, rtol=0)


# -- GGUF, as llama.cpp's converter writes deepseek2 (tests/support/gguf_deepseek.py) --


def test_the_gguf_writer_uses_gguf_pys_names_for_deepseek2():
    """The test writer's tensor names are those gguf-py's own map gives the HF names (the converter's source)."""
    import gguf

    from support.gguf_deepseek import _NAMES

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, 4)
    for hf, ours in _NAMES.items():
        assert names.get_name(f"model.layers.1.{hf}.weight", try_suffixes=(".weight",)) == f"blk.1.{ours}.weight"


@pytest.mark.parametrize("rope, split_kv_b", [("default", True), ("yarn", True), ("default", False)],
                         ids=["mqa-form", "mqa-form-yarn", "older-kv_b"])
def test_a_gguf_of_the_checkpoint_loads_to_the_same_model(rope, split_kv_b, tmp_path):
    """deepseek2 GGUFs: MLA as MQA with kv_b_proj split per head (the current converter) or whole with per-head
    sizes (older files); YaRN's scale as its log multiplier. Same logits and greedy tokens as transformers,
    resident and with the routed experts offloaded."""
    from support.decode_checks import gguf_matches_transformers
    from support.gguf_deepseek import write_deepseek_gguf

    reference = write_hf_checkpoint("deepseek_v3", tmp_path / "hf", rope=rope)
    path = write_deepseek_gguf(tmp_path / "hf", tmp_path / "ds.gguf", split_kv_b=split_kv_b)
    lm = gguf_matches_transformers(path, reference)
    assert (lm.args.latent.nope_dim, lm.args.latent.v_dim, lm.args.latent.kv_lora_rank) == (16, 12, 32)
