"""Broken model sources fail with freetoken's own error types and messages that name the problem.

Each case starts from a good tiny checkpoint (tests/support/checkpoints.py) and breaks one thing: a missing
config.json or shard, a truncated shard, an unknown model_type or GGUF architecture, a GGUF with a bad magic or
cut short inside its tensor data.
"""

from __future__ import annotations

import json
import os

import gguf
import numpy as np
import pytest

from freetoken.engine.loader import load_model
from freetoken.errors import GGUFError, ModelLoadError, UnsupportedArchitectureError
from support.checkpoints import write_gguf_from_hf, write_hf_checkpoint


@pytest.fixture
def hf_dir(tmp_path):
    path = tmp_path / "tiny-llama"
    write_hf_checkpoint("llama", path, shards=2)
    return path


@pytest.fixture
def gguf_path(hf_dir):
    return write_gguf_from_hf(hf_dir, hf_dir.parent / "tiny-llama.gguf")


def _shards(hf_dir):
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    return sorted(set(index["weight_map"].values()))


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="no-such-model"):
        load_model(tmp_path / "no-such-model")


def test_missing_config_json(hf_dir):
    (hf_dir / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(hf_dir)


def test_missing_shard_named_in_the_index(hf_dir):
    missing = _shards(hf_dir)[-1]
    (hf_dir / missing).unlink()
    with pytest.raises(ModelLoadError, match=missing.replace(".", r"\.")):
        load_model(hf_dir)


def test_truncated_safetensors_shard(hf_dir):
    shard = hf_dir / _shards(hf_dir)[0]
    os.truncate(shard, shard.stat().st_size // 2)
    with pytest.raises(ModelLoadError, match="(?i)truncated") as err:
        load_model(hf_dir)
    assert shard.name in str(err.value)


def test_unsupported_model_type_lists_the_supported_ones(hf_dir):
    config = json.loads((hf_dir / "config.json").read_text())
    config["model_type"] = "gpt_neox"
    config["architectures"] = ["GPTNeoXForCausalLM"]
    (hf_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError, match="gpt_neox") as err:
        load_model(hf_dir)
    message = str(err.value)
    assert "supported" in message.lower()
    for family in ("llama", "mixtral", "qwen2_moe", "qwen3_moe"):
        assert family in message


def test_gguf_with_bad_magic(tmp_path):
    path = tmp_path / "bad-magic.gguf"
    path.write_bytes(b"GGUX" + bytes(60))
    with pytest.raises(GGUFError, match="(?i)magic"):
        load_model(path)


def test_gguf_truncated_in_tensor_data(gguf_path):
    # The last tensor's bytes end the file: cutting 100 bytes leaves every header intact.
    os.truncate(gguf_path, gguf_path.stat().st_size - 100)
    with pytest.raises(GGUFError, match="(?i)truncated") as err:
        load_model(gguf_path)
    assert gguf_path.name in str(err.value)


def test_gguf_of_an_unsupported_architecture(tmp_path):
    path = tmp_path / "bert.gguf"
    writer = gguf.GGUFWriter(str(path), "bert")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedArchitectureError, match="bert") as err:
        load_model(path)
    assert "supported" in str(err.value).lower()
