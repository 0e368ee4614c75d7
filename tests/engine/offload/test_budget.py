"""`--expert-cache auto` sizing."""

import torch

from freetoken.engine.loader import load_model
from freetoken.engine.offload.budget import auto_expert_cache, kv_bytes_per_token
from support.checkpoints import PARITY_CASES, write_hf_checkpoint

GiB = 2**30


def test_what_is_left_after_dense_kv_and_activations_goes_to_experts():
    # a 24 GiB card with 21 GiB free, 3 GiB of dense weights, 3 GiB of KV: 13 GiB of the 58 GiB of experts
    assert auto_expert_cache(21 * GiB, 3 * GiB, 3 * GiB, 58 * GiB, activation_reserve=2 * GiB) == 13 * GiB


def test_everything_fits_means_resident_and_too_little_means_zero():
    assert auto_expert_cache(139 * GiB, 3 * GiB, 3 * GiB, 58 * GiB) is None
    assert auto_expert_cache(4 * GiB, 3 * GiB, 3 * GiB, 58 * GiB) == 0


def test_auto_on_the_cpu_keeps_experts_resident(tmp_path):
    write_hf_checkpoint(path=tmp_path, **PARITY_CASES["qwen2_moe"])
    lm = load_model(tmp_path, progress=False, expert_cache="auto")
    assert type(lm.experts).__name__ == "ResidentExpertExecutor"
    a = lm.args.decoder.attention
    assert kv_bytes_per_token(lm.args, torch.bfloat16) == 2 * lm.args.decoder.n_layers * a.n_kv_heads * a.head_dim * 2


def test_staging_is_two_steps_or_with_prefill_ahead_two_layers_of_experts_capped_in_bytes():
    from freetoken.bench.synthetic import synthetic_config
    from freetoken.engine.models import family_for
    from freetoken.engine.offload.budget import staging_slots_for

    def spec_of(shape):
        cfg = synthetic_config(shape)
        return family_for(cfg["model_type"]).ModelArgs.from_config(cfg).moe_spec()

    qwen, mixtral = spec_of("qwen3-30b-a3b"), spec_of("mixtral-8x7b")
    q, m = qwen.bytes_per_expert(torch.bfloat16), mixtral.bytes_per_expert(torch.bfloat16)
    assert staging_slots_for(qwen, q) == 16  # decode: 2 × top-8 of 9.4 MB
    assert staging_slots_for(mixtral, m) == 2  # 352 MB experts: the floor
    # streaming prefill ahead: 2 × 128 experts, the next layer streams while this one computes (2.25 GiB)
    assert staging_slots_for(qwen, q, prefill_ahead=True) == 256
    assert staging_slots_for(mixtral, m, prefill_ahead=True) == 9  # 3 GiB: one layer of 8 and one ahead
