"""Tiny random checkpoints of every supported family, written the way real ones ship.

`write_hf_checkpoint` saves a transformers model with random weights as sharded safetensors plus a byte-level BPE
tokenizer with a ChatML template, and returns the model as the reference. `write_gguf_from_hf` rewrites the same
weights as a GGUF laid out the way llama.cpp's converter lays them out: llama's (and mixtral's) Q/K rows permuted
to the interleaved rotary layout, experts stacked [E, I, H], Llama 3 RoPE as a `rope_freqs` tensor, YaRN as
`rope.scaling.*` keys, the vocabulary under `tokenizer.ggml.*`.

Shapes are tiny (hidden 64, 4 heads of 16, 2 KV heads, 8 experts top-2, vocab 384) so a parity case takes about a
second. Weights are drawn wider than transformers' init (std 0.2, norms 1 ± 0.2) so logits are far from uniform
and the router really discriminates between experts.
"""

from __future__ import annotations

import functools
import json
import random
import re
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    DeepseekV3Config,
    DeepseekV4Config,
    GenerationConfig,
    Glm4MoeConfig,
    GlmMoeDsaConfig,
    GptOssConfig,
    LlamaConfig,
    MixtralConfig,
    PreTrainedConfig,
    PreTrainedModel,
    Qwen2MoeConfig,
    Qwen3_5MoeTextConfig,
    Qwen3MoeConfig,
    Qwen3NextConfig,
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

FAMILIES = ("llama", "qwen3_moe", "qwen2_moe", "mixtral")
ROPE_VARIANTS = ("default", "llama3", "yarn")

VOCAB_SIZE = 384
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BOS_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_end|>"
BOS_ID, EOS_ID = 0, 2  # the trainer hands out the special tokens first, in order
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
PROMPT_TEXT = (
    "<|im_start|>user\nThe quick brown fox jumps over the lazy dog, twice: 12 times?<|im_end|>\n"
    "<|im_start|>assistant\n"
)
# Qwen2's pre-tokenizer split (llama.cpp calls it pre "qwen2").
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_WORDS = (
    "the quick brown fox jumps over lazy dog river mountain city capital France Paris music light stone "
    "water tree house garden winter summer number seven eleven twelve engine token expert router layer "
    "cache memory answer question model small large green blue red yellow bright dark slow fast"
).split()

# The checkpoints every parity suite runs: each family once, plus llama's RoPE variants and tied embeddings.
# The llama3 and tied cases spell config.json the transformers 4 way, the others the transformers 5 way.
PARITY_CASES: dict[str, dict] = {
    "llama": dict(family="llama"),
    "llama-rope-llama3": dict(family="llama", rope="llama3", legacy_rope_keys=True),
    "llama-rope-yarn": dict(family="llama", rope="yarn"),
    "llama-tied": dict(family="llama", tie_word_embeddings=True, legacy_rope_keys=True),
    "qwen3_moe": dict(family="qwen3_moe"),
    "qwen2_moe": dict(family="qwen2_moe"),
    "mixtral": dict(family="mixtral"),
}

_STD = 0.2
_COMMON = dict(
    vocab_size=VOCAB_SIZE, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    rms_norm_eps=1e-6, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=None,
)


# --------------------------------------------------------------------------------------------------- configs


def _rope_parameters(rope: str, theta: float) -> dict:
    if rope == "default":
        return {"rope_type": "default", "rope_theta": theta}
    if rope == "llama3":
        # With head dim 16 and an original context of 64 the frequency bands land on all three llama3 branches.
        return {"rope_type": "llama3", "rope_theta": theta, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    if rope == "yarn":
        return {"rope_type": "yarn", "rope_theta": theta, "factor": 4.0, "original_max_position_embeddings": 64}
    raise ValueError(f"unknown rope variant {rope!r}; known: {ROPE_VARIANTS}")


def _deepseek_rope(rope: str) -> dict:
    """DeepSeek-V3's own YaRN spelling (mscale and mscale_all_dim: the softmax scale grows by mscale²)."""
    if rope == "default":
        return _rope_parameters("default", 10000.0)
    return {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 64,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


def tiny_config(family: str, *, rope: str = "default", tie_word_embeddings: bool = False) -> PreTrainedConfig:
    """A tiny transformers config of `family`; `rope` applies to llama only."""
    if family == "llama":
        return LlamaConfig(**_COMMON, intermediate_size=128, num_hidden_layers=2, head_dim=16,
                           rope_parameters=_rope_parameters(rope, 10000.0), tie_word_embeddings=tie_word_embeddings)
    if (rope != "default" and family != "deepseek_v3") or tie_word_embeddings:
        raise ValueError("rope variants are llama's and deepseek_v3's (yarn) only here, tied embeddings llama's")
    if family == "qwen3_moe":
        # Layer 1 is dense: covers the mlp_only_layers path between two MoE layers.
        return Qwen3MoeConfig(**_COMMON, intermediate_size=128, num_hidden_layers=3, moe_intermediate_size=32,
                              num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
                              rope_parameters=_rope_parameters("default", 1e6))
    if family == "qwen2_moe":
        return Qwen2MoeConfig(**_COMMON, intermediate_size=128, num_hidden_layers=2, moe_intermediate_size=32,
                              shared_expert_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                              norm_topk_prob=False, qkv_bias=True, rope_parameters=_rope_parameters("default", 1e6))
    if family == "qwen3_next":
        # Layers: linear, full, linear (dense MLP), full; 2 key heads serving 4 value heads; partial RoPE.
        return Qwen3NextConfig(**_COMMON, head_dim=16, intermediate_size=128, num_hidden_layers=4,
                               moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8,
                               num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[2],
                               linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                               linear_value_head_dim=8, linear_conv_kernel_dim=4,
                               layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
                               rope_parameters={**_rope_parameters("default", 1e6), "partial_rotary_factor": 0.5})
    if family == "qwen3_5_moe":
        # Qwen3-Next's case with split DeltaNet projections; every layer routes (no dense layer).
        return Qwen3_5MoeTextConfig(**_COMMON, head_dim=16, num_hidden_layers=4, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
                                    linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                                    linear_value_head_dim=8, linear_conv_kernel_dim=4,
                                    layer_types=["linear_attention", "full_attention"] * 2,
                                    rope_parameters={**_rope_parameters("default", 1e6), "partial_rotary_factor": 0.5,
                                                     "mrope_section": [2, 1, 1]})
    if family == "glm4_moe":
        # Layer 0 dense; 8 experts in 2 groups of which 1 competes, top-2 of it, scaled; q/k norm, qkv bias.
        return Glm4MoeConfig(**_COMMON, head_dim=16, intermediate_size=128, num_hidden_layers=3,
                             moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                             n_group=2, topk_group=1, first_k_dense_replace=1, norm_topk_prob=True,
                             routed_scaling_factor=2.5, use_qk_norm=True, attention_bias=True,
                             rope_parameters={**_rope_parameters("default", 1e6), "partial_rotary_factor": 0.5})
    if family == "deepseek_v3":
        # MLA with a query LoRA, interleaved rotary pairs; layer 0 dense; 8 experts in 4 groups of which 2
        # compete, top-2, scaled; two shared experts.
        common = {**_COMMON, "num_key_value_heads": 4}  # MLA: every head has its own expanded K/V
        return DeepseekV3Config(**common, intermediate_size=128, num_hidden_layers=3, moe_intermediate_size=32,
                                n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2, n_group=4,
                                topk_group=2, first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5,
                                q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                v_head_dim=12, rope_interleave=True,
                                rope_parameters=_deepseek_rope(rope))
    if family == "glm_moe_dsa":
        # deepseek_v3's MLA case plus DSA: each query sees the 8 keys its indexer scores highest (fewer than the
        # test prompt's tokens), layer 2 reuses layer 1's choice (a "shared" layer); layer 0 dense. 8 indexer
        # heads: a key all of whose heads' relu gives 0 (a tie, which transformers' topk breaks arbitrarily) is rare.
        common = {**_COMMON, "num_key_value_heads": 4}
        return GlmMoeDsaConfig(**common, intermediate_size=128, num_hidden_layers=3, moe_intermediate_size=32,
                               n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=4,
                               topk_group=2, first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5,
                               q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                               v_head_dim=12, index_topk=8, index_head_dim=16, index_n_heads=8,
                               indexer_types=["full", "full", "shared"],
                               rope_parameters=_rope_parameters("default", 10000.0))
    if family == "deepseek_v4":
        # One layer of each attention kind and one more CSA: windows of 8 keys, CSA every 4 tokens (its indexer
        # keeps 3 entries of the prompt's 10), HCA every 8; 4 hyper-connection streams; two hash-routed layers,
        # then top-k ones; YaRN on the compress RoPE as the real configs have it. 8 indexer heads: an entry all of
        # whose heads' relu gives 0 (a tie, which transformers' topk breaks arbitrarily) is rare.
        common = {**_COMMON, "num_key_value_heads": 1}
        return DeepseekV4Config(**common, num_hidden_layers=4, head_dim=32, partial_rotary_factor=0.25,
                                q_lora_rank=32, o_groups=2, o_lora_rank=16, sliding_window=8,
                                compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
                                index_n_heads=8, index_head_dim=16, index_topk=3, hc_mult=4,
                                layer_types=["heavily_compressed_attention", "compressed_sparse_attention",
                                             "sliding_attention", "compressed_sparse_attention"],
                                mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"], n_routed_experts=8,
                                num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
                                rope_theta=10000.0, compress_rope_theta=160000.0,
                                rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                 "original_max_position_embeddings": 64, "beta_fast": 32,
                                                 "beta_slow": 1})
    if family == "gpt_oss":
        # Sliding (window 8, shorter than the test prompt) and full attention alternating, sinks, biases, YaRN
        # without truncation; a SwiGLU limit low enough that both clamps bite.
        return GptOssConfig(**_COMMON, head_dim=16, intermediate_size=32, num_hidden_layers=4, num_local_experts=8,
                            num_experts_per_tok=2, sliding_window=8, swiglu_limit=1.5, attention_bias=True,
                            layer_types=["sliding_attention", "full_attention"] * 2,
                            rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                                             "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                             "original_max_position_embeddings": 64})
    if family == "mixtral":
        return MixtralConfig(**_COMMON, intermediate_size=64, num_hidden_layers=2, head_dim=16, num_local_experts=8,
                             num_experts_per_tok=2, rope_parameters=_rope_parameters("default", 1e6))
    raise ValueError(f"unknown family {family!r}; known: {FAMILIES}")


# --------------------------------------------------------------------------------------------------- tokenizer


def _corpus() -> list[str]:
    rng = random.Random(0)
    lines = []
    for _ in range(1500):
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 12)))
        tail = rng.choice([".", "?", "!", f", {rng.randint(0, 999)}.", ": yes", "\n"])
        lines.append(f"<|im_start|>{rng.choice(['user', 'assistant'])}\n{words.capitalize()}{tail}<|im_end|>\n")
    return lines


def build_tokenizer() -> Tokenizer:
    """A byte-level BPE with Qwen2's split, trained on a fixed generated corpus: same merges on every run."""
    return Tokenizer.from_str(_trained_tokenizer_json())


@functools.cache
def _trained_tokenizer_json() -> str:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer)
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    assert [tok.token_to_id(t) for t in (BOS_TOKEN, EOS_TOKEN)] == [BOS_ID, EOS_ID]
    return tok.to_str()


def write_tokenizer(path: Path) -> None:
    """tokenizer.json, tokenizer_config.json (ChatML template, eos <|im_end|>)."""
    tok = build_tokenizer()
    tok.save(str(path / "tokenizer.json"))
    added = {str(tok.token_to_id(t)): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                                       "normalized": False, "single_word": False} for t in SPECIAL_TOKENS}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN,
        "pad_token": BOS_TOKEN, "unk_token": None, "add_bos_token": False, "model_max_length": 256,
        "added_tokens_decoder": added, "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def add_special_tokens(path: Path, tokens: list[str]) -> None:
    """Adds `tokens` to the tokenizer at `path` as special tokens (ids from VOCAB_SIZE on: the checkpoint's
    vocab_size must leave room), as a model's own markers are in its real tokenizer."""
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens(tokens)
    tok.save(str(path / "tokenizer.json"))
    config = json.loads((path / "tokenizer_config.json").read_text())
    for t in tokens:
        config["added_tokens_decoder"][str(tok.token_to_id(t))] = {
            "content": t, "special": True, "lstrip": False, "rstrip": False, "normalized": False,
            "single_word": False}
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def prompt_ids(text: str = PROMPT_TEXT) -> list[int]:
    return build_tokenizer().encode(text).ids


# --------------------------------------------------------------------------------------------------- HF dirs


def _randomize(model: PreTrainedModel, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * _STD
            if name.endswith("sinks"):  # gpt-oss's per-head sink logits: large enough to matter
                noise = noise * 5
            p.copy_(1.0 + noise if "norm" in name else noise)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a selection bias (sigmoid routers) that must count
                b.copy_(torch.randn(b.shape, generator=gen) * 0.5)
            if name.endswith("tid2eid"):  # DeepSeek-V4's hash routing: distinct experts per token id
                picks = torch.rand(b.shape[0], model.config.n_routed_experts, generator=gen)
                b.copy_(picks.argsort(dim=-1)[:, :b.shape[1]])


def write_hf_checkpoint(family: str, path: Path, *, seed: int = 0, rope: str = "default",
                        tie_word_embeddings: bool = False, shards: int = 2,
                        legacy_rope_keys: bool = False, **config_overrides) -> PreTrainedModel:
    """Writes a tiny random `family` checkpoint to `path` and returns the transformers model (eval, fp32).

    Weights are split so that there are at least `shards` safetensors files behind an index json.

    `legacy_rope_keys` rewrites config.json with transformers 4's `rope_theta` + `rope_scaling` spelling, the one
    most Hub checkpoints still carry; the default is transformers 5's `rope_parameters`. `config_overrides` set
    attributes of the tiny config (gpt-oss's `swiglu_limit=7.0`, the value GGUF files leave unstated).
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = tiny_config(family, rope=rope, tie_word_embeddings=tie_word_embeddings)
    for key, value in config_overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if family == "gpt_oss":  # transformers before 5.2x hard-code the clamp (7.0, every release's value)
        for layer in model.model.layers:
            experts = layer.mlp.experts  # (5.17's config has no swiglu_alpha: its experts keep their own)
            experts.alpha = getattr(config, "swiglu_alpha", experts.alpha)
            experts.limit = config.swiglu_limit
    _randomize(model, seed)
    model.eval()
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(path, max_shard_size=total // shards + 1)
    GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, do_sample=False).save_pretrained(path)
    write_tokenizer(path)
    if legacy_rope_keys:
        _rewrite_rope_keys_legacy(path / "config.json")
    return model


def _rewrite_rope_keys_legacy(config_json: Path) -> None:
    cfg = json.loads(config_json.read_text())
    params = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = params.pop("rope_theta")
    cfg["rope_scaling"] = None if params.get("rope_type") == "default" else params
    config_json.write_text(json.dumps(cfg, indent=2))


# --------------------------------------------------------------------------------------------------- GGUF

_GGUF_ARCH = {"llama": "llama", "mixtral": "llama", "qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe",
              "glm4_moe": "glm4moe"}
# GLM-4.5's names where they differ (gguf-py's tensor map for glm4moe; the converter renames the router's
# e_score_correction_bias to e_score_correction.bias, which that map files under exp_probs_b).
_GLM_TENSORS = {
    "post_attention_layernorm": "post_attention_norm", "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp", "mlp.shared_experts.down_proj": "ffn_down_shexp",
}
_LAYER_TENSORS = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
# the multi-token-prediction block's own tensors (add_mtp_layer), as llama.cpp's converter names them
_NEXTN_TENSORS = {"eh_proj": "nextn.eh_proj", "enorm": "nextn.enorm", "hnorm": "nextn.hnorm",
                  "shared_head.norm": "nextn.shared_head_norm", "shared_head.head": "nextn.shared_head_head",
                  "embed_tokens": "nextn.embed_tokens"}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")
_EXPERT_RE = re.compile(r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)")
_EXPERT_PART = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}
# The converter keeps these in F32 whatever the requested type (llama.cpp's kernels want them so).
_ALWAYS_F32 = ("_norm.weight", "ffn_gate_inp.weight")


def _permute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF's half-split rotary row order -> llama.cpp's interleaved pairs, per head."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _read_safetensors(hf_dir: Path) -> dict[str, np.ndarray]:
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    tensors: dict[str, np.ndarray] = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors |= {k: v.float().numpy() for k, v in load_file(hf_dir / shard).items()}
    return tensors


def _gguf_tensors(cfg: PreTrainedConfig, hf: dict[str, np.ndarray], arch: str) -> dict[str, np.ndarray]:
    out = {"token_embd.weight": hf["model.embed_tokens.weight"]}
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name, w in hf.items():
        if name.endswith(".mlp.gate.e_score_correction_bias"):
            out[f"blk.{int(name.split('.')[2])}.exp_probs_b.bias"] = w
            continue
        m = _LAYER_RE.fullmatch(name)
        if not m:
            continue
        layer, module, kind = int(m[1]), m[2], m[3]
        if e := _EXPERT_RE.fullmatch(module):
            experts.setdefault((layer, _EXPERT_PART[e[2]]), {})[int(e[1])] = w
            continue
        gname = (_GLM_TENSORS.get(module) if arch == "glm4moe" else None) or _NEXTN_TENSORS.get(module) \
            or _LAYER_TENSORS[module]
        if arch == "llama" and gname == "attn_q":
            w = _permute_rows(w, cfg.num_attention_heads)
        elif arch == "llama" and gname == "attn_k":
            w = _permute_rows(w, cfg.num_key_value_heads)
        elif gname == "ffn_gate_inp_shexp":
            w = w.reshape(-1)  # [1, H] in HF; llama.cpp declares it {n_embd}
        out[f"blk.{layer}.{gname}.{kind}"] = w
    for (layer, part), by_id in sorted(experts.items()):
        out[f"blk.{layer}.ffn_{part}_exps.weight"] = np.stack([by_id[i] for i in range(len(by_id))])
    has_mtp = f"model.layers.{cfg.num_hidden_layers}.eh_proj.weight" in hf  # written above, as a real block
    if arch == "glm4moe" and not has_mtp:  # the Hub's GGUFs carry one more block, for multi-token prediction
        last, mtp = cfg.num_hidden_layers - 1, cfg.num_hidden_layers
        out |= {n.replace(f"blk.{last}.", f"blk.{mtp}.", 1): t for n, t in list(out.items())
                if n.startswith(f"blk.{last}.")}
        out[f"blk.{mtp}.nextn.eh_proj.weight"] = np.zeros((cfg.hidden_size, 2 * cfg.hidden_size), np.float32)
    out["output_norm.weight"] = hf["model.norm.weight"]
    if not cfg.tie_word_embeddings:
        out["output.weight"] = hf["lm_head.weight"]
    rope = cfg.rope_parameters
    if rope["rope_type"] == "llama3":
        # llama.cpp stores Llama 3's band rescaling as per-frequency divisors rather than as metadata.
        dim = cfg.head_dim
        base = 1.0 / rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
        scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
        out["rope_freqs.weight"] = (base / scaled).float().numpy()
    return out


def _write_model_metadata(w: gguf.GGUFWriter, cfg: PreTrainedConfig, family: str) -> None:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_name(f"tiny-{family}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers + (family == "glm4_moe"))  # GLM's MTP block is counted
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(int(head_dim * cfg.rope_parameters.get("partial_rotary_factor", 1.0)))
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    if family == "mixtral":
        # Real Mixtral GGUFs state the expert width only as feed_forward_length.
        w.add_expert_count(cfg.num_local_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
    elif family in ("qwen3_moe", "qwen2_moe"):
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if family == "qwen2_moe":
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if family == "glm4_moe":  # as llama.cpp's converter states GLM-4.5's routing
        w.add_expert_count(cfg.n_routed_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_shared_count(cfg.n_shared_experts)
        w.add_leading_dense_block_count(cfg.first_k_dense_replace)
        w.add_expert_weights_scale(cfg.routed_scaling_factor)
        w.add_expert_weights_norm(cfg.norm_topk_prob)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_group_count(cfg.n_group)
        w.add_expert_group_used_count(cfg.topk_group)
        w.add_nextn_predict_layers(1)  # the extra multi-token-prediction block _gguf_tensors writes
    rope = cfg.rope_parameters
    if rope["rope_type"] == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])


def _write_tokenizer_metadata(w: gguf.GGUFWriter, hf_dir: Path, pre: str = "qwen2") -> None:
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    tok_cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    special = {t["content"]: t["id"] for t in tok["added_tokens"]}
    vocab |= special
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert len(tokens) == max(vocab.values()) + 1, "vocabulary ids must be dense"
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab[tok_cfg["bos_token"]])
    w.add_eos_token_id(vocab[tok_cfg["eos_token"]])
    w.add_pad_token_id(vocab[tok_cfg["pad_token"]])
    w.add_add_bos_token(False)
    w.add_chat_template(tok_cfg["chat_template"])


_FILE_TYPES = {
    "F32": (gguf.LlamaFileType.ALL_F32, None),
    "F16": (gguf.LlamaFileType.MOSTLY_F16, gguf.GGMLQuantizationType.F16),
    "Q8_0": (gguf.LlamaFileType.MOSTLY_Q8_0, gguf.GGMLQuantizationType.Q8_0),
}


def write_gguf_from_hf(hf_dir: Path, gguf_path: Path, *, tensor_type: str = "F32") -> Path:
    """Converts the checkpoint `write_hf_checkpoint` wrote into a GGUF of `tensor_type` ("F32", "F16", "Q8_0")."""
    hf_dir, gguf_path = Path(hf_dir), Path(gguf_path)
    file_type, qtype = _FILE_TYPES[tensor_type]
    cfg = AutoConfig.from_pretrained(hf_dir)
    family = cfg.model_type
    arch = _GGUF_ARCH[family]
    w = gguf.GGUFWriter(str(gguf_path), arch)
    _write_model_metadata(w, cfg, family)
    w.add_file_type(file_type)
    _write_tokenizer_metadata(w, hf_dir)
    for name, t in _gguf_tensors(cfg, _read_safetensors(hf_dir), arch).items():
        t = np.ascontiguousarray(t, dtype=np.float32)
        if qtype is None or t.ndim < 2 or name.endswith(_ALWAYS_F32):
            w.add_tensor(name, t)
        elif qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, t.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(t, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return gguf_path


# --------------------------------------------------------------------------------------------------- reference


@torch.no_grad()
def hf_logits(model: PreTrainedModel, ids: list[int]) -> torch.Tensor:
    """[T, vocab] float32 logits of `ids` from the transformers model."""
    return model(torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def hf_greedy(model: PreTrainedModel, ids: list[int], n: int) -> list[int]:
    """`n` greedy tokens from transformers' own generate, EOS not stopping it."""
    # An empty eos list disables stopping without masking EOS out of the argmax (None would fall back to the
    # model's generation_config).
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         do_sample=False, max_new_tokens=n, eos_token_id=[], pad_token_id=0)
    new = out[0, len(ids):].tolist()
    assert len(new) == n, f"transformers stopped after {len(new)} of {n} tokens"
    return new


def divergence_report(model: PreTrainedModel, prompt: list[int], ours: list[int], expected: list[int]) -> str:
    """Where two greedy continuations part, and transformers' top-2 logit margin there (a near-tie explains a flip,
    a wide margin means a real bug)."""
    shorter = min(len(ours), len(expected))
    step = next((i for i in range(shorter) if ours[i] != expected[i]), shorter)
    if step == shorter:
        return f"lengths differ: ours {len(ours)}, transformers {len(expected)}"
    logits = hf_logits(model, prompt + expected[:step])[-1]
    top2 = logits.topk(2).values
    return (f"first difference at step {step}: ours {ours[step]} (transformers logit {logits[ours[step]].item():.4f}), "
            f"transformers {expected[step]} (logit {top2[0].item():.4f}, margin over runner-up "
            f"{(top2[0] - top2[1]).item():.4f})\nours:         {ours}\ntransformers: {expected}")
