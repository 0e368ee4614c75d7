"""The plain-torch hyper-connection weights the kernel is checked against: the model code's own `hyper_mix`
(freetoken/engine/models/hyper_connections.py, DeepSeek-V4's manifold-constrained hyper-connections), re-exported
so the kernel's reference sits beside it."""

from __future__ import annotations

from freetoken.engine.models.hyper_connections import hyper_mix

__all__ = ["hyper_mix"]
