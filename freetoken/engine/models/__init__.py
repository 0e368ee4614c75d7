"""Model families, one pure file per HF `model_type`; this registry maps the type to its module."""

from __future__ import annotations

from types import ModuleType

from freetoken.engine.models import llama, mixtral, qwen2_moe, qwen3_moe, qwen3_next
from freetoken.errors import UnsupportedArchitectureError

FAMILIES: dict[str, ModuleType] = {m.MODEL_TYPE: m for m in (llama, qwen3_moe, qwen2_moe, mixtral, qwen3_next)}


def family_for(model_type: str | None) -> ModuleType:
    if model_type not in FAMILIES:
        raise UnsupportedArchitectureError(
            f"unsupported architecture {model_type!r}; supported model types: {', '.join(sorted(FAMILIES))}"
        )
    return FAMILIES[model_type]
