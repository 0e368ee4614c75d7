"""`ft bench decode` on a CPU-sized synthetic model, and the real-shape table it builds models from."""

from __future__ import annotations

import argparse
import re

import pytest
import torch

from freetoken import host_load
from freetoken.bench.decode import default_warmup, main, resident_rows_refusal
from freetoken.bench.synthetic import build_synthetic, synthetic_config
from freetoken.engine.models import family_for


def test_qwen3_30b_a3b_shape_has_the_real_expert_pool():
    cfg = synthetic_config("qwen3-30b-a3b")
    spec = family_for(cfg["model_type"]).ModelArgs.from_config(cfg).moe_spec()
    per_expert = spec.bytes_per_expert(torch.bfloat16)
    assert per_expert == 3 * 2048 * 768 * 2  # 9.4 MB
    assert spec.total_routed_experts == 48 * 128 and round(per_expert * spec.total_routed_experts / 1e9) == 58


def test_deepseek_v3_like_shape_has_deepseek_v3s_routed_expert_pool():
    cfg = synthetic_config("deepseek-v3-like")
    spec = family_for(cfg["model_type"]).ModelArgs.from_config(cfg).moe_spec()
    assert spec.moe_layers == tuple(range(3, 61)) and spec.num_experts == 256 and spec.top_k == 8
    assert spec.bytes_per_expert(torch.bfloat16) == 3 * 7168 * 2048 * 2
    assert round(spec.total_routed_experts * spec.bytes_per_expert(torch.bfloat16) / 1e12, 1) == 1.3


def test_synthetic_model_is_seeded_and_offloading_is_lossless():
    resident = build_synthetic("tiny-moe", dtype=torch.float32, seed=3)
    offloaded = build_synthetic("tiny-moe", dtype=torch.float32, seed=3, expert_cache=200_000)
    ids = list(range(1, 40))
    torch.testing.assert_close(resident.prefill_logits(ids), offloaded.prefill_logits(ids), atol=1e-5, rtol=0)
    assert offloaded.experts.counters.evictions > 0


@pytest.mark.parametrize("shape", ["tiny-hybrid", "tiny-mla", "tiny-dsa", "tiny-gpt-oss"])
def test_the_new_families_shapes_decode_under_every_strategy(shape, tmp_path):
    """The synthetic Qwen3-Next structure (DeltaNet layers with recurrent state, shared expert), DeepSeek-V3's
    (latent attention, grouped sigmoid routing), GLM-5's (sparse attention: 16 keys of the 40-token context) and
    gpt-oss's (sinks, windows, expert biases): every miss path
    gives the resident run's tokens."""
    out = tmp_path / "shape.md"
    argv = ["--shape", shape, "--device", "cpu", "--dtype", "float32", "--context", "40", "--tokens", "5",
            "--budgets", "0", "--strategies", "resident,copy,cpu,auto", "--probe-mib", "64", "--out", str(out)]
    assert main(argv) == 0
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == 4 and all(r.split("|")[12].strip() == "yes" for r in rows)


def test_bench_decode_reports_every_strategy_with_equal_tokens(tmp_path, capsys):
    out = tmp_path / "d1.md"
    argv = ["--shape", "tiny-moe", "--device", "cpu", "--dtype", "float32", "--context", "48", "--tokens", "6",
            "--budgets", "0,1MiB", "--strategies", "resident,copy,cpu,auto", "--policies", "freq,lru",
            "--probe-mib", "64", "--out", str(out)]
    assert main(argv) == 0
    table = out.read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [r.split("|")[1].strip() + "/" + r.split("|")[2].strip() for r in rows] == [
        "resident/all", "copy (freq)/0", "copy (lru)/0", "copy (freq)/1MiB", "copy (lru)/1MiB", "cpu/0",
        "auto (freq)/0", "auto (lru)/0", "auto (freq)/1MiB", "auto (lru)/1MiB"]
    assert all(r.split("|")[12].strip() == "yes" for r in rows)  # fp32 on one device: every strategy is lossless
    assert "tiny-moe" in table and "command" in table
    # what the host's CPUs did over each row's timed tokens (Linux): a noisy or shared host shows there
    shown = re.findall(r"host CPUs over the timed tokens: busy \d+%, idle \d+%, steal [\d.]+%", capsys.readouterr().err)
    assert len(shown) == (len(rows) if host_load.read() is not None else 0)


def _top_share(skew: float) -> float:
    """Share of (token, expert) pairs that go to each layer's 4 most popular of 16 experts, averaged."""
    lm = build_synthetic("tiny-moe", dtype=torch.float32, skew=skew)
    routed: dict[int, list[torch.Tensor]] = {}
    forward = lm.experts.forward

    def record(layer, hidden, ids, weights):
        routed.setdefault(layer, []).append(ids.flatten())
        return forward(layer, hidden, ids, weights)

    lm.experts.forward = record
    lm.prefill_logits(torch.randint(0, 512, (512,), generator=torch.Generator().manual_seed(0)).tolist())
    shares = []
    for ids in routed.values():
        counts = torch.bincount(torch.cat(ids), minlength=16).float().sort(descending=True).values
        shares.append((counts[:4].sum() / counts.sum()).item())
    return sum(shares) / len(shares)


def test_synthetic_routing_is_diverse_and_skew_concentrates_it():
    uniform, skewed = _top_share(0.0), _top_share(1.0)
    assert uniform < 0.33  # 4 of 16 experts: 0.25 is perfectly uniform; a collapsed router gives ~1
    assert skewed > uniform + 0.08


def test_cache_replay_counts_decode_hits_of_a_recorded_trace():
    from freetoken.bench.cache_sim import record_routing, replay

    lm = build_synthetic("tiny-moe", dtype=torch.float32)
    prefill, decode = record_routing(lm, context=32, tokens=12)
    assert len(decode) == 12 and all(len(step) == 4 for step in decode)  # 4 MoE layers per forward
    assert all(len(experts) == 4 for step in decode for _, experts in step)  # top-4 of one token
    total = lm.moe_spec.total_routed_experts
    assert replay(prefill, decode, 0, "lru") == 0.0
    assert replay(prefill, decode, total, "lru") == 1.0  # the prefill touched every expert: all decode hits
    rates = [replay(prefill, decode, total // 4, policy) for policy in ("lru", "freq", "freq-admit")]
    assert all(0.0 < r < 1.0 for r in rates)


@pytest.mark.parametrize("fmt, shape", [("Q8_0", "tiny-moe"), ("MXFP4", "tiny-gpt-oss")])
def test_bench_decode_with_quantized_host_experts_is_lossless(fmt, shape, tmp_path):
    out = tmp_path / "d1.md"
    argv = ["--shape", shape, "--device", "cpu", "--dtype", "float32", "--context", "48", "--tokens", "4",
            "--budgets", "0", "--strategies", "resident,copy,cpu,auto", "--expert-format", fmt, "--probe-mib", "64",
            "--out", str(out)]
    assert main(argv) == 0
    table = out.read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == 4 and all(r.split("|")[12].strip() == "yes" for r in rows)
    assert f"{fmt} experts in host memory" in table


@pytest.mark.parametrize("fmt", ["Q8_0", "MXFP4"])
def test_quantized_synthetic_experts_dequantize_to_the_intended_scale(fmt):
    lm = build_synthetic("tiny-moe", dtype=torch.float32, expert_cache=0, expert_format=fmt)
    host = next(iter(lm.experts.host.values()))
    gate = host.dequantized(0, "gate_proj", torch.float32)
    assert gate.shape == (64, 128) and 0.015 < gate.std().item() < 0.03


def test_transformers_accelerate_baseline_runs_the_same_weights(tmp_path):
    """The hf-accelerate row loads the synthetic model's weights into transformers: on CPU in fp32 it must
    produce the very tokens freetoken produces (the same model, two implementations)."""
    out = tmp_path / "d1.md"
    argv = ["--shape", "tiny-moe", "--device", "cpu", "--dtype", "float32", "--context", "40", "--tokens", "5",
            "--budgets", "0", "--strategies", "resident,hf-accelerate", "--probe-mib", "64", "--out", str(out)]
    assert main(argv) == 0
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [r.split("|")[1].strip() for r in rows] == ["resident", "hf-accelerate"]
    assert rows[1].split("|")[12].strip() == "yes" and float(rows[1].split("|")[3]) > 0


def test_every_named_shape_reads_as_its_family():
    """The real shapes are only built on the device; here each at least parses into its family's arguments
    with the expert pool its comment states."""
    from freetoken.bench.synthetic import SHAPES, synthetic_config
    from freetoken.engine.models import family_for

    gb = {}
    for shape in SHAPES:
        cfg = synthetic_config(shape)
        spec = family_for(cfg["model_type"]).ModelArgs.from_config(cfg).moe_spec()
        gb[shape] = spec.total_routed_experts * spec.bytes_per_expert(torch.bfloat16) / 1e9
    assert round(gb["qwen3-next-80b-a3b"]) == 155 and round(gb["glm-4.5-air"]) == 199
    assert round(gb["deepseek-v3"], -2) == 1300 and round(gb["qwen3.5-35b-a3b"]) == 64
    assert round(gb["glm-5"], -2) == 1400


def test_recurrent_shapes_without_their_graph_path_refuse_the_graph_row_and_decode_eagerly(tmp_path, monkeypatch):
    """With GPU path "recurrent-graphs" off (FREETOKEN_DISABLE), hybrids decode eagerly: the graph row is refused
    and the floor adds the eager resident time."""
    from freetoken.engine import gpu_paths

    monkeypatch.setattr(gpu_paths, "enabled", lambda name: name != "recurrent-graphs" and name in gpu_paths.MEASURED)
    with pytest.raises(SystemExit, match="recurrent layers"):
        main(["--shape", "tiny-hybrid", "--device", "cpu", "--strategies", "resident-graphs", "--probe-mib", "64"])
    out = tmp_path / "eager.md"
    assert main(["--shape", "tiny-hybrid", "--device", "cpu", "--dtype", "float32", "--context", "16", "--tokens",
                 "2", "--budgets", "0", "--strategies", "resident,auto", "--probe-mib", "64", "--out", str(out)]) == 0
    text = out.read_text()
    assert "every row decodes eagerly" in text and "floor = resident time +" in text


def test_the_resident_rows_experts_keep_their_form():
    """The bench's resident baseline copies each layer's experts to the device: gpt-oss's biases and clamped
    SwiGLU must come along (without them its row computed another function: seen on the H200)."""
    from freetoken.bench.decode import _on_device
    from freetoken.bench.synthetic import build_synthetic

    lm = build_synthetic("tiny-gpt-oss", device="cpu", dtype=torch.float32, expert_cache=1 << 20)
    moved = _on_device(lm.experts.host[0], torch.device("cpu"), torch.float32)
    assert moved.form is not None and moved.form.clamped
    torch.testing.assert_close(moved.form.down_bias, lm.experts.host[0].form.down_bias)


def test_the_floor_counts_hits_a_prefetch_made_for_their_step_as_misses():
    """A prefetched expert admitted to the cache is a hit when its layer runs, but its bytes crossed the link for
    that step: the floor is physical only if it moves them too. The hit rate keeps them; the bracket leaves
    them out."""
    from types import SimpleNamespace

    from freetoken.bench.decode import Ceilings, _format_row, _row
    from freetoken.engine.offload.expert_cache import CacheCounters

    before = CacheCounters()
    after = CacheCounters(hits=40, misses=60, prefetch_hits=10, bytes_copied=30 * 10**6, cpu_experts=40)
    ceilings = Ceilings(h2d=50.0, dram_read=100.0, cpu_experts=80.0)
    row = _row("auto", "8GiB", 10.0, before, after, 2, ceilings, SimpleNamespace(expert_bytes=10**6))
    assert row.miss_gb_per_token == pytest.approx((60 + 10) * 10**6 / 2 / 1e9)
    assert row.floor_tok_s == pytest.approx(100e9 / (35 * 10**6))  # misses + prefetch hits over DRAM's 100 GB/s
    assert row.hit_rate == pytest.approx(0.4) and row.hit_rate_cached == pytest.approx(0.3)
    assert "| 40.0% (30.0%) |" in _format_row(row)


def test_the_floor_moves_no_bytes_for_misses_the_block_store_served():
    """A slot miss dequantized from the block store never crossed the link: a hit for the floor and the rate."""
    from types import SimpleNamespace

    from freetoken.bench.decode import Ceilings, _row
    from freetoken.engine.offload.expert_cache import CacheCounters

    after = CacheCounters(hits=40, misses=60, store_hits=25, bytes_copied=15 * 10**6, cpu_experts=20)
    ceilings = Ceilings(h2d=50.0, dram_read=100.0, cpu_experts=80.0)
    row = _row("auto", "8GiB", 10.0, CacheCounters(), after, 2, ceilings, SimpleNamespace(expert_bytes=10**6))
    assert row.miss_gb_per_token == pytest.approx(35 * 10**6 / 2 / 1e9)
    assert row.hit_rate == pytest.approx(0.65)


def test_bench_decode_compares_block_shares_row_by_row(tmp_path):
    out = tmp_path / "d1.md"
    argv = ["--shape", "tiny-moe", "--device", "cpu", "--dtype", "float32", "--context", "48", "--tokens", "4",
            "--budgets", "64KiB", "--strategies", "resident,copy", "--expert-format", "Q8_0", "--block-shares",
            "0,1", "--probe-mib", "64", "--out", str(out)]
    assert main(argv) == 0
    rows = [line.split("|") for line in out.read_text().splitlines() if line.startswith("| copy")]
    assert [r[1].strip() for r in rows] == ["copy (blocks 0)", "copy (blocks 1)"]
    assert all(r[12].strip() == "yes" for r in rows)
    stored, plain = float(rows[1][4].strip().split("%")[0]), float(rows[0][4].strip().split("%")[0])
    assert stored > plain  # about twice the experts in the same bytes


def test_resident_rows_that_cannot_fit_the_device_are_refused_before_the_build():
    """gpt-oss-120b's MXFP4 experts are 230 GB dequantized to bf16: the resident rows are refused with the fix
    named, whatever fits; without them, or with fewer layers, nothing is refused."""
    a = argparse.Namespace(shape="gpt-oss-120b", layers=None, strategies=["resident-graphs", "copy"])
    why = resident_rows_refusal(a, torch.bfloat16, 140 * 10**9)
    assert why and "resident rows need 229 GB of bfloat16 experts" in why and "140 GB free" in why
    assert "--layers" in why
    assert resident_rows_refusal(argparse.Namespace(shape="gpt-oss-120b", layers=None, strategies=["copy", "auto"]),
                                 torch.bfloat16, 140 * 10**9) is None
    assert resident_rows_refusal(argparse.Namespace(shape="gpt-oss-120b", layers=12, strategies=["resident"]),
                                 torch.bfloat16, 140 * 10**9) is None


def test_the_default_warm_up_gives_shallow_models_the_layer_steps_of_a_deep_one():
    """32 tokens of the 48-layer D1 model are 1,536 layer-steps; a model cut to 8 MoE layers gets as many."""
    assert default_warmup(48) == 32 and default_warmup(94) == 32
    assert default_warmup(8) == 192 and default_warmup(5) == 308
