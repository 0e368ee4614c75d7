"""The plain-torch hyper-connection weights the kernel is checked against: the model code's own `hyper_mix`
(freetoken/engine/models/deepseek_v4.py, DeepSeek-V4's manifold-constrained hyper-connections), re-exported here
so the kernel's reference sits beside it."""

from __future__ import annotations

from freetoken.engine.models.deepseek_v4 import hyper_mix

__all__ = ["hyper_mix"]
