"""The plain-torch gated delta rule the kernel is checked against: the model code's own recurrent form
(freetoken/engine/models/gated_delta.py, where the rule and its chunked form are derived), re-exported here so
the kernel's reference sits beside it."""

from __future__ import annotations

from freetoken.engine.models.gated_delta import ChunkTerms, carry_state, chunked_gated_delta, recurrent_gated_delta

__all__ = ["ChunkTerms", "carry_state", "chunked_gated_delta", "recurrent_gated_delta"]
