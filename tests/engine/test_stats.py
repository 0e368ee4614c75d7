"""The engine stats snapshot reports what the executor and cache counted."""

import torch

from freetoken.engine.generator import Generator
from freetoken.engine.loader import load_model
from freetoken.engine.sampling import SamplingParams
from freetoken.engine.stats import snapshot
from support.checkpoints import PARITY_CASES, prompt_ids, write_hf_checkpoint


def test_snapshot_of_resident_offloaded_and_dense_models(tmp_path):
    write_hf_checkpoint(path=tmp_path / "moe", **PARITY_CASES["qwen3_moe"])
    write_hf_checkpoint(path=tmp_path / "dense", **PARITY_CASES["llama"])
    dense = snapshot(load_model(tmp_path / "dense", progress=False))
    assert dense.experts.mode == "none" and dense.kv is None and dense.dtype == "float32"

    resident = load_model(tmp_path / "moe", progress=False)
    spec = resident.moe_spec
    assert snapshot(resident).experts.mode == "resident"

    lm = load_model(tmp_path / "moe", progress=False, expert_cache=5 * spec.bytes_per_expert(torch.float32))
    lm.experts.gather_small_batches = True  # the decode path CUDA takes, which times its layer-steps
    lm.experts.planner.guard.window = 2  # windows of two layer-steps (the first one unmeasured)
    lm.experts.planner.guard._settle = 2
    cache = lm.new_cache()
    Generator(lm).generate_ids(prompt_ids(), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    stats = snapshot(lm, cache)
    ex, c = stats.experts, lm.experts.counters
    assert (ex.mode, ex.slots, ex.cached, ex.total_experts) == ("offloaded", 5, 5, spec.total_routed_experts)
    assert (ex.hits, ex.misses, ex.evictions, ex.bytes_copied) == (c.hits, c.misses, c.evictions, c.bytes_copied)
    assert ex.layer_steps == c.layer_steps > 0 and ex.host_seconds == c.host_seconds > 0
    assert stats.kv.pages_total == cache.allocator.num_pages and stats.as_dict()["experts"]["hit_rate"] == c.hit_rate
    assert ex.miss_path == "auto" and ex.guard_way in ("split", "cpu", "copy")  # the path guard's choice
    guard = lm.experts.planner.guard
    assert ex.guard_windows_closed == guard.windows_closed > 0  # what each window measured, for diagnostics
    assert len(ex.guard_windows) == len(guard.history) and ex.guard_windows[0][0] == "split"  # measured first
    assert ex.guard_windows[0][3] == 2 and ex.guard_windows[0][2] > 0  # two steps, µs per miss
