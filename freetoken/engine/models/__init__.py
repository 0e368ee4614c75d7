"""Model families, one pure file per HF `model_type`; this registry maps the type to its module."""

from __future__ import annotations

from types import ModuleType

from freetoken.engine.models import (
    deepseek_v3,
    deepseek_v4,
    glm4_moe,
    glm_moe_dsa,
    gpt_oss,
    llama,
    mixtral,
    qwen2_moe,
    qwen3_5_moe,
    qwen3_moe,
    qwen3_next,
)
from freetoken.errors import UnsupportedArchitectureError

FAMILIES: dict[str, ModuleType] = {
    model_type: m
    for m in (llama, qwen3_moe, qwen2_moe, mixtral, qwen3_next, qwen3_5_moe, glm4_moe, glm_moe_dsa, deepseek_v3,
              deepseek_v4, gpt_oss)
    for model_type in getattr(m, "MODEL_TYPES", (m.MODEL_TYPE,))  # a family may answer to several names
}


def family_for(model_type: str | None) -> ModuleType:
    if model_type not in FAMILIES:
        raise UnsupportedArchitectureError(
            f"unsupported architecture {model_type!r}; supported model types: {', '.join(sorted(FAMILIES))}"
        )
    return FAMILIES[model_type]
