"""The gated delta rule (Gated DeltaNet, the linear-attention layers of Qwen3-Next and Qwen3.5/3.6-MoE), plain
torch, fp32: the recurrent form one token at a time (decode) and the chunked form (prefill), which equal each
other up to rounding; the tests hold them to that and to transformers.

Per value head, the state S is a [Dk, Dv] matrix. For each token, with decay g (log space, ≤ 0), strength β,
key k and query q (L2-normalised; q also scaled by 1/√Dk) and value v:

    S ← exp(g)·S;   δ = β·(v − Sᵀk);   S ← S + k δᵀ;   o = Sᵀq

The delta δ writes into S only what S does not already predict for k. Over a chunk of C tokens starting from
S₀, with c the running sum of g inside the chunk, the deltas solve one unit lower-triangular system

    (I + A) Δ = β⊙V − (β⊙exp(c))⊙K S₀,   A[i, j] = β_i exp(c_i − c_j) k_i·k_j  (j < i)

after which the outputs and the next state are matmuls: o_i = exp(c_i) S₀ᵀq_i + Σ_{j≤i} exp(c_i − c_j) q_i·k_j δ_j,
S_C = exp(c_C) S₀ + Σ_j exp(c_C − c_j) k_j δ_jᵀ. Every exponent is ≤ 0, so nothing overflows.

Shapes: T tokens, H value heads, Dk key dim, Dv value dim; q and k already repeated to H heads.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

CHUNK = 64  # tokens per chunk of the chunked form: the triangular system is C×C per head


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / ‖x‖ over the last dim, the ε inside the root (as the reference library does)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def recurrent_gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token at a time. q, k [T, H, Dk], v [T, H, Dv], g, beta [T, H], state [H, Dk, Dv] (all fp32) →
    (outputs [T, H, Dv], the state after the last token)."""
    out = torch.empty_like(v)
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, None, None]
        predicted = torch.einsum("hk,hkv->hv", k[t], state)
        delta = (v[t] - predicted) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        out[t] = torch.einsum("hk,hkv->hv", q[t], state)
    return out, state


def chunked_gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        state: torch.Tensor, chunk: int = CHUNK, carry=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The same result, `chunk` tokens at a time: every chunk's triangular system and intra-chunk products at
    once (batched over chunks), then only the state carried from chunk to chunk in a loop of 3 matmuls. T is
    padded to whole chunks with tokens that change nothing (no decay, β = 0). `carry`: the loop (`carry_state`,
    or the Triton kernel's)."""
    carry = carry or carry_state
    t, heads, dk = k.shape
    dv = v.shape[-1]
    pad = -t % chunk
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    n = (t + pad) // chunk
    # [H, N, C, ...]: heads, chunks, positions in the chunk
    q, k, v = (x.reshape(n, chunk, heads, -1).permute(2, 0, 1, 3) for x in (q, k, v))
    g, beta = (x.reshape(n, chunk, heads).permute(2, 0, 1) for x in (g, beta))
    c = g.cumsum(dim=-1)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (c[..., :, None] - c[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # exp(c_i − c_j), j ≤ i
    system = (beta[..., :, None] * (k @ k.transpose(-1, -2)) * decay).tril(-1)
    rhs = torch.cat((beta[..., None] * v, (beta * c.exp())[..., None] * k), dim=-1)
    eye = torch.eye(chunk, device=q.device, dtype=q.dtype)
    solved = torch.linalg.solve_triangular(system + eye, rhs, upper=False, unitriangular=True)
    fresh, from_state = solved[..., :dv], solved[..., dv:]  # Δ = fresh − from_state S₀
    attn = (q @ k.transpose(-1, -2)) * decay  # the diagonal included
    q_decayed = c.exp()[..., None] * q
    k_to_end = (c[..., -1:] - c).exp()[..., None] * k
    chunk_decay = c[..., -1].exp()  # [H, N]
    out, state = carry(ChunkTerms(fresh, from_state, attn, q_decayed, k_to_end, chunk_decay), state)
    return out.permute(1, 2, 0, 3).reshape(n * chunk, heads, dv)[:t], state


class ChunkTerms(NamedTuple):
    """Per head and chunk ([H, N, C, ...]), what the state loop needs: Δ = fresh − from_state·S; the output is
    q_decayed·S + attn·Δ; the next S = chunk_decay·S + k_to_endᵀ·Δ."""

    fresh: torch.Tensor  # [H, N, C, Dv]
    from_state: torch.Tensor  # [H, N, C, Dk]
    attn: torch.Tensor  # [H, N, C, C]
    q_decayed: torch.Tensor  # [H, N, C, Dk]
    k_to_end: torch.Tensor  # [H, N, C, Dk]
    chunk_decay: torch.Tensor  # [H, N]


def carry_state(terms: ChunkTerms, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk-to-chunk loop in plain torch (3 matmuls a chunk): outputs [H, N, C, Dv] and the last state."""
    heads, n, chunk, dv = terms.fresh.shape
    out = torch.empty(heads, n, chunk, dv, dtype=state.dtype, device=state.device)
    for i in range(n):
        deltas = terms.fresh[:, i] - terms.from_state[:, i] @ state  # [H, C, Dv]
        out[:, i] = terms.q_decayed[:, i] @ state + terms.attn[:, i] @ deltas
        state = terms.chunk_decay[:, i, None, None] * state + terms.k_to_end[:, i].transpose(-1, -2) @ deltas
    return out, state


def causal_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution continuing from the previous inputs. x [T, C], state [C, K−1] (the last K−1
    inputs before x, zeros at the start), weight [C, K] → (SiLU of the outputs [T, C], the next state)."""
    full = torch.cat((state.to(x.dtype), x.transpose(0, 1)), dim=1)  # [C, K−1+T]
    kernel = weight.shape[1]
    out = F.conv1d(full[None].to(weight.dtype), weight[:, None, :], groups=weight.shape[0])[0]  # [C, T]
    return F.silu(out).transpose(0, 1).to(x.dtype), full[:, full.shape[1] - (kernel - 1):].clone()
