"""`ft bench export`: a synthetic real-shape model written as files other engines load, for side-by-side runs.

Two formats: `safetensors` (an HF directory: config.json, bf16 safetensors shards with an index, tokenizer.json and
tokenizer_config.json; `transformers` loads it) and `gguf-q8_0` (one GGUF file: dense tensors bf16, norms f32,
routed experts Q8_0 as llama.cpp's stacked `ffn_*_exps` tensors; llama.cpp loads it). The weights are exactly
those `build_synthetic` makes for the same shape, layers, seed and skew, so freetoken's in-memory benchmark and
another engine reading the file run the very same model. The tokenizer is a real one (SmolLM2's byte-level BPE
and chat template, from the embedded default model), its vocabulary padded with unused tokens up to the
shape's vocab size so the embedding keeps the real model's shape. Files are written tensor by tensor.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import gguf
import numpy as np
import torch

from freetoken.bench.synthetic import SHAPES, build_synthetic
from freetoken.engine.formats.gguf_file import GGUFFile
from freetoken.engine.formats.gguf_model import GGUF_ARCHITECTURES
from freetoken.engine.offload.quantized import PROJECTIONS, QuantizedExperts
from freetoken.engine.sources import ensure_default_model

HF_ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                    "mixtral": "MixtralForCausalLM", "qwen3_next": "Qwen3NextForCausalLM"}
GGUF_ARCH = {v: k for k, v in GGUF_ARCHITECTURES.items() if k != "llama"}  # llama permutes Q/K: not written here
SHARD_BYTES = 4 << 30
_HF_TO_GGUF = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
_GGUF_EXPERTS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}
UNUSED_TOKEN = 5  # llama.cpp's LLAMA_TOKEN_TYPE_UNUSED


def tokenizer_metadata(vocab_size: int) -> dict:
    """SmolLM2's GGUF vocabulary metadata, padded with unused tokens to `vocab_size`."""
    md = GGUFFile(ensure_default_model()).metadata
    keys = [k for k in md if k.startswith("tokenizer.")]
    out = {k: md[k] for k in keys}
    tokens = [str(t) for t in out["tokenizer.ggml.tokens"]]
    types = [int(t) for t in out["tokenizer.ggml.token_type"]]
    if vocab_size < len(tokens):
        raise ValueError(f"vocab size {vocab_size} is smaller than the tokenizer's {len(tokens)} tokens")
    pad = vocab_size - len(tokens)
    out["tokenizer.ggml.tokens"] = tokens + [f"<|ft_unused_{i}|>" for i in range(pad)]
    out["tokenizer.ggml.token_type"] = types + [UNUSED_TOKEN] * pad
    return out


def _dense_tensors(lm) -> list[tuple[str, torch.Tensor]]:
    return [(name, p.detach()) for name, p in lm.model.named_parameters()]


def _hf_expert_tensors(host_experts: dict):
    for layer, host in sorted(host_experts.items()):
        for e in range(host.num_experts):
            for p, w in zip(PROJECTIONS, host.weights_of(e), strict=True):
                yield f"model.layers.{layer}.mlp.experts.{e}.{p}.weight", w


def write_safetensors_dir(lm, out: Path, host_experts: dict | None = None, tokenizer: bool = True) -> Path:
    """`host_experts`: the layers' routed experts (default: the model's executor's host store). `tokenizer`:
    also write SmolLM2's tokenizer (needs the default model, fetched once)."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = _dense_tensors(lm) + list(_hf_expert_tensors(host_experts or lm.experts.host))
    shards, current, size = [], [], 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = [], 0
        current.append((name, t))
        size += nbytes
    shards.append(current)
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _write_safetensors(out / file, shard)
        weight_map.update(dict.fromkeys((name for name, _ in shard), file))
        print(f"wrote {file}", file=sys.stderr, flush=True)
    total = sum(t.numel() * t.element_size() for _, t in tensors)
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    arch = HF_ARCHITECTURES.get(lm.config["model_type"])
    if arch is None:
        raise ValueError(f"safetensors export supports {', '.join(HF_ARCHITECTURES)}, not {lm.config['model_type']!r}")
    cfg = dict(lm.config, architectures=[arch], tie_word_embeddings=False,
               torch_dtype=str(lm.dtype).removeprefix("torch."))
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    if tokenizer:
        _write_hf_tokenizer(out, cfg["vocab_size"])
    return out


def _write_safetensors(path: Path, tensors: list[tuple[str, torch.Tensor]]) -> None:
    dtypes = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16"}
    header, offset = {}, 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": dtypes[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt", "producer": "freetoken bench export"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for _, t in tensors:
            f.write(memoryview(t.contiguous().view(torch.uint8).numpy()))


def _write_hf_tokenizer(out: Path, vocab_size: int) -> None:
    from freetoken.engine.gguf_vocab import build_gguf_vocab

    md = tokenizer_metadata(vocab_size)
    vocab = build_gguf_vocab(md)
    vocab.backend.save(str(out / "tokenizer.json"))
    tokens = md["tokenizer.ggml.tokens"]
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": md.get("tokenizer.chat_template"),
           "bos_token": tokens[vocab.bos_token_id] if vocab.bos_token_id is not None else None,
           "eos_token": tokens[vocab.eos_token_id] if vocab.eos_token_id is not None else None,
           "add_bos_token": vocab.add_bos, "model_max_length": 1 << 20}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))


def write_gguf_q8_0(lm, path: Path) -> Path:
    """Dense tensors bf16 (norms f32), routed experts Q8_0, SmolLM2's vocabulary padded to the shape's."""
    cfg, spec = lm.config, lm.moe_spec
    arch = GGUF_ARCH.get(cfg["model_type"])
    if arch is None:
        raise ValueError(f"GGUF export supports {', '.join(GGUF_ARCH)}, not {cfg['model_type']!r}")
    host = lm.experts.host
    if not isinstance(next(iter(host.values())), QuantizedExperts):
        raise ValueError("build the model with expert_format='Q8_0' to write a Q8_0 GGUF")
    w = gguf.GGUFWriter(str(path), arch)
    _write_gguf_metadata(w, cfg, spec)
    for name, t in _dense_tensors(lm):
        gname = _gguf_name(name)
        if t.ndim == 1:
            w.add_tensor(gname, t.float().numpy())
        else:
            w.add_tensor(gname, t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint8),
                         raw_dtype=gguf.GGMLQuantizationType.BF16)
    for layer, q in sorted(host.items()):
        for p in PROJECTIONS:
            out_dim, in_dim = q.shapes[p]
            raw = q.raw[p].view(q.num_experts, out_dim, in_dim // 32 * 34)
            w.add_tensor(f"blk.{layer}.{_GGUF_EXPERTS[p]}.weight", raw.numpy(),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    return path


def _gguf_name(hf: str) -> str:
    globals_ = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
    if hf in globals_:
        return globals_[hf]
    parts = hf.split(".")  # model.layers.{i}.{part...}.weight
    part = _HF_TO_GGUF.get(".".join(parts[3:-1]))
    if part is None:
        raise ValueError(f"the GGUF writer has no name for {hf} (this shape's layers are not all attention and "
                         "experts); write --format safetensors instead")
    return f"blk.{parts[2]}.{part}.{parts[-1]}"


def _write_gguf_metadata(w: gguf.GGUFWriter, cfg: dict, spec) -> None:
    w.add_name("freetoken synthetic")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg.get("intermediate_size", 0))
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    head_dim = cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_count(spec.num_experts)
    w.add_expert_used_count(spec.top_k)
    w.add_expert_feed_forward_length(spec.expert_intermediate_size)
    if spec.shared_expert_intermediate_size:
        w.add_expert_shared_feed_forward_length(spec.shared_expert_intermediate_size)
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    for key, value in tokenizer_metadata(cfg["vocab_size"]).items():
        _add_kv(w, key, value)


def _add_kv(w: gguf.GGUFWriter, key: str, value) -> None:
    if isinstance(value, np.ndarray | np.generic):  # as the GGUF parser returned it
        value = value.tolist()
    if isinstance(value, list):
        value = [v.item() if isinstance(v, np.generic) else v for v in value]
    if isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    else:
        w.add_array(key, list(value))


def build_for_export(shape: str, fmt: str, layers: int | None = None, seed: int = 0, skew: float = 0.0):
    """The synthetic model `fmt` writes; a shape whose vocabulary is smaller than the tokenizer's grows to it."""
    tokens = len(GGUFFile(ensure_default_model()).metadata["tokenizer.ggml.tokens"])
    vocab = max(SHAPES[shape]["vocab_size"], tokens)
    return build_synthetic(shape, device="cpu", dtype=torch.bfloat16, expert_cache=0, layers=layers, seed=seed,
                           skew=skew, expert_format="Q8_0" if fmt == "gguf-q8_0" else "dense", vocab_size=vocab)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="ft bench export", description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    p.add_argument("--layers", type=int, default=None, help="truncate the model to this many layers")
    p.add_argument("--format", default="gguf-q8_0", choices=["safetensors", "gguf-q8_0"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skew", type=float, default=0.0, help="Zipf exponent of expert popularity (0: near-uniform)")
    p.add_argument("--out", type=Path, required=True, help="a directory (safetensors) or a .gguf file")
    a = p.parse_args(argv)
    lm = build_for_export(a.shape, a.format, a.layers, a.seed, a.skew)
    try:
        path = write_gguf_q8_0(lm, a.out) if a.format == "gguf-q8_0" else write_safetensors_dir(lm, a.out)
    except ValueError as e:
        if a.format == "gguf-q8_0":  # no half-written file left behind
            a.out.unlink(missing_ok=True)
        raise SystemExit(f"ft bench export: {e}") from None
    print(path)
    return 0
