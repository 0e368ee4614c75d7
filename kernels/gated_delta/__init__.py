"""Gated delta rule (Gated DeltaNet decode step) as a Triton kernel, beside its plain-torch reference."""
