"""`ft bench decode` shapes of DeepSeek-V4: the real V4-Flash expert pool, and a CPU-sized V4 that decodes the
resident run's tokens under every miss path."""

from __future__ import annotations

import torch

from freetoken.bench.decode import main
from freetoken.bench.synthetic import build_synthetic, synthetic_config
from freetoken.engine.models import family_for


def test_deepseek_v4_flash_shape_has_its_expert_pool():
    cfg = synthetic_config("deepseek-v4-flash")
    args = family_for(cfg["model_type"]).ModelArgs.from_config(cfg)
    spec = args.moe_spec()
    assert (spec.moe_layers, spec.num_experts, spec.top_k, spec.num_shared_experts) == (tuple(range(43)), 256, 6, 1)
    assert spec.bytes_per_expert(torch.bfloat16) == 3 * 4096 * 2048 * 2
    assert round(spec.total_routed_experts * spec.bytes_per_expert(torch.bfloat16) / 1e9) == 554
    a = args.attention
    assert (a.head_dim, a.rope_dim, a.window, a.kinds[:4]) == (512, 64, 128, (
        "heavily_compressed_attention", "heavily_compressed_attention", "heavily_compressed_attention",
        "compressed_sparse_attention"))
    assert args.routing.hash_layers == (0, 1, 2) and a.compress_rope.rope_type == "yarn"


def test_a_truncated_v4_shape_builds_with_hash_tables_of_distinct_experts():
    lm = build_synthetic("tiny-v4", dtype=torch.float32, layers=2, seed=1)
    table = lm.model.model.layers[0].ffn.gate.tid2eid
    assert table.shape == (512, 4) and all(len(set(row)) == 4 for row in table.tolist())
    assert int(table.max()) < 16 and torch.isfinite(lm.prefill_logits(list(range(1, 30)))).all()


def test_tiny_v4_decodes_under_every_strategy(tmp_path):
    out = tmp_path / "v4.md"
    argv = ["--shape", "tiny-v4", "--device", "cpu", "--dtype", "float32", "--context", "40", "--tokens", "5",
            "--budgets", "0", "--strategies", "resident,copy,cpu,auto", "--probe-mib", "64", "--out", str(out)]
    assert main(argv) == 0
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == 4 and all(r.split("|")[12].strip() == "yes" for r in rows)


def test_the_graph_row_is_refused_for_v4(tmp_path):
    """No captured decode for V4: asking for the resident-graphs row says so instead of failing mid-run."""
    import pytest

    argv = ["--shape", "tiny-v4", "--device", "cpu", "--dtype", "float32", "--context", "40", "--tokens", "2",
            "--strategies", "resident-graphs", "--probe-mib", "64", "--out", str(tmp_path / "g.md")]
    with pytest.raises(SystemExit, match="cannot be captured"):
        main(argv)
