"""Random-weight models with the exact shapes of named real MoE models, built in memory, nothing downloaded.

Bytes moved and FLOPs spent equal the real model's. Weights are scaled so that routing stays diverse through
every layer, as in a trained model (see `_writes_residual`); every result still reports its hit rate.
`layers` truncates the stack for quick runs.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from freetoken.bench.random_fill import random_bytes_, random_uniform_
from freetoken.engine import gpu_paths
from freetoken.engine.experts import LayerExperts
from freetoken.engine.loader import LoadedModel, attach_experts, build_executor, empty_model, resolve_device
from freetoken.engine.models import family_for
from freetoken.engine.offload.quantized import QuantizedExperts

_GPT_OSS_ROPE = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                 "truncate": False, "original_max_position_embeddings": 4096}

SHAPES: dict[str, dict] = {
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, intermediate_size=6144,
        moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
    ),
    "mixtral-8x7b": dict(
        model_type="mixtral", vocab_size=32000, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=32768, rope_theta=1_000_000.0, rms_norm_eps=1e-5,
    ),
    # DeepSeek-V3's expert pool and routing (61 layers, the first 3 dense; 256 routed experts of 7168×2048, top-8,
    # one shared expert) on the qwen2_moe block: plain softmax top-k routing instead of grouped sigmoid routing,
    # and GQA attention standing in for MLA (the deepseek_v3 family is its own issue). Its 1.3 TB of bf16
    # experts exceed any host's RAM: run it truncated with --layers, or as Q8_0.
    "deepseek-v3-like": dict(
        model_type="qwen2_moe", vocab_size=129280, hidden_size=7168, num_hidden_layers=61, num_attention_heads=128,
        num_key_value_heads=8, head_dim=128, intermediate_size=18432, moe_intermediate_size=2048, num_experts=256,
        num_experts_per_tok=8, shared_expert_intermediate_size=2048, norm_topk_prob=True, mlp_only_layers=[0, 1, 2],
        qkv_bias=False, max_position_embeddings=163840, rope_theta=10000.0, rms_norm_eps=1e-6,
    ),
    # DeepSeek-V3 itself (transformers' DeepseekV3Config defaults): multi-head latent attention, grouped sigmoid
    # routing (8 groups, 4 compete), 256 experts of 7168×2048, top-8, one shared expert, 3 dense layers. 1.3 TB
    # of bf16 experts: run it with --layers (and Q8_0) on any one host.
    "deepseek-v3": dict(
        model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, num_hidden_layers=61, num_attention_heads=128,
        num_key_value_heads=128, intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=256,
        num_experts_per_tok=8, n_shared_experts=1, n_group=8, topk_group=4, first_k_dense_replace=3,
        routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=163840, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    # GLM-5 (transformers' GlmMoeDsaConfig defaults): MLA with DeepSeek Sparse Attention (32 indexer heads of 128,
    # each query attends to 2,048 keys), 78 layers, the first 3 dense, 256 experts of 6144×2048, top-8, one
    # shared expert. 1.4 TB of bf16 experts: --layers (and Q8_0) on any one host.
    "glm-5": dict(
        model_type="glm_moe_dsa", vocab_size=154880, hidden_size=6144, num_hidden_layers=78, num_attention_heads=64,
        num_key_value_heads=64, intermediate_size=12288, moe_intermediate_size=2048, n_routed_experts=256,
        num_experts_per_tok=8, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=3,
        routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192,
        qk_rope_head_dim=64, v_head_dim=256, index_topk=2048, index_head_dim=128, index_n_heads=32,
        max_position_embeddings=202752, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    # DeepSeek-V4-Flash (transformers' DeepseekV4Config defaults, which its docs tie to V4-Flash-Base): 43 layers
    # of compressed attention (two HCA, then CSA and HCA alternating; one 512-wide KV head, windows of 128), 4
    # hyper-connection streams, 256 experts of 4096×2048, top-6, one shared expert, the first 3 layers hash-routed.
    # 554 GB of bf16 experts: --layers (and Q8_0) on any one host. The compress RoPE's YaRN (factor 16) is as
    # transformers' config describes the release's.
    "deepseek-v4-flash": dict(
        model_type="deepseek_v4", vocab_size=129280, hidden_size=4096, num_hidden_layers=43, num_attention_heads=64,
        num_key_value_heads=1, head_dim=512, partial_rotary_factor=64 / 512, q_lora_rank=1024, o_groups=8,
        o_lora_rank=1024, moe_intermediate_size=2048, n_routed_experts=256, num_experts_per_tok=6,
        n_shared_experts=1, scoring_func="sqrtsoftplus", routed_scaling_factor=1.5, swiglu_limit=10.0,
        sliding_window=128, index_n_heads=64, index_head_dim=128, index_topk=512, hc_mult=4, hc_sinkhorn_iters=20,
        max_position_embeddings=1048576, rms_norm_eps=1e-6, rope_theta=10000.0, compress_rope_theta=160000.0,
        rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
    ),
    # GLM-4.5-Air (transformers' Glm4MoeConfig defaults): 46 layers, the first dense, 128 experts of 4096×1408,
    # top-8, one shared expert, partial RoPE. 199 GB of bf16 experts: Q8_0 or --layers on a 128 GB host.
    "glm-4.5-air": dict(
        model_type="glm4_moe", vocab_size=151552, hidden_size=4096, num_hidden_layers=46, num_attention_heads=96,
        num_key_value_heads=8, head_dim=128, intermediate_size=10944, moe_intermediate_size=1408,
        n_routed_experts=128, num_experts_per_tok=8, n_shared_experts=1, n_group=1, topk_group=1,
        first_k_dense_replace=1, routed_scaling_factor=1.0, norm_topk_prob=True, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0,
                                            "partial_rotary_factor": 0.5},
    ),
    # gpt-oss-20b / -120b (OpenAI's config.json): sinks, sliding window 128 on every other layer, biases, YaRN;
    # experts 2880×2880 with biases and the clamped SwiGLU. 20b: 38 GB of bf16 experts; 120b: 229 GB, so
    # --layers (or the MXFP4 format, not yet kept packed) on a 128 GB host.
    "gpt-oss-20b": dict(
        model_type="gpt_oss", vocab_size=201088, hidden_size=2880, num_hidden_layers=24, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4,
        sliding_window=128, swiglu_limit=7.0, attention_bias=True, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_parameters=_GPT_OSS_ROPE,
    ),
    "gpt-oss-120b": dict(
        model_type="gpt_oss", vocab_size=201088, hidden_size=2880, num_hidden_layers=36, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, intermediate_size=2880, num_local_experts=128, num_experts_per_tok=4,
        sliding_window=128, swiglu_limit=7.0, attention_bias=True, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_parameters=_GPT_OSS_ROPE,
    ),
    "tiny-gpt-oss": dict(
        model_type="gpt_oss", vocab_size=512, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, intermediate_size=64, num_local_experts=16, num_experts_per_tok=4,
        sliding_window=16, swiglu_limit=7.0, attention_bias=True, max_position_embeddings=4096,
        rms_norm_eps=1e-5, rope_parameters=_GPT_OSS_ROPE,
    ),
    # Both new routers and attentions small enough for a CPU test run.
    "tiny-mla": dict(
        model_type="deepseek_v3", vocab_size=512, hidden_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, intermediate_size=256, moe_intermediate_size=64, n_routed_experts=16,
        num_experts_per_tok=4, n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32,
        qk_rope_head_dim=16, v_head_dim=32, max_position_embeddings=4096, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    # GLM-5's sparse attention small enough for a CPU test run: each query sees 16 keys, layer 3 reuses layer 2's
    "tiny-dsa": dict(
        model_type="glm_moe_dsa", vocab_size=512, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, intermediate_size=256, moe_intermediate_size=64, n_routed_experts=16,
        num_experts_per_tok=4, n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32,
        qk_rope_head_dim=16, v_head_dim=32, index_topk=16, index_head_dim=32, index_n_heads=8,
        indexer_types=["full", "full", "full", "shared"], max_position_embeddings=4096, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    # DeepSeek-V4's layers small enough for a CPU test run: HCA every 16 tokens, CSA every 4 (its indexer keeps 4
    # entries of a 40-token context's 10), a sliding layer, windows of 16 keys, one hash-routed layer.
    "tiny-v4": dict(
        model_type="deepseek_v4", vocab_size=512, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=1, head_dim=64, partial_rotary_factor=0.25, q_lora_rank=64, o_groups=2, o_lora_rank=32,
        moe_intermediate_size=64, n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1,
        sliding_window=16, compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        layer_types=["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention",
                     "compressed_sparse_attention"], mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        index_n_heads=8, index_head_dim=32, index_topk=4, hc_mult=4, max_position_embeddings=4096,
        rms_norm_eps=1e-6, rope_theta=10000.0, compress_rope_theta=160000.0,
    ),
    # qwen3-30b-a3b's routing structure (48 layers of 128 experts, top-8) on a small hidden size: routing traces
    # for cache-policy studies on a CPU.
    "qwen3-30b-a3b-routing": dict(
        model_type="qwen3_moe", vocab_size=4096, hidden_size=256, num_hidden_layers=48, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, intermediate_size=512, moe_intermediate_size=32, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=8192, rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
    ),
    # Qwen3-Next-80B-A3B (transformers' Qwen3NextConfig defaults are the release's shape): 3 Gated DeltaNet
    # layers per full-attention layer, 512 experts of 2048×512, top-10, a shared expert. 154 GB of bf16 experts:
    # run it as Q8_0 or with --layers on a 128 GB host.
    "qwen3-next-80b-a3b": dict(
        model_type="qwen3_next", vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=16,
        num_key_value_heads=2, head_dim=256, intermediate_size=5632, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, num_experts=512, num_experts_per_tok=10, norm_topk_prob=True,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, full_attention_interval=4, max_position_embeddings=262144, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
    ),
    # Qwen3.5-35B-A3B (Qwen3_5MoeTextConfig's defaults): the same hybrid layers, 40 of them, 256 experts, top-8.
    "qwen3.5-35b-a3b": dict(
        model_type="qwen3_5_moe_text", vocab_size=248320, hidden_size=2048, num_hidden_layers=40,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, num_experts=256, num_experts_per_tok=8, linear_num_key_heads=16,
        linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        full_attention_interval=4, max_position_embeddings=262144, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
    ),
    # The hybrid structure small enough for a CPU test run.
    "tiny-hybrid": dict(
        model_type="qwen3_next", vocab_size=512, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, intermediate_size=256, moe_intermediate_size=64,
        shared_expert_intermediate_size=64, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
        linear_conv_kernel_dim=4, full_attention_interval=2, max_position_embeddings=4096, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    ),
    # Small enough for a CPU test run, same structure as qwen3-30b-a3b.
    "tiny-moe": dict(
        model_type="qwen3_moe", vocab_size=512, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, intermediate_size=256, moe_intermediate_size=64, num_experts=16,
        num_experts_per_tok=4, norm_topk_prob=True, max_position_embeddings=4096, rope_theta=10000.0,
        rms_norm_eps=1e-6,
    ),
}


def synthetic_config(shape: str, layers: int | None = None, vocab_size: int | None = None) -> dict:
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    cfg = dict(SHAPES[shape])
    if layers:
        cfg["num_hidden_layers"] = min(layers, cfg["num_hidden_layers"])
    if vocab_size:
        cfg["vocab_size"] = vocab_size
    return cfg


def _fill_(t: torch.Tensor, std: float, gen: torch.Generator, seed: int | None = None) -> torch.Tensor:
    """Uniform with the given standard deviation (cheaper than normal at 60 GB). A host tensor with a `seed`
    takes the hashed fill (random_fill.py: memory speed, where torch's generator fills at ~70 MB/s)."""
    bound = std * math.sqrt(3.0)
    if seed is not None and t.device.type == "cpu" and t.is_contiguous():
        return random_uniform_(t, bound, seed)
    return t.uniform_(-bound, bound, generator=gen)


def _writes_residual(name: str) -> bool:
    """Projections that add into the residual stream. Scaling them down (as GPT-2's init does) keeps each
    token's identity in the stream through every layer: at full scale a deep random network collapses all
    tokens onto one direction, and the router then sends every token to the same few experts."""
    return name.endswith(("o_proj.weight", "down_proj.weight", "attn.wo_b.weight", "shared_experts.w2.weight"))


def _skew_router_(model, exponent: float, gen: torch.Generator) -> None:
    """Scales router row e of every MoE layer by (1 + rank_e)^-exponent, ranks shuffled per layer: a row with a
    larger norm wins top-k more often, so popularity falls off like a Zipf law, as in trained MoE models."""
    for module in model.modules():
        if hasattr(module, "experts") and hasattr(module, "gate"):
            w = module.gate.weight
            ranks = torch.randperm(w.shape[0], generator=gen, device=gen.device).to(w.device)
            factors = (1.0 + ranks.float()) ** -exponent
            w.mul_((factors / factors.mean())[:, None].to(w.dtype))  # same mean row norm: only the spread changes


def build_synthetic(shape: str, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16,
                    expert_cache: int | None = None, policy: str = "freq", miss_path: str = "auto",
                    layers: int | None = None, seed: int = 0, skew: float = 0.0,
                    expert_format: str = "dense", vocab_size: int | None = None,
                    prefill_ahead: bool | None = None, mtp: bool = False) -> LoadedModel:
    """A seeded random model of `shape`; experts resident on `device`, or in host memory (pinned on CUDA)
    behind an expert cache of `expert_cache` bytes. `skew` > 0 makes expert popularity Zipf-like (see
    `_skew_router_`); 0 routes near-uniformly, the pessimistic case for a cache. `expert_format` "Q8_0" keeps
    offloaded experts as random Q8_0 blocks in host memory (as a Q8_0 GGUF would load). `vocab_size` overrides
    the shape's (to fit a real tokenizer to a small shape). `prefill_ahead`: as `load_model`'s (None: on for CUDA
    devices, as `ft serve` runs), so benches built here measure what a served model does. `mtp`: with one random
    multi-token-prediction layer (families that have one: deepseek_v3, glm4_moe)."""
    device = resolve_device(device)
    if prefill_ahead is None:
        prefill_ahead = device.type == "cuda" and gpu_paths.enabled("prefill-ahead")
    cfg = synthetic_config(shape, layers, vocab_size)
    family = family_for(cfg["model_type"])
    args = family.ModelArgs.from_config({**cfg, "num_nextn_predict_layers": 1} if mtp else cfg)
    if mtp:
        if not hasattr(family, "with_mtp"):
            raise ValueError(f"shape {shape!r} ({family.MODEL_TYPE}) has no multi-token-prediction layer here")
        args = family.with_mtp(args)
    spec = args.moe_spec()
    model = empty_model(family, args, dtype, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    residual_std = 0.02 / math.sqrt(2 * args.decoder.n_layers)
    with torch.no_grad():
        for index, (name, p) in enumerate(model.named_parameters()):
            tensor_seed = seed * 1_000_003 + index
            if not p.is_floating_point():  # a token → experts table (DeepSeek-V4's hash routing): distinct ids
                offsets = torch.arange(p.shape[1], device=p.device)
                p.copy_((torch.randint(spec.num_experts, (p.shape[0], 1), generator=gen, device=gen.device)
                         .to(p.device) + offsets) % spec.num_experts)
            elif "norm" in name:
                p.fill_(0.0 if _centred_norm(model, name) else 1.0)
            elif name.endswith("embed_tokens.weight"):  # token identity must dominate what layers add to all
                _fill_(p, 1.0, gen, tensor_seed)
            else:
                _fill_(p, residual_std if _writes_residual(name) else 0.02, gen, tensor_seed)
        if skew:
            _skew_router_(model, skew, gen)
    offload = expert_cache is not None
    if expert_format not in ("dense", "Q8_0", "MXFP4"):
        raise ValueError(f"expert_format must be 'dense', 'Q8_0' or 'MXFP4', got {expert_format!r}")
    if expert_format != "dense" and not offload:
        raise ValueError(f"{expert_format} experts are a host-memory format: give an expert_cache")
    if expert_format != "dense":
        host = quantized_host_experts(spec, expert_format, pin=device.type == "cuda", seed=seed + 1)
    else:
        host = host_experts(spec, dtype, torch.device("cpu") if offload else device,
                            pin=offload and device.type == "cuda", seed=seed + 1)
    if hasattr(model, "expert_forms"):  # expert biases and activation (gpt-oss), random like the other weights
        for layer, form in model.expert_forms().items():
            host[layer].form = form
    experts = build_executor(host, spec, dtype, device, expert_cache, policy, miss_path, prefill_ahead)
    attach_experts(model, experts)
    model.eval()
    return LoadedModel(model, args, family, None, spec, experts, device, dtype, Path(f"synthetic/{shape}"),
                       "synthetic", cfg)


def _centred_norm(model: torch.nn.Module, name: str) -> bool:
    """Norms that scale by 1 + weight (Qwen3-Next's) are the identity at 0, not at 1."""
    from freetoken.engine.models.qwen3_next import OffsetRMSNorm

    return isinstance(model.get_submodule(name.rsplit(".", 1)[0]), OffsetRMSNorm)


def host_experts(spec, dtype: torch.dtype, device: torch.device, pin: bool, seed: int) -> dict[int, LayerExperts]:
    gen = torch.Generator(device=device).manual_seed(seed)
    h, i, e = spec.hidden_size, spec.expert_intermediate_size, spec.num_experts
    layers = {}
    for layer in spec.moe_layers:
        tensors = [torch.empty(shape, dtype=dtype, device=device, pin_memory=pin)
                   for shape in ((e, i, h), (e, i, h), (e, h, i))]
        stds = (0.02, 0.02, 0.02 / math.sqrt(2 * len(spec.moe_layers)))  # down writes into the residual stream
        for k, (t, std) in enumerate(zip(tensors, stds, strict=True)):
            _fill_(t, std, gen, seed * 1_000_003 + 3 * layer + k)
        layers[layer] = LayerExperts(*tensors)
    return layers


def quantized_host_experts(spec, fmt: str, pin: bool, seed: int) -> dict[int, QuantizedExperts]:
    """Random blocks of `fmt` ("Q8_0": an fp16 scale + 32 int8 weights; "MXFP4": an E8M0 scale byte + 32 four-bit
    codes), scaled like the dense experts; built in place."""
    h, i, e = spec.hidden_size, spec.expert_intermediate_size, spec.num_experts
    shapes = {"gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}
    stds = {"gate_proj": 0.02, "up_proj": 0.02, "down_proj": 0.02 / math.sqrt(2 * len(spec.moe_layers))}
    layers = {}
    for layer in spec.moe_layers:
        raw = {}
        for k, (p, (out, inp)) in enumerate(shapes.items()):
            blocks, size = out * inp // 32, 34 if fmt == "Q8_0" else 17
            data = torch.empty((e, blocks, size), dtype=torch.uint8, pin_memory=pin)
            random_bytes_(data, seed * 1_000_003 + 3 * layer + k)
            if fmt == "Q8_0":  # int8 uniform in [-128, 127] has std ≈ 74; the scale maps that onto the target
                data[:, :, :2] = torch.tensor([stds[p] / 74.0], dtype=torch.float16).view(torch.uint8)
            else:  # uniform codes ±{0, 1, 2, 3, 4, 6, 8, 12} have std ≈ 5.85; the power of two nearest the target
                data[:, :, 0] = 128 + round(math.log2(stds[p] / 5.85))
            raw[p] = data.view(e, blocks * size)
        layers[layer] = QuantizedExperts(raw, dict.fromkeys(shapes, fmt), shapes)
    return layers
