"""DeepSeek-V3 checkpoints written as GGUF (architecture deepseek2) the way llama.cpp's converter writes them, from
the tiny checkpoints `write_hf_checkpoint("deepseek_v3", ...)` writes:

- names from gguf-py's tensor map for deepseek2 (checked in the test against `gguf.get_tensor_name_map`);
- MLA stated as the MQA llama.cpp runs: one KV head, key_length = latent + rotary, value_length = latent, the
  per-head sizes as `key_length_mla` / `value_length_mla`; `kv_b_proj` split per head into `attn_k_b`
  [H, latent, nope] (transposed) and `attn_v_b` [H, v, latent]. `split_kv_b=False` writes the older form: one
  `attn_kv_b`, per-head key/value lengths, KV heads = heads;
- YaRN's attention scale as `yarn_log_multiplier` = 0.1 × mscale_all_dim; rotary pairs left in the checkpoint's
  (interleaved) order; routed experts stacked; the router's selection bias as `exp_probs_b.bias`.

GLM-5 (`write_hf_checkpoint("glm_moe_dsa", ...)`) as glm-dsa: the same, plus the sparse-attention indexer's
tensors (`indexer.attn_q_b`, `indexer.attn_k`, `indexer.k_norm`, `indexer.proj`; none on shared layers) and its
sizes as `attention.indexer.head_count` / `key_length` / `top_k`, as llama.cpp's converter adds them.
"""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
import torch

from support.gguf_writing import close_writer, open_writer, read_checkpoint

_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm", "self_attn.q_b_proj": "attn_q_b",
    "self_attn.q_proj": "attn_q", "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "attn_kv_a_norm", "self_attn.kv_b_proj": "attn_kv_b", "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
}
_INDEXER_NAMES = {  # glm-dsa's own
    "self_attn.indexer.wq_b": "indexer.attn_q_b", "self_attn.indexer.wk": "indexer.attn_k",
    "self_attn.indexer.k_norm": "indexer.k_norm", "self_attn.indexer.weights_proj": "indexer.proj",
}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj")


def gguf_tensors(hf: dict[str, torch.Tensor], cfg: dict, split_kv_b: bool) -> dict[str, np.ndarray]:
    out = {"token_embd.weight": hf["model.embed_tokens.weight"], "output_norm.weight": hf["model.norm.weight"],
           "output.weight": hf["lm_head.weight"]}
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    heads, nope, v = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    for name, w in hf.items():
        if name.endswith(".mlp.gate.e_score_correction_bias"):
            out[f"blk.{name.split('.')[2]}.exp_probs_b.bias"] = w
            continue
        m = _LAYER.fullmatch(name)
        if m is None:
            continue
        layer, module, kind = m[1], m[2], m[3]
        if e := _EXPERT.fullmatch(module):
            experts.setdefault((int(layer), e[2]), {})[int(e[1])] = w
        elif module == "self_attn.kv_b_proj" and split_kv_b:
            k_b, v_b = w.view(heads, nope + v, -1).split([nope, v], dim=1)
            out[f"blk.{layer}.attn_k_b.weight"] = k_b.transpose(1, 2).contiguous()
            out[f"blk.{layer}.attn_v_b.weight"] = v_b.contiguous()
        else:
            out[f"blk.{layer}.{(_NAMES | _INDEXER_NAMES)[module]}.{kind}"] = w
    for (layer, part), by_id in sorted(experts.items()):
        out[f"blk.{layer}.ffn_{part}_exps.weight"] = torch.stack([by_id[i] for i in range(len(by_id))])
    return {n: t.float().numpy() for n, t in out.items()}


def write_deepseek_gguf(hf_dir: Path, gguf_path: Path, *, split_kv_b: bool = True) -> Path:
    """deepseek2 from a deepseek_v3 checkpoint, glm-dsa from a glm_moe_dsa one."""
    cfg, hf = read_checkpoint(hf_dir)
    latent, rope_dim, heads = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], cfg["num_attention_heads"]
    dsa = cfg["model_type"] == "glm_moe_dsa"
    w = open_writer(gguf_path, "glm-dsa" if dsa else "deepseek2", cfg)
    if dsa:
        w.add_indexer_head_count(cfg["index_n_heads"])
        w.add_indexer_key_length(cfg["index_head_dim"])
        w.add_indexer_top_k(cfg["index_topk"])
    w.add_rope_dimension_count(rope_dim)
    if cfg.get("q_lora_rank"):
        w.add_q_lora_rank(cfg["q_lora_rank"])
    w.add_kv_lora_rank(latent)
    if split_kv_b:  # MLA as MQA over the latent
        w.add_head_count_kv(1)
        w.add_key_length(latent + rope_dim)
        w.add_value_length(latent)
        w.add_key_length_mla(cfg["qk_nope_head_dim"] + rope_dim)
        w.add_value_length_mla(cfg["v_head_dim"])
    else:
        w.add_head_count_kv(heads)
        w.add_key_length(cfg["qk_nope_head_dim"] + rope_dim)
        w.add_value_length(cfg["v_head_dim"])
    w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_count(cfg["n_routed_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_shared_count(cfg["n_shared_experts"])
    w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    w.add_expert_weights_norm(cfg["norm_topk_prob"])
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_group_count(cfg["n_group"])
    w.add_expert_group_used_count(cfg["topk_group"])
    rope = cfg["rope_parameters"]
    if rope["rope_type"] == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    close_writer(w, hf_dir, gguf_tensors(hf, cfg, split_kv_b))
    return Path(gguf_path)
