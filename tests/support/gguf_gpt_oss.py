"""gpt-oss checkpoints written as GGUF the way llama.cpp's converter writes them (`convert_hf_to_gguf.py`,
GptOssModel), from the tiny checkpoints `write_hf_checkpoint` writes (dense experts) or their MXFP4 copies:

- names from gguf-py's tensor map for gpt-oss: the router is `ffn_gate_inp`, the sinks `attn_sinks.weight`, the
  second norm `post_attention_norm`;
- the fused experts are split: HF's `gate_up_proj` [E, H, 2I] (gate and up interleaved) becomes `ffn_gate_exps`
  and `ffn_up_exps` [E, I, H], `down_proj` [E, I, H] becomes `ffn_down_exps` [E, H, I], biases alike;
- MXFP4 experts stay MXFP4: each 32-weight block as ggml's `block_mxfp4`, the E8M0 scale byte and then 16 bytes
  whose low nibbles hold weights 0-15 and high nibbles 16-31 (OpenAI's bytes hold neighbours 2j, 2j+1);
- the metadata states no SwiGLU clamp (llama.cpp fixes it at 7.0), so the checkpoint must use 7.0.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from support.gguf_writing import close_writer, open_writer, read_checkpoint

_LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.sinks": "attn_sinks.weight", "mlp.router.weight": "ffn_gate_inp.weight",
    "mlp.router.bias": "ffn_gate_inp.bias",
    **{f"self_attn.{hf}_proj.{kind}": f"attn_{g}.{kind}" for hf, g in
       (("q", "q"), ("k", "k"), ("v", "v"), ("o", "output")) for kind in ("weight", "bias")},
}


def mxfp4_to_ggml_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """OpenAI's MXFP4 [..., G, 16] codes + [..., G] scales → ggml blocks [..., G * 17] bytes."""
    lo, hi = (blocks & 0x0F).int(), (blocks >> 4).int()
    codes = torch.stack((lo, hi), dim=-1).flatten(-2)  # [..., G, 32]: weight j of the block at j
    qs = (codes[..., :16] | (codes[..., 16:] << 4)).to(torch.uint8)
    return torch.cat((scales.unsqueeze(-1), qs), dim=-1).flatten(-2).numpy()


def _tensors(hf: dict[str, torch.Tensor], n_layers: int) -> dict[str, tuple[np.ndarray, object]]:
    """GGUF name → (array, raw ggml type or None for float32)."""
    out = {"token_embd.weight": (hf["model.embed_tokens.weight"], None),
           "output_norm.weight": (hf["model.norm.weight"], None), "output.weight": (hf["lm_head.weight"], None)}
    for i in range(n_layers):
        pre, blk = f"model.layers.{i}.", f"blk.{i}."
        out |= {blk + g: (hf[pre + n], None) for n, g in _LAYER.items()}
        experts = pre + "mlp.experts."
        bias = hf[experts + "gate_up_proj_bias"]
        out[blk + "ffn_gate_exps.bias"], out[blk + "ffn_up_exps.bias"] = (bias[:, 0::2], None), (bias[:, 1::2], None)
        out[blk + "ffn_down_exps.bias"] = (hf[experts + "down_proj_bias"], None)
        if experts + "gate_up_proj_blocks" in hf:  # [E, out, G, 16], out-by-in; gate and up rows interleaved
            blocks, scales = hf[experts + "gate_up_proj_blocks"], hf[experts + "gate_up_proj_scales"]
            mxfp4 = gguf.GGMLQuantizationType.MXFP4
            out[blk + "ffn_gate_exps.weight"] = (mxfp4_to_ggml_blocks(blocks[:, 0::2], scales[:, 0::2]), mxfp4)
            out[blk + "ffn_up_exps.weight"] = (mxfp4_to_ggml_blocks(blocks[:, 1::2], scales[:, 1::2]), mxfp4)
            out[blk + "ffn_down_exps.weight"] = (mxfp4_to_ggml_blocks(hf[experts + "down_proj_blocks"],
                                                                      hf[experts + "down_proj_scales"]), mxfp4)
        else:
            gate_up = hf[experts + "gate_up_proj"].transpose(1, 2)  # [E, 2I, H]
            out[blk + "ffn_gate_exps.weight"] = (gate_up[:, 0::2], None)
            out[blk + "ffn_up_exps.weight"] = (gate_up[:, 1::2], None)
            out[blk + "ffn_down_exps.weight"] = (hf[experts + "down_proj"].transpose(1, 2), None)
    return {n: t.float().numpy() if raw is None else (t, raw) for n, (t, raw) in out.items()}


def write_gpt_oss_gguf(hf_dir: Path, gguf_path: Path) -> Path:
    cfg, hf = read_checkpoint(hf_dir)
    if cfg.get("swiglu_limit", 7.0) != 7.0:
        raise ValueError("a gpt-oss GGUF states no SwiGLU clamp (llama.cpp uses 7.0): write the checkpoint with "
                         "swiglu_limit=7.0")
    rope = cfg["rope_parameters"]
    w = open_writer(gguf_path, "gpt-oss", cfg)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_expert_count(cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_sliding_window(cfg["sliding_window"])
    w.add_expert_feed_forward_length(cfg["intermediate_size"])
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    close_writer(w, hf_dir, _tensors(hf, cfg["num_hidden_layers"]), pre="gpt-4o")
    return Path(gguf_path)
