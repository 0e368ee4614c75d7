"""The gated delta rule in Triton, two loops the plain-torch forms run step by step: the recurrent form (each
program holds one value head's state columns [Dk, BV] in registers and walks the tokens of a decode step, where
plain torch spends ~10 launches per token and layer), and the chunked form's chunk-to-chunk state loop (the same
registers carried over every chunk, 3 dots a chunk, where plain torch launches 3 batched matmuls per chunk: 256
chunks per layer for a 16k prompt). fp32 throughout with IEEE dots, as the reference (`reference.py`) is; the
tests run both under Triton's interpreter on the CPU.

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

    @triton.jit
    def _carry_kernel(fresh_ptr, from_ptr, attn_ptr, q_ptr, k_ptr, decay_ptr, state_ptr, out_ptr, new_state_ptr, N,
                      C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
        """Program (head, value block): S[:, block] through every chunk of the head."""
        h, vb = tl.program_id(0), tl.program_id(1)
        cs, ks = tl.arange(0, C), tl.arange(0, BK)
        vs = vb * BV + tl.arange(0, BV)
        mk, mv = ks < DK, vs < DV
        s = tl.load(state_ptr + h * DK * DV + ks[:, None] * DV + vs[None, :], mask=mk[:, None] & mv[None, :],
                    other=0.0)
        for i in range(N):
            chunk = h * N + i
            rows_v = chunk * C * DV + cs[:, None] * DV + vs[None, :]
            rows_k = chunk * C * DK + cs[:, None] * DK + ks[None, :]
            fresh = tl.load(fresh_ptr + rows_v, mask=mv[None, :], other=0.0)
            from_state = tl.load(from_ptr + rows_k, mask=mk[None, :], other=0.0)
            deltas = fresh - tl.dot(from_state, s, input_precision="ieee")  # [C, BV]
            q = tl.load(q_ptr + rows_k, mask=mk[None, :], other=0.0)
            attn = tl.load(attn_ptr + chunk * C * C + cs[:, None] * C + cs[None, :])
            out = tl.dot(q, s, input_precision="ieee") + tl.dot(attn, deltas, input_precision="ieee")
            tl.store(out_ptr + rows_v, out, mask=mv[None, :])
            k_end = tl.load(k_ptr + rows_k, mask=mk[None, :], other=0.0)
            s = tl.load(decay_ptr + chunk) * s + tl.dot(tl.trans(k_end), deltas, input_precision="ieee")
        tl.store(new_state_ptr + h * DK * DV + ks[:, None] * DV + vs[None, :], s, mask=mk[:, None] & mv[None, :])


def carry_state(terms, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """As reference.carry_state (terms: a ChunkTerms of fp32 tensors; chunk length a power of two ≥ 16): the
    outputs [H, N, C, Dv] and the last state, a new tensor."""
    heads, n, chunk, dv = terms.fresh.shape
    dk = terms.from_state.shape[-1]
    fresh, from_state, attn, q, k, decay = (x.contiguous() for x in terms)
    state = state.contiguous()
    out = torch.empty_like(fresh)
    new_state = torch.empty_like(state)
    bk = max(16, triton.next_power_of_2(dk))
    bv = max(16, min(64, triton.next_power_of_2(dv)))
    _carry_kernel[(heads, triton.cdiv(dv, bv))](fresh, from_state, attn, q, k, decay, state, out, new_state, n,
                                                 C=chunk, DK=dk, DV=dv, BK=bk, BV=bv)
    return out, new_state


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
