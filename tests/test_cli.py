"""The `ft` console script as a user runs it: a real subprocess of the installed entry point."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

FT = shutil.which("ft", path=str(Path(sys.executable).parent)) or shutil.which("ft")


def run_ft(*args: str, stdin: str | None = None, env_extra: dict | None = None, timeout: int = 300):
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([FT, *args], input=stdin, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def default_env(smollm2_gguf: Path) -> dict:
    return {"FREETOKEN_DEFAULT_MODEL": str(smollm2_gguf)}


def test_entry_point_is_installed():
    assert FT is not None, "the `ft` console script is not on PATH next to this Python"


def test_generate_answers_with_the_default_model_and_prints_only_the_completion(default_env):
    r = run_ft("generate", "--stats", "What is the capital of France?", env_extra=default_env)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "freetoken" not in r.stdout and "loading" not in r.stdout  # logs and progress stay on stderr
    assert "decode" in r.stderr and "tok/s" in r.stderr


def test_generate_raw_and_stop_string(default_env):
    r = run_ft("generate", "--raw", "--max-tokens", "12", "--stop", "\n", "The capital of France is",
               env_extra=default_env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() and "\n" not in r.stdout.rstrip("\n")


def test_chat_reads_turns_from_stdin(default_env):
    r = run_ft("chat", "--max-tokens", "20", stdin="What is the capital of France?\n/exit\n", env_extra=default_env)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_info_describes_the_default_model(default_env):
    r = run_ft("info", env_extra=default_env)
    assert r.returncode == 0, r.stderr
    assert "llama" in r.stdout and "134.52M" in r.stdout and "49152" in r.stdout


def test_info_of_a_moe_checkpoint_reports_experts(tmp_path):
    from support.checkpoints import write_hf_checkpoint

    write_hf_checkpoint("qwen3_moe", tmp_path / "m")
    r = run_ft("info", str(tmp_path / "m"))
    assert r.returncode == 0, r.stderr
    assert "qwen3_moe" in r.stdout and "top-2" in r.stdout and "per expert" in r.stdout


@pytest.mark.parametrize("family, expected", [
    ("qwen3_next", ["2 full-attention layers, 2 Gated DeltaNet", "KV per token   256 B"]),
    ("deepseek_v3", ["multi-head latent, 4 heads; cached per token: latent 32 + rotary key 8",
                     "KV per token   240 B"]),  # the latent once: it is read as keys and values
    ("gpt_oss", ["attention sinks; sliding window 8 on 2 of 4 layers", "8 routed per layer, top-2"]),
])
def test_info_of_the_new_families_says_what_their_cache_holds(family, expected, tmp_path):
    from support.checkpoints import write_hf_checkpoint

    write_hf_checkpoint(family, tmp_path / "m")
    r = run_ft("info", str(tmp_path / "m"))
    assert r.returncode == 0, r.stderr
    assert all(e in r.stdout for e in expected), r.stdout


@pytest.mark.parametrize(
    "args, expected",
    [
        (["generate", "--model", "/nonexistent/model", "hi"], "no such file or directory"),
        (["generate", "--model", "nobody-xyz/not-a-model", "hi"], "not in the Hugging Face cache"),
        (["generate", "--temperature", "-1", "hi"], "temperature"),
        (["generate", "--speculative", "hi"], "no multi-token-prediction support"),  # SmolLM2 has no MTP layer
        (["frobnicate"], "unknown verb"),
    ],
)
def test_bad_input_gives_one_line_and_status_2(args, expected, default_env):
    r = run_ft(*args, env_extra={**default_env, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and expected in lines[0], r.stderr
    assert r.stdout == ""


def test_unsupported_architecture_lists_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_neox", "hidden_size": 8}))
    r = run_ft("info", str(tmp_path))
    assert r.returncode == 2
    assert "gpt_neox" in r.stderr and "qwen3_moe" in r.stderr and "llama" in r.stderr


def test_chat_survives_a_turn_that_outgrows_the_context(tmp_path):
    from support.checkpoints import write_hf_checkpoint

    write_hf_checkpoint("llama", tmp_path / "m")  # context 256 tokens
    turns = "word " * 400 + "\nhello\n/exit\n"
    r = run_ft("chat", "--model", str(tmp_path / "m"), "--max-tokens", "4", stdin=turns)
    assert r.returncode == 0, r.stderr
    assert "context" in r.stderr and "/reset" in r.stderr
    assert r.stdout.strip()  # the second turn was answered


def test_generate_with_an_expert_cache_smaller_than_the_experts(tmp_path):
    """A MoE model with 192 MiB of routed experts served through a 64 MiB expert cache, on the CPU."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from support.checkpoints import VOCAB_SIZE, write_tokenizer

    cfg = Qwen3MoeConfig(vocab_size=VOCAB_SIZE, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64, moe_intermediate_size=512, num_experts=32,
                         num_experts_per_tok=4, norm_topk_prob=True, max_position_embeddings=512)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg)
    model.save_pretrained(tmp_path)
    write_tokenizer(tmp_path)
    expert_bytes = 4 * 32 * 3 * 256 * 512 * 4  # fp32 on the CPU
    assert expert_bytes == 192 * 2**20  # three times the cache
    args = ["generate", "--model", str(tmp_path), "--raw", "--max-tokens", "8", "--temperature", "0", "--stats"]
    resident = run_ft(*args, "the quick brown fox")
    cached = run_ft(*args, "--expert-cache", "64MiB", "the quick brown fox")
    assert resident.returncode == 0 and cached.returncode == 0, cached.stderr
    assert cached.stdout == resident.stdout  # lossless
    assert "expert cache: 42 of 128 experts" in cached.stderr and "evictions" in cached.stderr


def test_generate_speculative_prints_the_same_completion_and_the_drafts(tmp_path):
    """`--speculative` on a checkpoint with an MTP layer: the plain run's greedy completion, and with `--stats`
    how many drafts were accepted."""
    from support.checkpoints import write_hf_checkpoint
    from support.mtp_checkpoints import add_mtp_layer

    add_mtp_layer(tmp_path, write_hf_checkpoint("deepseek_v3", tmp_path))
    args = ["generate", "--model", str(tmp_path), "--raw", "--max-tokens", "12", "--temperature", "0", "--stats"]
    plain = run_ft(*args, "the quick brown fox")
    speculative = run_ft(*args, "--speculative", "the quick brown fox")
    assert plain.returncode == 0 and speculative.returncode == 0, speculative.stderr
    assert speculative.stdout == plain.stdout
    assert "drafts accepted" in speculative.stderr and "drafts accepted" not in plain.stderr
