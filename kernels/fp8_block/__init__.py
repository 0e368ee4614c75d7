"""Block-scaled FP8 weights (DeepSeek-V3 / Qwen3 / GLM "fp8" checkpoints): the plain-torch dequantization."""
