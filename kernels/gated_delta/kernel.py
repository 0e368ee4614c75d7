"""The gated delta rule's recurrent form in one Triton launch: each program holds one value head's state
columns [Dk, BV] in registers and walks the tokens (a decode step's one, or a few), where plain torch spends ~10
launches per token and layer and reads the state back from memory between them. fp32 throughout, as the
reference (`reference.py`) is; the tests run it under Triton's interpreter on the CPU.

Shapes: T tokens, H value heads, Dk key dim, Dv value dim; q and k already repeated to H heads, normalised and
q scaled (see freetoken/engine/models/gated_delta.py).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no triton on this platform: `available()` says so
    triton = None


def available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


if triton is not None:

    @triton.jit
    def _recurrent_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, out_ptr, new_state_ptr, T, H,
                          DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
        """Program (head, value block): S[:, block] through every token, each output's block, the last S."""
        h, vb = tl.program_id(0), tl.program_id(1)
        ks = tl.arange(0, BK)
        vs = vb * BV + tl.arange(0, BV)
        mk, mv = ks < DK, vs < DV
        cell = h * DK * DV + ks[:, None] * DV + vs[None, :]
        s = tl.load(state_ptr + cell, mask=mk[:, None] & mv[None, :], other=0.0)
        for t in range(T):
            row = t * H + h
            kt = tl.load(k_ptr + row * DK + ks, mask=mk, other=0.0)
            qt = tl.load(q_ptr + row * DK + ks, mask=mk, other=0.0)
            vt = tl.load(v_ptr + row * DV + vs, mask=mv, other=0.0)
            s = s * tl.exp(tl.load(g_ptr + row))
            delta = (vt - tl.sum(s * kt[:, None], axis=0)) * tl.load(beta_ptr + row)
            s = s + kt[:, None] * delta[None, :]
            tl.store(out_ptr + row * DV + vs, tl.sum(s * qt[:, None], axis=0), mask=mv)
        tl.store(new_state_ptr + cell, s, mask=mk[:, None] & mv[None, :])


def recurrent_gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """As reference.recurrent_gated_delta: q, k [T, H, Dk], v [T, H, Dv], g, beta [T, H], state [H, Dk, Dv], all
    fp32 → (outputs [T, H, Dv], the next state, a new tensor: the given one is left as it was)."""
    t, heads, dk = k.shape
    dv = v.shape[-1]
    q, k, v, g, beta, state = (x.contiguous() for x in (q, k, v, g, beta, state))
    out = torch.empty_like(v)
    new_state = torch.empty_like(state)
    bk = triton.next_power_of_2(dk)
    bv = min(64, triton.next_power_of_2(dv))
    _recurrent_kernel[(heads, triton.cdiv(dv, bv))](q, k, v, g, beta, state, out, new_state, t, heads,
                                                      DK=dk, DV=dv, BK=bk, BV=bv)
    return out, new_state
