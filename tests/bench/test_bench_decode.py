"""`ft bench decode` on a CPU-sized synthetic model, and the real-shape table it builds models from."""

from __future__ import annotations

import torch

from freetoken.bench.decode import main
from freetoken.bench.synthetic import build_synthetic, synthetic_config
from freetoken.engine.models import family_for


def test_qwen3_30b_a3b_shape_has_the_real_expert_pool():
    cfg = synthetic_config("qwen3-30b-a3b")
    spec = family_for(cfg["model_type"]).ModelArgs.from_config(cfg).moe_spec()
    per_expert = spec.bytes_per_expert(torch.bfloat16)
    assert per_expert == 3 * 2048 * 768 * 2  # 9.4 MB
    assert spec.total_routed_experts == 48 * 128 and round(per_expert * spec.total_routed_experts / 1e9) == 58


def test_synthetic_model_is_seeded_and_offloading_is_lossless():
    resident = build_synthetic("tiny-moe", dtype=torch.float32, seed=3)
    offloaded = build_synthetic("tiny-moe", dtype=torch.float32, seed=3, expert_cache=200_000)
    ids = list(range(1, 40))
    torch.testing.assert_close(resident.prefill_logits(ids), offloaded.prefill_logits(ids), atol=1e-5, rtol=0)
    assert offloaded.experts.counters.evictions > 0


def test_bench_decode_reports_every_strategy_with_equal_tokens(tmp_path, capsys):
    out = tmp_path / "d1.md"
    argv = ["--shape", "tiny-moe", "--device", "cpu", "--dtype", "float32", "--context", "48", "--tokens", "6",
            "--budgets", "0,1MiB", "--strategies", "resident,copy,cpu", "--policies", "freq,lru",
            "--out", str(out)]
    assert main(argv) == 0
    table = out.read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [r.split("|")[1].strip() + "/" + r.split("|")[2].strip() for r in rows] == [
        "resident/all", "copy (freq)/0", "copy (lru)/0", "copy (freq)/1MiB", "copy (lru)/1MiB", "cpu/0"]
    assert all(r.rstrip(" |").endswith("yes") for r in rows)  # fp32 on one device: every strategy is lossless
    assert "tiny-moe" in table and "command" in table
