"""What the family GGUF writers of the tests share: reading the tiny HF checkpoint, the metadata every
architecture states the same way, and writing the file (tokenizer, tensors)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

from support.checkpoints import _write_tokenizer_metadata


def read_checkpoint(hf_dir: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json, every tensor of the safetensors files)."""
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        tensors |= load_file(f)
    return json.loads((Path(hf_dir) / "config.json").read_text()), tensors


def open_writer(gguf_path: Path, arch: str, cfg: dict) -> gguf.GGUFWriter:
    """A writer for `arch` with the metadata every architecture states alike."""
    w = gguf.GGUFWriter(str(gguf_path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    if "intermediate_size" in cfg:  # (Qwen3.5-MoE states none: every layer routes)
        w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    return w


def close_writer(w: gguf.GGUFWriter, hf_dir: Path, tensors: dict, pre: str = "qwen2") -> None:
    """Writes the tokenizer and `tensors` (name → float32 array, or (block bytes, ggml type)) and the file."""
    _write_tokenizer_metadata(w, Path(hf_dir), pre=pre)
    for name, t in tensors.items():
        array, raw = t if isinstance(t, tuple) else (t, None)
        w.add_tensor(name, np.ascontiguousarray(array), raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
