"""Loading keeps resident memory near the model's bytes: weights are read straight into their place, never
mapped and copied (mapped file pages would count a second time; reading this checkpoint through a memory map
measured 2x its size)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from support.checkpoints import PARITY_CASES, VOCAB_SIZE, write_gguf_from_hf, write_hf_checkpoint, write_tokenizer

MEASURE = r"""
import json, re, sys, torch
from freetoken.engine.loader import load_model
def rss():  # current resident set, bytes
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
load_model(sys.argv[3], progress=False, expert_cache=0)  # a tiny model first: lazy imports before the baseline
before = rss()
lm = load_model(sys.argv[1], progress=False, expert_cache=int(sys.argv[2]))
# VmHWM is this process's own peak; ru_maxrss would also remember the forking parent's across exec
with open("/proc/self/status") as f:
    peak = int(re.search(r"VmHWM:\s+(\d+) kB", f.read()).group(1)) * 1024
print(json.dumps({"before": before, "peak": peak, "after": rss()}))
"""


def _moe_checkpoint(path: Path) -> int:
    """A qwen3_moe checkpoint with 192 MiB of fp32 routed experts; returns its weight bytes."""
    cfg = Qwen3MoeConfig(vocab_size=VOCAB_SIZE, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64, moe_intermediate_size=512, num_experts=32,
                         num_experts_per_tok=4, norm_topk_prob=True, max_position_embeddings=512)
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(cfg).save_pretrained(path, max_shard_size="100MB")  # sharded, with an index
    write_tokenizer(path)
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def _peak_growth(model: Path, cache_bytes: int, tiny: Path) -> int:
    # cwd outside the source tree: `python -c` puts the cwd first on sys.path, which would shadow the installed
    # package with the repository's (where kernels/ is not yet mapped into freetoken.kernels).
    r = subprocess.run([sys.executable, "-c", MEASURE, str(model), str(cache_bytes), str(tiny)],
                       capture_output=True, text=True, cwd=tiny)
    assert r.returncode == 0, r.stderr
    m = json.loads(r.stdout.strip().splitlines()[-1])
    return m["peak"] - m["before"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("memory")
    model_bytes = _moe_checkpoint(root / "hf")
    write_hf_checkpoint(path=root / "tiny", **PARITY_CASES["qwen3_moe"])
    return root, model_bytes


def test_peak_rss_while_loading_safetensors_stays_near_the_model_bytes(checkpoints):
    root, model_bytes = checkpoints
    assert model_bytes > 190 * 2**20
    for cache_bytes in (0, 64 * 2**20):  # experts in host memory; plus a 64 MiB "device" cache (the CPU here)
        grown = _peak_growth(root / "hf", cache_bytes, root / "tiny")
        assert grown < model_bytes + cache_bytes + 48 * 2**20, (grown, model_bytes)


def test_peak_rss_while_loading_a_q8_0_gguf_stays_near_its_loaded_bytes(checkpoints):
    root, model_bytes = checkpoints
    gguf = write_gguf_from_hf(root / "hf", root / "m.gguf", tensor_type="Q8_0")
    # Offloaded experts stay Q8_0 in host memory; the dense rest is dequantized to fp32 (a small part here).
    loaded = gguf.stat().st_size + model_bytes // 20
    grown = _peak_growth(gguf, 0, root / "tiny")
    assert grown < loaded + 48 * 2**20, (grown, gguf.stat().st_size)
