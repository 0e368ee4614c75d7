"""GGUF checkpoints as HF-shaped models: metadata → an HF-style config dict, tensor names → HF parameter names.

llama.cpp lays some tensors out differently from HF, and this is the one place that undoes it:
- llama-architecture Q/K rows are interleaved for its rotary kernel; we restore HF's half-split order;
- routed experts come stacked ([E, out, in]) and map to the executor's stacked slots `model.layers.N.experts.P`;
- llama3-style RoPE is stored as a `rope_freqs` tensor of per-frequency divisors, kept in the config;
- gpt-oss's experts come split (gate and up apart, biases as `ffn_*_exps.bias`), its sinks as `attn_sinks`; what
  the converter drops is llama.cpp's fixed value: the SwiGLU clamp (7.0, unless `swiglu_clamp_exp` says), YaRN
  untruncated, sliding window on every other layer from the first;
- deepseek2 (DeepSeek-V3/R1) states MLA as the MQA it runs (one KV head of the latent; the per-head sizes in
  `*_mla` keys) and splits `kv_b_proj` per head into `attn_k_b` (transposed) and `attn_v_b`, joined again here;
  its rotary pairs stay in the checkpoint's interleaved order (no permutation); glm-dsa (GLM-5) is deepseek2
  plus the sparse-attention indexer (`indexer.*` tensors, `attention.indexer.*` sizes);
- qwen3next (Qwen3-Next) stores its (1 + w) norms as 1 + w, A_log as A = -exp(A_log), the conv kernel squeezed,
  and the DeltaNet input projection regrouped: `attn_qkv` (all q, all k, all v) and `attn_gate` (z) instead of
  HF's per-key-head [q, k, v, z] groups, rebuilt here;
- qwen35moe (Qwen3.5/3.6-MoE) as qwen3next with the projections apart, and every value-head axis reordered from
  HF's grouping by key head [K0: v0 v1 …, K1: …] to ggml's tiled order [v0 of K0, K1 …, v1 of K0, K1 …] (its
  broadcasts repeat key heads that way), put back here.
"""

from __future__ import annotations

import re

import torch

from freetoken.engine.formats.gguf_file import GGUFFile
from freetoken.errors import UnsupportedArchitectureError

# GGUF general.architecture → HF model_type (llama with experts is Mixtral).
GGUF_ARCHITECTURES = {"llama": "llama", "qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe", "glm4moe": "glm4_moe",
                      "gpt-oss": "gpt_oss", "deepseek2": "deepseek_v3", "glm-dsa": "glm_moe_dsa",
                      "qwen3next": "qwen3_next", "qwen35moe": "qwen3_5_moe_text"}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "{mlp}.gate_proj", "ffn_up": "{mlp}.up_proj", "ffn_down": "{mlp}.down_proj",
    "ffn_gate_inp": "{mlp}.gate",
    "ffn_gate_shexp": "{mlp}.shared_expert.gate_proj", "ffn_up_shexp": "{mlp}.shared_expert.up_proj",
    "ffn_down_shexp": "{mlp}.shared_expert.down_proj", "ffn_gate_inp_shexp": "{mlp}.shared_expert_gate",
}
# GLM-4.5 (glm4moe) names its shared experts and its second norm otherwise; exp_probs_b is its selection bias
_GLM_BLOCK_NAMES = {
    "post_attention_norm": "post_attention_layernorm", "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj", "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
# gpt-oss: its sinks and second norm; the experts' biases are the model's `expert_*_bias` parameters
_GPT_OSS_BLOCK_NAMES = {
    "attn_sinks": "self_attn.sinks", "post_attention_norm": "post_attention_layernorm.weight",
    "ffn_gate_exps": "mlp.expert_gate_bias", "ffn_up_exps": "mlp.expert_up_bias",
    "ffn_down_exps": "mlp.expert_down_bias",
}
# DeepSeek-V3 (deepseek2): multi-head latent attention; its shared experts are named as GLM's
_DEEPSEEK_BLOCK_NAMES = {
    "attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm", "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa", "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj", "attn_k_b": "self_attn.kv_b_proj",  # (k_b and v_b joined: merge_kv_b)
    **{k: v for k, v in _GLM_BLOCK_NAMES.items() if "shexp" in k},
    # GLM-5 (glm-dsa): deepseek2's tensors plus the sparse-attention indexer's
    "indexer.attn_q_b": "self_attn.indexer.wq_b", "indexer.attn_k": "self_attn.indexer.wk",
    "indexer.k_norm": "self_attn.indexer.k_norm", "indexer.proj": "self_attn.indexer.weights_proj",
}
# The multi-token-prediction block's own tensors (GLM-4.5, DeepSeek-V3: models/mtp.py), beside its ordinary ones
_NEXTN_NAMES = {
    "nextn.eh_proj": "eh_proj", "nextn.enorm": "enorm", "nextn.hnorm": "hnorm",
    "nextn.shared_head_norm": "shared_head.norm", "nextn.shared_head_head": "shared_head.head",
    "nextn.embed_tokens": "embed_tokens",
}
# Qwen3-Next (qwen3next): its Gated DeltaNet mixers; attn_qkv (with attn_gate) is the fused in_proj_qkvz
_QWEN3NEXT_BLOCK_NAMES = {
    "post_attention_norm": "post_attention_layernorm.weight", "ssm_ba": "linear_attn.in_proj_ba.weight",
    "attn_qkv": "linear_attn.in_proj_qkvz.weight", "ssm_conv1d": "linear_attn.conv1d.weight",
    "ssm_a": "linear_attn.A_log", "ssm_dt": "linear_attn.dt_bias", "ssm_norm": "linear_attn.norm.weight",
    "ssm_out": "linear_attn.out_proj.weight",
}
# Qwen3.5-MoE (qwen35moe): the same mixers with the DeltaNet's input projections apart
_QWEN35_BLOCK_NAMES = {
    **{k: v for k, v in _QWEN3NEXT_BLOCK_NAMES.items() if k != "attn_qkv"},
    "attn_qkv": "linear_attn.in_proj_qkv.weight", "attn_gate": "linear_attn.in_proj_z.weight",
    "ssm_alpha": "linear_attn.in_proj_a.weight", "ssm_beta": "linear_attn.in_proj_b.weight",
}
_STACKED_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.((?:indexer\.|nextn\.)?\w+?)(?:\.(weight|bias))?")  # (ssm_a has no suffix)


def stacked_expert_name(layer: int, projection: str) -> str:
    """Checkpoint-independent name of one layer's stacked routed-expert tensor."""
    return f"model.layers.{layer}.experts.{projection}"


def hf_config(gguf: GGUFFile) -> dict:
    md = gguf.metadata
    arch = md.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"{gguf.path}: GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(GGUF_ARCHITECTURES)} (llama with experts = Mixtral)"
        )

    def get(key: str, default=None):
        return md.get(f"{arch}.{key}", default)

    n_experts = int(get("expert_count", 0) or 0)
    model_type = GGUF_ARCHITECTURES[arch]
    if arch == "llama" and n_experts:
        model_type = "mixtral"
    n_heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    vocab = get("vocab_size") or len(md.get("tokenizer.ggml.tokens") or [])
    cfg = {
        "model_type": model_type,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(get("attention.head_count_kv", n_heads)),
        "head_dim": int(get("attention.key_length", hidden // n_heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "intermediate_size": int(get("feed_forward_length", 0) or 0),
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "rope_parameters": _rope_parameters(gguf, get),
    }
    if model_type == "glm4_moe":
        cfg.update(_glm_config(gguf, get, cfg))
    elif model_type == "gpt_oss":
        cfg.update(_gpt_oss_config(gguf, get, cfg))
    elif model_type == "deepseek_v3":
        cfg.update(_deepseek_config(gguf, get, cfg))
    elif model_type == "glm_moe_dsa":
        cfg.update(_deepseek_config(gguf, get, cfg))
        cfg.update(_indexer_config(gguf, get, cfg))
    elif model_type in ("qwen3_next", "qwen3_5_moe_text"):
        cfg.update(_qwen3next_config(gguf, get, cfg))
    elif n_experts:
        cfg.update(_moe_config(gguf, get, model_type, n_experts, cfg["num_hidden_layers"]))
    if model_type == "llama":
        cfg["attention_bias"] = "blk.0.attn_q.bias" in gguf.tensors
    return cfg


def _rope_parameters(gguf: GGUFFile, get) -> dict:
    params: dict = {"rope_theta": float(get("rope.freq_base", 10000.0)), "rope_type": "default"}
    scaling = get("rope.scaling.type")
    if scaling in ("linear", "yarn"):
        params.update(rope_type=scaling, factor=float(get("rope.scaling.factor")))
        if get("rope.scaling.original_context_length"):
            params["original_max_position_embeddings"] = int(get("rope.scaling.original_context_length"))
    elif scaling not in (None, "none"):
        raise UnsupportedArchitectureError(f"{gguf.path}: RoPE scaling {scaling!r} is not supported")
    if "rope_freqs.weight" in gguf.tensors:  # llama3-style scaling, precomputed by the converter
        params["freq_factors"] = gguf.load("rope_freqs.weight").tolist()
    return params


def _moe_config(gguf: GGUFFile, get, model_type: str, n_experts: int, n_layers: int) -> dict:
    sparse = [i for i in range(n_layers) if f"blk.{i}.ffn_gate_inp.weight" in gguf.tensors]
    expert_ff = int(get("expert_feed_forward_length", 0) or get("feed_forward_length"))
    cfg = {"num_experts": n_experts, "num_local_experts": n_experts,
           "num_experts_per_tok": int(get("expert_used_count"))}
    if model_type == "mixtral":
        cfg["intermediate_size"] = expert_ff
        return cfg
    # Qwen3-MoE checkpoints all renormalise the top-k (llama.cpp hard-codes it); Qwen2-MoE does not.
    cfg["norm_topk_prob"] = bool(get("expert_weights_norm", model_type == "qwen3_moe"))
    cfg["moe_intermediate_size"] = expert_ff
    cfg["mlp_only_layers"] = [i for i in range(n_layers) if i not in sparse]
    cfg["decoder_sparse_step"] = 1
    if model_type == "qwen2_moe":
        cfg["shared_expert_intermediate_size"] = int(get("expert_shared_feed_forward_length", 0) or 0)
        cfg["qkv_bias"] = "blk.0.attn_q.bias" in gguf.tensors
    return cfg


def _glm_config(gguf: GGUFFile, get, cfg: dict) -> dict:
    """GLM-4.5's routing as llama.cpp's converter states it; its block count includes the MTP block(s)."""
    gating = get("expert_gating_func")
    if gating is not None and int(gating) != 2:
        raise UnsupportedArchitectureError(f"{gguf.path}: glm4moe with expert gating {gating} (only sigmoid, 2)")
    rotary = int(get("rope.dimension_count", cfg["head_dim"]))
    return {
        **_grouped_routing(get, cfg),
        "attention_bias": "blk.0.attn_q.bias" in gguf.tensors,
        "use_qk_norm": "blk.0.attn_q_norm.weight" in gguf.tensors,
        "rope_parameters": {**cfg["rope_parameters"], "partial_rotary_factor": rotary / cfg["head_dim"]},
    }


def _gpt_oss_config(gguf: GGUFFile, get, cfg: dict) -> dict:
    """gpt-oss as llama.cpp's converter writes it: experts split into gate and up (a fused `ffn_gate_up_exps`
    is not read yet), the rest of the family fixed in llama.cpp rather than stated."""
    if "blk.0.ffn_gate_up_exps.weight" in gguf.tensors:
        raise UnsupportedArchitectureError(f"{gguf.path}: gpt-oss with fused gate/up experts (ffn_gate_up_exps); "
                                           "convert it with gate and up apart (llama.cpp's default)")
    clamp = get("swiglu_clamp_exp")
    clamps = {float(c) for c in clamp if c} if isinstance(clamp, list) else {float(clamp)} if clamp else {7.0}
    if len(clamps) != 1:
        raise UnsupportedArchitectureError(f"{gguf.path}: gpt-oss with SwiGLU clamps varying by layer ({clamp})")
    rope = dict(cfg["rope_parameters"])
    if rope["rope_type"] == "yarn":  # OpenAI's YaRN does not round the correction range (HF: truncate=False)
        rope.update(beta_fast=float(get("rope.scaling.yarn_beta_fast", 32.0)),
                    beta_slow=float(get("rope.scaling.yarn_beta_slow", 1.0)), truncate=False)
    return {
        "num_local_experts": int(get("expert_count")), "num_experts_per_tok": int(get("expert_used_count")),
        "intermediate_size": int(get("expert_feed_forward_length", 0) or get("feed_forward_length")),
        "sliding_window": int(get("attention.sliding_window", 128)),
        "attention_bias": "blk.0.attn_q.bias" in gguf.tensors,
        "swiglu_limit": clamps.pop(), "rope_parameters": rope,
    }


def _deepseek_config(gguf: GGUFFile, get, cfg: dict) -> dict:
    """DeepSeek-V3 as llama.cpp's converter writes deepseek2: MLA sizes, grouped sigmoid routing, YaRN with its
    attention scale as `yarn_log_multiplier` (0.1 × mscale_all_dim); the block count includes MTP blocks."""
    gating = get("expert_gating_func")
    if gating is not None and int(gating) != 2:
        raise UnsupportedArchitectureError(f"{gguf.path}: deepseek2 with expert gating {gating}: DeepSeek-V2's "
                                           "softmax routing is not supported, only V3's sigmoid (2)")
    rope_dim = int(get("rope.dimension_count"))
    if get("attention.key_length_mla") is not None:  # the MQA form: key_length is the latent's
        nope, v = int(get("attention.key_length_mla")) - rope_dim, int(get("attention.value_length_mla"))
    else:  # older files state the per-head sizes directly
        nope, v = int(get("attention.key_length")) - rope_dim, int(get("attention.value_length"))
    rope = dict(cfg["rope_parameters"])
    if rope["rope_type"] == "yarn":
        mscale = float(get("rope.scaling.yarn_log_multiplier", 0.1)) / 0.1
        rope.update(mscale=mscale, mscale_all_dim=mscale, beta_fast=float(get("rope.scaling.yarn_beta_fast", 32.0)),
                    beta_slow=float(get("rope.scaling.yarn_beta_slow", 1.0)))
    return {
        **_grouped_routing(get, cfg),
        "q_lora_rank": int(get("attention.q_lora_rank", 0) or 0) or None,
        "kv_lora_rank": int(get("attention.kv_lora_rank")), "qk_rope_head_dim": rope_dim,
        "qk_nope_head_dim": nope, "v_head_dim": v, "rope_interleave": True, "rope_parameters": rope,
    }


def _indexer_config(gguf: GGUFFile, get, cfg: dict) -> dict:
    """GLM-5's sparse-attention indexer as llama.cpp's converter writes glm-dsa: its sizes as
    `attention.indexer.*` keys; a layer without indexer tensors reuses the previous one's choice ("shared")."""
    n = int(cfg["num_hidden_layers"])
    kinds = ["full" if f"blk.{i}.indexer.attn_k.weight" in gguf.tensors else "shared" for i in range(n)]
    return {"index_n_heads": int(get("attention.indexer.head_count")),
            "index_head_dim": int(get("attention.indexer.key_length")),
            "index_topk": int(get("attention.indexer.top_k")), "indexer_types": kinds}


def _grouped_routing(get, cfg: dict) -> dict:
    """GLM-4.5's and DeepSeek-V3's routing keys (grouped sigmoid top-k, shared experts, leading dense blocks), and
    their layer count without the multi-token-prediction blocks the block count includes."""
    return {
        "num_hidden_layers": cfg["num_hidden_layers"] - int(get("nextn_predict_layers", 0) or 0),
        "num_nextn_predict_layers": int(get("nextn_predict_layers", 0) or 0),
        "n_routed_experts": int(get("expert_count")), "num_experts_per_tok": int(get("expert_used_count")),
        "moe_intermediate_size": int(get("expert_feed_forward_length")),
        "n_shared_experts": int(get("expert_shared_count", 0) or 0),
        "first_k_dense_replace": int(get("leading_dense_block_count", 0) or 0),
        "routed_scaling_factor": float(get("expert_weights_scale", 1.0)),
        "norm_topk_prob": bool(get("expert_weights_norm", True)),
        "n_group": int(get("expert_group_count", 1) or 1), "topk_group": int(get("expert_group_used_count", 1) or 1),
    }


def _qwen3next_config(gguf: GGUFFile, get, cfg: dict) -> dict:
    """Qwen3-Next as llama.cpp's converter writes it: the DeltaNet sizes as `ssm.*` keys, partial RoPE as the
    rotary dimension count, every `full_attention_interval`-th layer full attention."""
    if "blk.0.ssm_in.weight" in gguf.tensors:
        raise UnsupportedArchitectureError(f"{gguf.path}: qwen3next with a fused ssm_in projection (an early "
                                           "converter's); re-convert it with a current llama.cpp (attn_qkv + "
                                           "attn_gate)")
    n = cfg["num_hidden_layers"]
    value_heads = int(get("ssm.time_step_rank"))
    moe = _moe_config(gguf, get, "qwen3_moe", int(get("expert_count")), n)
    rotary = int(get("rope.dimension_count", cfg["head_dim"]))
    return {
        **{k: v for k, v in moe.items() if k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                                  "mlp_only_layers", "decoder_sparse_step", "norm_topk_prob")},
        "linear_conv_kernel_dim": int(get("ssm.conv_kernel")), "linear_key_head_dim": int(get("ssm.state_size")),
        "linear_num_key_heads": int(get("ssm.group_count")), "linear_num_value_heads": value_heads,
        "linear_value_head_dim": int(get("ssm.inner_size")) // value_heads,
        "full_attention_interval": int(get("full_attention_interval", 4)),
        "shared_expert_intermediate_size": int(get("expert_shared_feed_forward_length", 0) or 0),
        "rope_parameters": {**cfg["rope_parameters"], "partial_rotary_factor": rotary / cfg["head_dim"]},
    }


def merge_qkvz(qkv: torch.Tensor, z: torch.Tensor, cfg: dict) -> torch.Tensor:
    """HF's in_proj_qkvz (rows grouped per key head: q, k, v, z) from llama.cpp's attn_qkv (all q, all k, all v)
    and attn_gate (z)."""
    heads, dk = cfg["linear_num_key_heads"], cfg["linear_key_head_dim"]
    dv = cfg["linear_num_value_heads"] // heads * cfg["linear_value_head_dim"]  # a key head's value rows
    width = qkv.shape[-1]
    q, k, v = qkv.split([heads * dk, heads * dk, heads * dv])
    groups = (q.view(heads, dk, width), k.view(heads, dk, width), v.view(heads, dv, width), z.view(heads, dv, width))
    return torch.cat(groups, dim=1).reshape(-1, width)


def merge_kv_b(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """kv_b_proj [H·(nope + v), latent] from llama.cpp's per-head attn_k_b [H, latent, nope] (transposed) and
    attn_v_b [H, v, latent]."""
    return torch.cat((k_b.transpose(1, 2), v_b), dim=1).reshape(-1, k_b.shape[1])


def joined_tensor(gguf_name: str, arch: str):
    """For a GGUF tensor that is one part of an HF parameter llama.cpp split in two: (the other part's name,
    merge(this part, other part, config) → the HF parameter); else None."""
    if gguf_name.endswith(".attn_k_b.weight"):  # DeepSeek's kv_b_proj, split per head
        return gguf_name.replace("attn_k_b", "attn_v_b"), lambda k_b, v_b, cfg: merge_kv_b(k_b, v_b)
    if arch == "qwen3next" and gguf_name.endswith(".attn_qkv.weight"):  # its in_proj_qkvz, regrouped
        return gguf_name.replace("attn_qkv", "attn_gate"), merge_qkvz
    return None


def hf_name(gguf_name: str, model_type: str) -> str | None:
    """HF parameter (or stacked-expert) name for a GGUF tensor; None for tensors that carry no parameter."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m is None:
        return None
    layer, part, kind = int(m.group(1)), m.group(2), m.group(3)
    if model_type == "qwen3_next":
        if part == "attn_gate":
            return None  # read with attn_qkv
        if part in _QWEN3NEXT_BLOCK_NAMES:
            return f"model.layers.{layer}.{_QWEN3NEXT_BLOCK_NAMES[part]}"
    if model_type in ("qwen3_5_moe", "qwen3_5_moe_text") and part in _QWEN35_BLOCK_NAMES:
        return f"model.layers.{layer}.{_QWEN35_BLOCK_NAMES[part]}"
    if kind is None:
        return None
    if part in _NEXTN_NAMES:
        return f"model.layers.{layer}.{_NEXTN_NAMES[part]}.{kind}"
    if model_type in ("deepseek_v3", "glm_moe_dsa"):
        if part == "attn_v_b":
            return None  # read with attn_k_b
        if part in _DEEPSEEK_BLOCK_NAMES:
            return f"model.layers.{layer}.{_DEEPSEEK_BLOCK_NAMES[part]}.{kind}"
    if model_type in ("glm4_moe", "deepseek_v3", "glm_moe_dsa"):
        if part == "exp_probs_b":
            return f"model.layers.{layer}.mlp.gate.e_score_correction_bias"
        if part in _GLM_BLOCK_NAMES:
            return f"model.layers.{layer}.{_GLM_BLOCK_NAMES[part]}.{kind}"
    if model_type == "gpt_oss" and part in _GPT_OSS_BLOCK_NAMES and (kind == "bias" or part not in _STACKED_EXPERTS):
        return f"model.layers.{layer}.{_GPT_OSS_BLOCK_NAMES[part]}"
    if part in _STACKED_EXPERTS:
        return stacked_expert_name(layer, _STACKED_EXPERTS[part])
    if part not in _BLOCK_NAMES:
        return None
    mlp = "block_sparse_moe" if model_type == "mixtral" else "mlp"
    return f"model.layers.{layer}.{_BLOCK_NAMES[part].format(mlp=mlp)}.{kind}"


def to_hf_layout(gguf_name: str, tensor: torch.Tensor, cfg: dict, arch: str) -> torch.Tensor:
    """Undoes llama.cpp's layout changes for one tensor (see module docstring)."""
    if arch == "llama" and re.fullmatch(r"blk\.\d+\.attn_[qk]\.(weight|bias)", gguf_name):
        heads = cfg["num_attention_heads"] if ".attn_q." in gguf_name else cfg["num_key_value_heads"]
        return _unpermute_rotary(tensor, heads)
    if gguf_name.endswith("ffn_gate_inp_shexp.weight") and tensor.dim() == 1:
        return tensor[None, :]  # GGUF stores the [1, H] shared-expert gate as a vector
    if arch == "qwen35moe":
        tensor = _untile_value_heads(gguf_name, tensor, cfg)
    if arch in ("qwen3next", "qwen35moe"):
        return _qwen3next_layout(gguf_name, tensor)
    return tensor


def _untile_value_heads(gguf_name: str, tensor: torch.Tensor, cfg: dict) -> torch.Tensor:
    """qwen35moe's value-head axes back from ggml's tiled order to HF's grouping by key head."""
    kh, vh = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    if kh == vh or ".ssm_" not in gguf_name and ".attn_qkv." not in gguf_name and ".attn_gate." not in gguf_name:
        return tensor
    per, dv, key_total = vh // kh, cfg["linear_value_head_dim"], kh * cfg["linear_key_head_dim"]

    def untile(t: torch.Tensor, dim: int, head_dim: int) -> torch.Tensor:
        shape = list(t.shape)
        t = t.reshape(*shape[:dim], per, kh, head_dim, *shape[dim + 1:])
        return t.transpose(dim, dim + 1).reshape(shape)

    part = gguf_name.split(".")[2]
    if part == "attn_qkv":  # only the value rows
        return torch.cat((tensor[:2 * key_total], untile(tensor[2 * key_total:], 0, dv)))
    if part == "ssm_conv1d":  # [channels, kernel]: only the value channels
        return torch.cat((tensor[:2 * key_total], untile(tensor[2 * key_total:], 0, dv)))
    if part == "attn_gate":
        return untile(tensor, 0, dv)
    if part in ("ssm_alpha", "ssm_beta", "ssm_a", "ssm_dt"):
        return untile(tensor, 0, 1)
    if part == "ssm_out":  # its input columns
        return untile(tensor, 1, dv)
    return tensor


def _qwen3next_layout(gguf_name: str, tensor: torch.Tensor) -> torch.Tensor:
    if gguf_name.endswith(".ssm_a"):
        return torch.log(-tensor)  # A = -exp(A_log)
    if gguf_name.endswith(".ssm_conv1d.weight"):
        return tensor.unsqueeze(1)  # [channels, kernel] → the depthwise conv's [channels, 1, kernel]
    if gguf_name.endswith("norm.weight") and not gguf_name.endswith(".ssm_norm.weight"):
        return tensor - 1  # the (1 + w) norms are stored as 1 + w
    return tensor


def _unpermute_rotary(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    rows = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *rest).transpose(1, 2).reshape(rows, *rest)
