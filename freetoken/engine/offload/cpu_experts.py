"""Missed experts computed on the CPU, where their weights live; only activations cross the link.

`CpuExpertRunner.start_pairs` (decode) starts the native kernel on its own threads and returns at once;
`submit` (larger batches) hands a layer's groups to a Python worker thread. Either way the calling thread keeps
the GPU busy meanwhile. Without a C compiler the runner falls back to torch on the host weights (slower, same
function). `kernel_expert_forward` serves CPU-resident experts (no GPU) through the same kernel.

Shapes: T tokens, H hidden, P (token, expert) pairs.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from freetoken.engine import gpu_paths
from freetoken.engine.experts import ExpertGroup, LayerExperts, run_groups
from freetoken.engine.offload.quantized import PROJECTIONS, QuantizedExperts
from freetoken.kernels.cpu_experts.kernel import CpuExpertKernel, default_threads, kernel_form
from freetoken.kernels.cpu_experts.reference import ExpertMatrix


class _Started:
    def __init__(self, finish):
        self.wait = finish


class _Workspace:
    """Preallocated kernel inputs for decode-sized calls (up to `pairs` pairs): filling numpy views of them
    costs the host thread, the decode step's critical path, a few µs instead of a dozen tensor constructions.
    One call at a time uses it (the kernel's own lock serialises calls)."""

    def __init__(self, num_experts: int, pairs: int, inter: int):
        self.pairs = pairs
        self.experts = torch.empty(num_experts, dtype=torch.int32)
        self.offsets = torch.empty(num_experts + 1, dtype=torch.int32)
        self.tokens = torch.empty(pairs, dtype=torch.int32)
        self.weights = torch.empty(pairs, dtype=torch.float32)
        self.act = torch.empty(pairs, inter, dtype=torch.float32)
        self.act_bf16 = torch.empty(pairs, inter, dtype=torch.bfloat16)
        self.experts_np, self.offsets_np = self.experts.numpy(), self.offsets.numpy()
        self.tokens_np, self.weights_np = self.tokens.numpy(), self.weights.numpy()


# torch runs a host op over more values than this (its grain size) on its OpenMP pool, whose threads then spin for
# milliseconds on the cores the CPU expert kernel's workers need (cpu-kernel-prefill-batches-h200.md)
HOST_OP_MAX_VALUES = 32768


def gpu_host_kernel() -> CpuExpertKernel | None:
    """The CPU expert kernel of a process that drives a GPU. By default one core is left to the thread that drives
    it, and that thread also runs the kernel's tasks while it waits for a CPU share (it is the kernel's caller).
    GPU path "cpu-caller-waits": a worker more instead, and the driving thread only waits, so the weights it would
    stream do not push out of its caches the host work of the next layer-step, which is decode's critical path."""
    waits = gpu_paths.enabled("cpu-caller-waits")
    kernel = CpuExpertKernel.get(threads=max(1, default_threads() - (0 if waits else 1)))
    if kernel is not None:
        kernel.set_caller_joins(not waits)
    return kernel


def to_host_fp32(t: torch.Tensor) -> torch.Tensor:
    """`t` as fp32 on the host, converted where it is: a blocking device-to-host copy that changes the dtype
    converts on the host (torch's rule), which for a prefill chunk's activations wakes torch's OpenMP pool."""
    return t.float().to("cpu")  # a no-op where t is fp32 on the host already


def routed_pairs(topk_ids: torch.Tensor, topk_weights: torch.Tensor):
    """(experts, pair_offsets, pair_tokens, pair_weights) of a [N, K] routing, grouped by expert, all on the CPU:
    the kernel's input format."""
    k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    offsets = torch.zeros(len(counts) + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=offsets[1:])
    return experts, offsets, order // k, topk_weights.reshape(-1)[order].float()


def kernel_expert_forward(kernel: CpuExpertKernel, matrices: tuple[ExpertMatrix, ...], hidden: torch.Tensor,
                          topk_ids: torch.Tensor, topk_weights: torch.Tensor, form=None) -> torch.Tensor:
    """Routed experts of CPU-resident weights through the native kernel (decode-sized batches): same contract as
    `ExpertExecutor.forward`, in the hidden state's dtype."""
    y = kernel.moe_forward(hidden.float(), *matrices, *routed_pairs(topk_ids, topk_weights), round_to=hidden.dtype,
                           form=form)
    return y.to(hidden.dtype)


def expert_matrices(layer: LayerExperts | QuantizedExperts) -> tuple[ExpertMatrix, ...]:
    if isinstance(layer, QuantizedExperts):
        return tuple(ExpertMatrix(layer.raw[p], layer.type_names[p], layer.shapes[p]) for p in PROJECTIONS)
    return tuple(ExpertMatrix.of(getattr(layer, p)) for p in PROJECTIONS)


class CpuExpertRunner:
    def __init__(self, host: dict[int, LayerExperts | QuantizedExperts], dtype: torch.dtype, share_cores: bool):
        """`share_cores`: a process that drives a GPU (`gpu_host_kernel`)."""
        self.host, self.dtype = host, dtype
        self.kernel = gpu_host_kernel() if share_cores else CpuExpertKernel.get()
        self.matrices = {layer: expert_matrices(le) for layer, le in host.items()}
        # each layer's biases and activation where not plain SwiGLU, converted once for the kernel (fp32, host)
        self.forms = {layer: kernel_form(le.form) for layer, le in host.items()}
        self._kernel_layers = {layer for layer, m in self.matrices.items()
                               if self.kernel is not None and self.kernel.supports(*m)}
        # per kernel layer: the launch arguments fixed by its weights, and whether it takes bf16 activations
        self._launch_constants = {layer: self.kernel.launch_constants(*self.matrices[layer], self.forms[layer])
                                  for layer in self._kernel_layers}
        self._wants_bf16 = {layer: self.kernel.wants_bf16_activations(*self.matrices[layer], dtype)
                            for layer in self._kernel_layers}
        first = next(iter(self.matrices.values()))
        self._workspace = _Workspace(first[0].data.shape[0], 64, first[0].shape[0]) if self._kernel_layers else None
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ft-cpu-experts")
        # the kernel's pool wakes its workers as a tree (GPU path "cpu-tree-wake"); set at the first launch (the
        # kernel is the process's, another runner may have set it)
        self._tree_wake: bool | None = None
        self._owned_rows: bool | None = None  # GPU path "cpu-warm-owned", set at the first warming
        self._hidden = {layer: m[0].shape[1] for layer, m in self.matrices.items()}

    def wake(self, spin_s: float) -> None:
        """Before waiting for a layer's routing: the kernel's sleeping workers wake meanwhile (see its `wake`)."""
        if self.kernel is not None:
            self.kernel.wake(spin_s)

    WARM_BYTES = 32 << 20  # read ahead at most this much: about what the workers' L2 caches hold on a 16-core host

    def warm(self, layer: int, experts: list[int]) -> bool:
        """Starts reading `experts`' weights of `layer` into the kernel's caches (GPU path "cpu-warm": while the
        host waits for the routing of a layer whose predicted experts will likely run here), up to WARM_BYTES.
        GPU path "cpu-warm-owned": each worker reads the rows it will compute (the kernel's owned rows, on for
        every call then). Returns whether it started; the kernel's next job cancels what is left."""
        if self.kernel is None or layer not in self._kernel_layers or not experts:
            return False
        if (owned := gpu_paths.enabled("cpu-warm-owned")) is not self._owned_rows:
            self._owned_rows = owned
            self.kernel.set_owned_rows(owned)
        if owned:
            constants = self._launch_constants[layer]
            per_expert = sum(m.data.stride(0) * m.data.element_size() for m in self.matrices[layer])
            take = experts[:max(1, self.WARM_BYTES // per_expert)]
            return self.kernel.warm_rows(constants, torch.tensor(take, dtype=torch.int32), self._hidden[layer])
        regions, left = [], self.WARM_BYTES
        for m in self.matrices[layer]:  # gate, up, down: the order the job reads them in
            row = m.data.stride(0) * m.data.element_size()
            for e in experts:
                if left <= 0:
                    break
                regions.append((m.data.data_ptr() + e * row, min(row, left)))
                left -= row
        return self.kernel.warm(regions)

    @property
    def uses_kernel(self) -> bool:
        return self.kernel is not None and all(self.kernel.supports(*m) for m in self.matrices.values())

    def submit(self, layer: int, hidden: torch.Tensor, groups: list[ExpertGroup]) -> Future:
        """Future of (out [T, H] fp32 on the CPU, seconds the CPU spent)."""
        x = to_host_fp32(hidden)  # waits for the GPU to produce this layer's input
        cpu_groups = [ExpertGroup(g.expert, g.tokens.cpu(), g.weights.cpu()) for g in groups]
        return self._worker.submit(self._run, layer, x, cpu_groups)

    def start_pairs(self, layer: int, x: torch.Tensor, experts: list[int], pairs: list[list[tuple[int, int]]],
                    weights: list[list[float]], *, x_bf16: torch.Tensor | None = None,
                    out: torch.Tensor | None = None):
        """Starts experts[i] on the (token, k) pairs[i], weighted by weights[token][k], and returns at once with
        an object whose `wait()` gives (y [T, H] fp32, compute seconds). x [T, H] fp32 on the CPU; `x_bf16` the
        same values in bf16 when the model is bf16 (spares the kernel a check); `out` a buffer for y (the
        kernel writes it there; the fallback returns its own). Without the fast kernel the work happens inside
        `wait()`."""
        gate, up, down = self.matrices[layer]
        if self.kernel is not None and layer in self._kernel_layers:
            if (tree := gpu_paths.enabled("cpu-tree-wake")) is not self._tree_wake:
                self._tree_wake = tree
                self.kernel.set_tree_wake(tree)
            pending = self._launch(layer, x, experts, pairs, weights, x_bf16, out)
            if pending is not None:
                return _Started(lambda: (pending.wait(), pending.seconds))
            offsets, tokens, pair_weights = [0], [], []
            for p in pairs:
                for t, k in p:
                    tokens.append(t)
                    pair_weights.append(weights[t][k])
                offsets.append(len(tokens))
            pending = self.kernel.start(
                x, gate, up, down, torch.tensor(experts, dtype=torch.int32), torch.tensor(offsets, dtype=torch.int32),
                torch.tensor(tokens, dtype=torch.int32), torch.tensor(pair_weights, dtype=torch.float32),
                round_to=self.dtype, x_bf16=x_bf16 if self.dtype == torch.bfloat16 else None, out=out,
                form=self.forms[layer])
            return _Started(lambda: (pending.wait(), pending.seconds))
        groups = [ExpertGroup(e, torch.tensor([t for t, _ in p]), torch.tensor([weights[t][k] for t, k in p]))
                  for e, p in zip(experts, pairs, strict=True)]
        return _Started(lambda: self._run(layer, x, groups))

    def _launch(self, layer: int, x: torch.Tensor, experts: list[int], pairs: list[list[tuple[int, int]]],
                weights: list[list[float]], x_bf16: torch.Tensor | None, out: torch.Tensor | None):
        """The kernel started from the workspace, or None when the call does not fit it."""
        ws, kernel = self._workspace, self.kernel
        wants_bf16 = self._wants_bf16[layer]
        if (wants_bf16 and x_bf16 is None) or x.dtype != torch.float32 or not x.is_contiguous():
            return None
        ws.experts_np[:len(experts)] = experts
        offsets, tokens_np, weights_np = ws.offsets_np, ws.tokens_np, ws.weights_np
        offsets[0] = pos = 0
        for i, p in enumerate(pairs):
            if pos + len(p) > ws.pairs:
                return None
            for t, k in p:
                tokens_np[pos], weights_np[pos] = t, weights[t][k]
                pos += 1
            offsets[i + 1] = pos
        y = out if out is not None else torch.empty(x.shape, dtype=torch.float32)
        return kernel.launch(x, None, None, None, ws.experts, len(experts), ws.offsets, ws.tokens, ws.weights,
                             ws.act, y, self.dtype, x_bf16 if wants_bf16 else None,
                             ws.act_bf16 if wants_bf16 else None, self.forms[layer], self._launch_constants[layer])

    def _run(self, layer: int, x: torch.Tensor, groups: list[ExpertGroup]) -> tuple[torch.Tensor, float]:
        t0 = time.perf_counter()
        gate, up, down = self.matrices[layer]
        if self.kernel is not None and self.kernel.supports(gate, up, down):
            experts = torch.tensor([g.expert for g in groups], dtype=torch.int32)
            counts = torch.tensor([0] + [len(g.tokens) for g in groups])
            y = self.kernel.moe_forward(x, gate, up, down, experts, counts.cumsum(0).to(torch.int32),
                                        torch.cat([g.tokens for g in groups]),
                                        torch.cat([g.weights for g in groups]),
                                        round_to=self.dtype, form=self.forms[layer])
        else:
            host = self.host[layer]
            weights_of = host.weights_of if isinstance(host, LayerExperts) else \
                (lambda e: host.weights_of(e, self.dtype))
            form = self.host[layer].form
            y = run_groups(x.to(self.dtype), groups, weights_of, None if form is None else form.to("cpu")).float()
        return y, time.perf_counter() - t0
