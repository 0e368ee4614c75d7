"""Routed-expert execution: the only way a model touches its routed experts.

A model's MoE block computes the router and calls `ExpertExecutor.forward(layer, hidden, topk_ids,
topk_weights)`. Where the expert weights live (all resident on the GPU, a byte-budgeted GPU cache over pinned
host RAM, the CPU) is the executor's business; every executor must give the same result as the resident one.

Shapes: N tokens, H hidden, I expert intermediate, E experts, K experts per token.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from freetoken.engine import gpu_paths
from freetoken.kernels.cpu_experts.reference import ExpertForm

EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


PLAIN = ExpertForm()  # plain SwiGLU, no biases


def apply_experts(form: ExpertForm | None, x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                  down: torch.Tensor, experts: torch.Tensor | int | None = None) -> torch.Tensor:
    """The expert function over batched matmuls: x [..., n, H] times gate/up [..., H, I] and down [..., I, H]
    (already oriented for matmul), the biases of `experts` (ids broadcasting over the leading dims) added."""
    g, u = x @ gate, x @ up
    if form is None or form is PLAIN:
        return (F.silu(g) * u) @ down
    if form.gate_bias is not None:
        g = g + _bias(form.gate_bias, experts, g)
        u = u + _bias(form.up_bias, experts, u)
    y = form.activate(g, u) @ down
    return y + _bias(form.down_bias, experts, y) if form.down_bias is not None else y


def _bias(bias: torch.Tensor, experts, like: torch.Tensor) -> torch.Tensor:
    """bias rows of `experts` shaped to add to `like` [..., n, F]: one row per leading index, broadcast over n."""
    rows = bias[experts].to(like.dtype)
    return rows.unsqueeze(-2) if rows.dim() < like.dim() else rows


@dataclass(slots=True)
class LayerExperts:
    """Stacked weights of one layer's routed experts, in HF orientation (out_features, in_features). `form`: what
    the experts compute besides the matmuls (None: plain SwiGLU)."""

    gate_proj: torch.Tensor  # [E, I, H]
    up_proj: torch.Tensor  # [E, I, H]
    down_proj: torch.Tensor  # [E, H, I]
    form: ExpertForm | None = None

    @property
    def num_experts(self) -> int:
        return self.gate_proj.shape[0]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.gate_proj, self.up_proj, self.down_proj))

    def weights_of(self, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.gate_proj[expert], self.up_proj[expert], self.down_proj[expert]


class ExpertExecutor(Protocol):
    capturable: bool  # whether forward can run inside CUDA-graph capture (no host synchronisation)

    def forward(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        """hidden [N, H], topk_ids [N, K] (int), topk_weights [N, K] → weighted sum of expert outputs [N, H]."""
        ...


def expert_mlp(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
               form: ExpertForm | None = None, expert: int | None = None) -> torch.Tensor:
    """One expert: x [n, H]; gate, up [I, H]; down [H, I]; `form` (with the expert's id for its biases) where it
    is not plain SwiGLU."""
    if form is None or form is PLAIN:
        return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)
    g, u = F.linear(x, gate), F.linear(x, up)
    if form.gate_bias is not None:
        g, u = g + form.gate_bias[expert].to(g.dtype), u + form.up_bias[expert].to(u.dtype)
    y = F.linear(form.activate(g, u), down)
    return y + form.down_bias[expert].to(y.dtype) if form.down_bias is not None else y


@dataclass(slots=True)
class ExpertGroup:
    """The (token, expert) pairs routed to one expert."""

    expert: int
    tokens: torch.Tensor  # [n] token indices
    weights: torch.Tensor  # [n] routing weights


def group_by_expert(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
                    dtype: torch.dtype) -> list[ExpertGroup]:
    """Sorts the (token, expert) pairs by expert; one host sync per call (the per-expert counts)."""
    k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    token_of_pair = order // k
    weight_of_pair = topk_weights.reshape(-1)[order].to(dtype)
    present = [e for e, count in enumerate(counts) if count]
    sizes = [counts[e] for e in present]
    # one split per tensor, not two slices per expert: a 500-token chunk's 128 groups cost the host 0.1 ms, not 0.3
    return [ExpertGroup(e, t, w) for e, t, w in zip(present, token_of_pair.split(sizes), weight_of_pair.split(sizes),
                                                    strict=True)]


def run_groups(hidden: torch.Tensor, groups: list[ExpertGroup],
               weights_of: Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
               form: ExpertForm | None = None) -> torch.Tensor:
    """Runs each expert once on its tokens; `weights_of(e)` gives (gate, up, down) wherever they live."""
    out = torch.zeros_like(hidden)
    for g in groups:
        y = expert_mlp(hidden[g.tokens], *weights_of(g.expert), form, g.expert)
        out.index_add_(0, g.tokens, y * g.weights[:, None])
    return out


def host_ints_to(device: torch.device, values: list[int]) -> torch.Tensor:
    """A list of ints as a tensor on `device` without a host sync: `torch.tensor(values, device=cuda)` waits for
    the whole stream (a blocking copy), which would stall the host behind the GPU at every call."""
    t = torch.tensor(values, dtype=torch.long)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def run_groups_padded(hidden: torch.Tensor, groups: list[ExpertGroup], experts: LayerExperts, slots: list[int],
                      out: torch.Tensor, form: ExpertForm | None = None) -> None:
    """Adds to `out` the experts at `slots` of `experts` applied to their groups, as one padded batched matmul:
    ~15 launches for the lot where `run_groups` takes ~9 per expert — what bounds a short prefill chunk, whose
    experts have tens of tokens each, is the host launching work, not the GPU doing it. Each expert's tokens are
    padded to the longest group with a stand-in (row 0, routing weight 0), which adds exactly nothing. Gathers
    the experts' weights (device bandwidth): keep the group's bytes bounded."""
    n = max(len(g.tokens) for g in groups)
    pad = sum(len(g.tokens) for g in groups)  # index of the stand-in pair appended below
    positions, start = [], 0
    for g in groups:
        count = len(g.tokens)
        positions += list(range(start, start + count)) + [pad] * (n - count)
        start += count
    device = hidden.device
    at = host_ints_to(device, positions)
    tokens = torch.cat([g.tokens for g in groups] + [torch.zeros(1, dtype=groups[0].tokens.dtype, device=device)])
    weights = torch.cat([g.weights for g in groups] + [torch.zeros(1, dtype=groups[0].weights.dtype, device=device)])
    tokens, weights = tokens[at].view(len(groups), n), weights[at].view(len(groups), n)
    ids = host_ints_to(device, slots)
    x = hidden[tokens]  # [G, n, H]
    gate, up, down = (w[ids].transpose(1, 2) for w in (experts.gate_proj, experts.up_proj, experts.down_proj))
    ids_of_experts = host_ints_to(device, [g.expert for g in groups]) if form is not None else None
    y = apply_experts(form, x, gate, up, down, ids_of_experts) * weights[:, :, None]  # [G, n, H]
    out.index_add_(0, tokens.view(-1), y.view(-1, y.shape[-1]))


PADDED_MAX_TOKENS = 128  # experts with at most this many tokens each are computed in padded groups (see below)
PADDED_GROUP_BYTES = 256 * 2**20  # gathered weights per padded group


def grouped_expert_forward(experts: LayerExperts, hidden: torch.Tensor, topk_ids: torch.Tensor,
                           topk_weights: torch.Tensor, padded: bool = False) -> torch.Tensor:
    """Groups the (token, expert) pairs by expert and runs each expert once on its tokens. `padded`: where no
    expert has more than PADDED_MAX_TOKENS tokens (batched decode, short chunks), several experts per batched
    matmul (`run_groups_padded`): the launches, not the arithmetic, are then what costs."""
    groups = group_by_expert(topk_ids, topk_weights, experts.num_experts, hidden.dtype)
    if not padded or not groups or max(len(g.tokens) for g in groups) > PADDED_MAX_TOKENS:
        return run_groups(hidden, groups, experts.weights_of, experts.form)
    per_group = max(1, PADDED_GROUP_BYTES // (experts.nbytes() // experts.num_experts))
    out = torch.zeros_like(hidden)
    for i in range(0, len(groups), per_group):
        part = groups[i:i + per_group]
        run_groups_padded(hidden, part, experts, [g.expert for g in part], out, experts.form)
    return out


GROUPED_MM_TOKENS = 8192  # tokens per sorted pass: bounds the [N*K, H] activations a long chunk sorts at once


def grouped_mm_available(hidden: torch.Tensor) -> bool:
    """Whether chunks take `sorted_expert_forward` (GPU path "grouped-mm": a 16k-token layer 12.3 instead of 28 ms
    on the H200), where torch's grouped GEMM has fast kernels: bf16 on Hopper (sm90) and newer. Elsewhere it is a
    loop over groups, no faster than `grouped_expert_forward` (the CPU tests check it against that)."""
    return (hidden.is_cuda and hidden.dtype == torch.bfloat16 and gpu_paths.enabled("grouped-mm")
            and hasattr(torch, "_grouped_mm") and torch.cuda.get_device_capability(hidden.device) >= (9, 0))


def sorted_expert_forward(stacks: LayerExperts, hidden: torch.Tensor, ids: torch.Tensor,
                          topk_weights: torch.Tensor, form: ExpertForm | None = None,
                          expert_ids: torch.Tensor | None = None, row_pairs: list[int] | None = None) -> torch.Tensor:
    """Every (token, k) pair at once through grouped matmuls (torch._grouped_mm), pairs sorted by the stack row
    their id names: ~10 launches per layer and no host synchronisation, where `grouped_expert_forward` launches
    ~9 per expert after a sync (a 16k-token chunk: the GPU busy 57% of the time, elementwise and index_add_ as
    costly as the matmuls). `ids` [N, K] index the stacks' first dimension: experts, or an executor's slots;
    `expert_ids` [N, K]: the experts they hold, for `form`'s biases (default: `ids`, the stacks are experts).
    `row_pairs`: how many pairs name each stack row, where the host knows it: a stack of more rows than one grouped
    call takes is then cut into windows without asking the device (a sync that would wait for all work queued
    before, an offloaded layer's copies included)."""
    n = ids.shape[0]
    form = stacks.form if form is None else form
    expert_ids = ids if expert_ids is None else expert_ids
    if n <= GROUPED_MM_TOKENS:
        return _sorted_pass(stacks, hidden, ids, topk_weights, form, expert_ids, row_pairs)
    step = GROUPED_MM_TOKENS
    return torch.cat([_sorted_pass(stacks, hidden[i:i + step], ids[i:i + step], topk_weights[i:i + step], form,
                                   expert_ids[i:i + step]) for i in range(0, n, step)])


GROUPED_MM_GROUPS = 1023  # torch._grouped_mm takes fewer than 1,024 groups (stack rows) per call


def _sorted_pass(stacks: LayerExperts, hidden: torch.Tensor, ids: torch.Tensor, topk_weights: torch.Tensor,
                 form: ExpertForm | None, expert_ids: torch.Tensor, row_pairs: list[int] | None = None) -> torch.Tensor:
    n, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs grouped by stack row
    rows = stacks.num_experts
    # group g ends after the pairs of rows ≤ g (searchsorted, not bincount's cumsum: bincount syncs with the host to
    # size its output, which CUDA-graph capture of a batched decode step does not allow)
    ends = torch.searchsorted(flat[order], torch.arange(rows, device=flat.device), right=True).to(torch.int32)
    x = hidden[order // k]  # [N*K, H]
    gate, up, down = (w.transpose(1, 2) for w in (stacks.gate_proj, stacks.up_proj, stacks.down_proj))
    biased = None if form is None or form is PLAIN else (form, expert_ids.reshape(-1)[order])
    if rows <= GROUPED_MM_GROUPS:
        y = _grouped_ffn(x, gate, up, down, ends, biased)
    else:  # more rows (an executor's slots) than one call takes: a call per window of rows, whose pairs are a
        # contiguous run of the sorted ones; cutting x there needs the windows' bounds on the host (one sync, unless
        # the caller knows them)
        window_ends = slice(GROUPED_MM_GROUPS - 1, rows - 1, GROUPED_MM_GROUPS)
        if row_pairs is None:
            bounds = ends[window_ends].tolist()
        else:
            bounds = list(itertools.accumulate(row_pairs))[window_ends]
        cuts = [0, *bounds, n * k]
        y = torch.empty_like(x)
        for w, (lo, hi) in enumerate(itertools.pairwise(cuts)):
            if hi > lo:
                rows_w = slice(w * GROUPED_MM_GROUPS, (w + 1) * GROUPED_MM_GROUPS)
                part = None if biased is None else (form, biased[1][lo:hi])
                y[lo:hi] = _grouped_ffn(x[lo:hi], gate[rows_w], up[rows_w], down[rows_w], ends[rows_w] - lo, part)
    y = y * topk_weights.reshape(-1)[order].to(hidden.dtype)[:, None]
    pairs = torch.empty_like(y).index_copy_(0, order, y)  # back in (token, k) order: a permutation, no atomics
    return pairs.view(n, k, -1).sum(dim=1)


def _grouped_ffn(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                 ends: torch.Tensor, biased: tuple[ExpertForm, torch.Tensor] | None = None) -> torch.Tensor:
    """SwiGLU of rows sorted by group, group g's rows ending at ends[g] (weights [G, in, out]). `biased`: a form
    and the expert id of each row, for families that are not plain SwiGLU."""
    g, u = torch._grouped_mm(x, gate, offs=ends), torch._grouped_mm(x, up, offs=ends)  # [rows, I]
    if biased is None:
        return torch._grouped_mm(F.silu(g) * u, down, offs=ends)
    form, experts = biased
    if form.gate_bias is not None:
        g, u = g + form.gate_bias[experts].to(g.dtype), u + form.up_bias[experts].to(u.dtype)
    y = torch._grouped_mm(form.activate(g, u), down, offs=ends)
    return y + form.down_bias[experts].to(y.dtype) if form.down_bias is not None else y


def gathered_expert_forward(experts: LayerExperts, hidden: torch.Tensor, topk_ids: torch.Tensor,
                            topk_weights: torch.Tensor, form: ExpertForm | None = None,
                            expert_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Runs every (token, expert) pair as one batched matmul over gathered weights: no host synchronisation,
    so it can be captured in a CUDA graph. Copies K experts' weights per token: meant for decode (small N).
    `topk_ids` index the stacks (experts, or an executor's slots); `expert_ids`: the experts they hold, for
    `form`'s biases (default: `topk_ids`)."""
    n, k = topk_ids.shape
    ids = topk_ids.reshape(-1)
    x = hidden.repeat_interleave(k, dim=0)[:, :, None]  # [N*K, H, 1]
    form = experts.form if form is None else form
    if form is None or form is PLAIN:
        h = F.silu(torch.bmm(experts.gate_proj[ids], x)) * torch.bmm(experts.up_proj[ids], x)  # [N*K, I, 1]
        y = torch.bmm(experts.down_proj[ids], h)[:, :, 0]  # [N*K, H]
    else:
        owners = ids if expert_ids is None else expert_ids.reshape(-1)
        g, u = torch.bmm(experts.gate_proj[ids], x)[:, :, 0], torch.bmm(experts.up_proj[ids], x)[:, :, 0]
        if form.gate_bias is not None:
            g, u = g + form.gate_bias[owners].to(g.dtype), u + form.up_bias[owners].to(u.dtype)
        y = torch.bmm(experts.down_proj[ids], form.activate(g, u)[:, :, None])[:, :, 0]
        if form.down_bias is not None:
            y = y + form.down_bias[owners].to(y.dtype)
    return (y * topk_weights.reshape(-1, 1).to(y.dtype)).view(n, k, -1).sum(dim=1)


class ResidentExpertExecutor:
    """All routed experts resident on one device (the model's)."""

    capturable = True  # has a sync-free path, so decode steps can be captured in CUDA graphs
    GATHER_PAIRS = 16  # up to this many (token, expert) pairs, gathering beats grouping (no sync, few launches)
    # On the CPU, up to this many pairs go through the native expert kernel (memory-bound GEMV, 2-3x torch);
    # longer batches are matrix products, where torch's GEMM wins.
    CPU_KERNEL_PAIRS = 64

    def __init__(self, layers: dict[int, LayerExperts]):
        self.layers = layers
        self._cpu: tuple | None = None  # (kernel, {layer: matrices}, {layer: form}) once looked up; kernel None
        # when unavailable

    def forward(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        if hidden.is_cuda:
            capturing = torch.cuda.is_current_stream_capturing()
            # a captured batched step of many pairs takes the grouped matmuls (sync-free for up to 1,023 experts)
            # where they are fast: gathering copies every pair's weights
            grouped = grouped_mm_available(hidden) and \
                (not capturing or self.layers[layer].num_experts <= GROUPED_MM_GROUPS)
            if topk_ids.numel() <= self.GATHER_PAIRS or (capturing and not grouped):
                return gathered_expert_forward(self.layers[layer], hidden, topk_ids, topk_weights)
            if grouped:
                return sorted_expert_forward(self.layers[layer], hidden, topk_ids, topk_weights)  # reads the form
        if hidden.device.type == "cpu" and topk_ids.numel() <= self.CPU_KERNEL_PAIRS:
            kernel, matrices, forms = self._cpu_kernel()
            if kernel is not None:
                from freetoken.engine.offload.cpu_experts import kernel_expert_forward

                return kernel_expert_forward(kernel, matrices[layer], hidden, topk_ids, topk_weights, forms[layer])
        return grouped_expert_forward(self.layers[layer], hidden, topk_ids, topk_weights, padded=hidden.is_cuda)

    def _cpu_kernel(self):
        if self._cpu is None:
            from freetoken.engine.offload.cpu_experts import expert_matrices
            from freetoken.kernels.cpu_experts.kernel import CpuExpertKernel, kernel_form

            kernel = CpuExpertKernel.get()
            matrices = {layer: expert_matrices(le) for layer, le in self.layers.items()}
            if kernel is None or not all(kernel.supports(*m) for m in matrices.values()):
                kernel = None
            self._cpu = (kernel, matrices, {layer: kernel_form(le.form) for layer, le in self.layers.items()})
        return self._cpu

    def nbytes(self) -> int:
        return sum(le.nbytes() for le in self.layers.values())
