"""The CPU expert kernel behind the same `moe_forward` signature as `reference.py`.

`CpuExpertKernel.get()` builds and loads the C library once per process (see `build.py`) and starts its thread
pool; it returns None where the library cannot be built, and callers fall back to the reference. Calls are
serialised: the pool runs one layer at a time, and ctypes releases the GIL, so a Python thread can run it while
the main thread drives the GPU.
"""

from __future__ import annotations

import ctypes
import os
import threading
from dataclasses import replace
from typing import ClassVar

import torch

from freetoken.kernels.cpu_experts import build
from freetoken.kernels.cpu_experts.reference import KERNEL_FORMATS, ExpertForm, ExpertMatrix

_TYPE_CODES = {"F32": 0, "BF16": 1, "Q8_0": 2, "MXFP4": 3, "FP8_B32": 4}


def default_threads() -> int:
    """FREETOKEN_CPU_THREADS, else every core this process may run on."""
    if value := os.environ.get("FREETOKEN_CPU_THREADS"):
        return max(1, int(value))
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def kernel_form(form: ExpertForm | None) -> ExpertForm | None:
    """`form` with its biases as the kernel reads them (contiguous fp32 on the CPU), None for plain SwiGLU.
    Callers that launch often convert once and pass the result to `launch`."""
    if form is None or form.is_plain:
        return None
    if (form.gate_bias is None) != (form.up_bias is None):
        raise ValueError("the CPU expert kernel takes gate and up biases together")
    biases = (form.gate_bias, form.up_bias, form.down_bias)
    if all(t is None or (t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()) for t in biases):
        return form
    host = form.to("cpu", torch.float32)
    return replace(host, **{name: None if t is None else t.contiguous()
                            for name, t in (("gate_bias", host.gate_bias), ("up_bias", host.up_bias),
                                            ("down_bias", host.down_bias))})


def _form_args(form: ExpertForm | None) -> tuple:
    if form is None:
        return None, None, None, 0, 1.0, 0.0
    ptr = [None if t is None else t.data_ptr() for t in (form.gate_bias, form.up_bias, form.down_bias)]
    # the activation as the kernel numbers it: 0 SwiGLU, 1 gpt-oss's clamped form, 2 V4's clamped SwiGLU
    activation = 1 if form.clamped else 2 if form.clamp_silu else 0
    return (*ptr, activation, float(form.alpha), float(form.limit))


def _default_build_dir():
    from freetoken.engine.sources import cache_dir  # lazy: kernels do not need the engine otherwise
    return cache_dir() / "kernels"


class PendingExperts:
    """A started `moe_forward`; `wait()` joins the workers and returns y [T, H] fp32. `seconds` is then the
    job's compute time, from posting to its last task, whatever the caller did meanwhile."""

    def __init__(self, kernel: CpuExpertKernel, y: torch.Tensor, keep_alive: tuple):
        self._kernel, self._y, self._keep_alive = kernel, y, keep_alive
        self.seconds = 0.0

    def wait(self) -> torch.Tensor:
        if self._keep_alive is not None:
            self.seconds = self._kernel.lib.ft_moe_wait()
            self._keep_alive = None
            self._kernel._call_lock.release()
        return self._y


class CpuExpertKernel:
    _instance: ClassVar[CpuExpertKernel | None] = None
    _tried: ClassVar[bool] = False
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, lib, threads: int):
        self.lib = lib
        self.threads = lib.ft_pool_start(threads)
        self.bf16_dot = bool(lib.ft_has_bf16_dot())  # AVX-512-BF16: bf16 x bf16 products when the model is bf16
        q16 = lib.ft_has_q16()  # Q8_0 / MXFP4 rows against int16 activations (decode): AVX2, or AVX-512BW too
        self.q16, self.q16_sixteen_lanes = q16 > 0, q16 == 2
        self.amx = bool(lib.ft_has_amx())  # AMX tiles for bf16 experts at 2-16 tokens per expert
        self.amx_q8 = lib.ft_has_amx_q8()  # int8 tiles for Q8_0 experts at 2-32: 1 real, 2 emulated (tests)
        if os.environ.get("FREETOKEN_CPU_AMX") == "0":
            lib.ft_set_amx(2, 6, 1)
            lib.ft_set_amx_q8(2, 0)
        self._call_lock = threading.Lock()

    @classmethod
    def get(cls, build_dir=None, threads: int | None = None) -> CpuExpertKernel | None:
        """The process-wide kernel; the first call's `threads` (default: every core) sizes its pool."""
        with cls._lock:
            if not cls._tried:
                cls._tried = True
                lib = build.load(build_dir or _default_build_dir())
                cls._instance = cls(lib, threads or default_threads()) if lib is not None else None
            return cls._instance

    @staticmethod
    def supports(*matrices: ExpertMatrix) -> bool:
        return all(m.format in KERNEL_FORMATS and m.data.is_contiguous() and m.data.device.type == "cpu"
                   for m in matrices)

    def moe_forward(self, x: torch.Tensor, gate: ExpertMatrix, up: ExpertMatrix, down: ExpertMatrix,
                    experts: torch.Tensor, pair_offsets: torch.Tensor, pair_tokens: torch.Tensor,
                    pair_weights: torch.Tensor, round_to: torch.dtype = torch.float32,
                    form: ExpertForm | None = None) -> torch.Tensor:
        """Same contract as `reference.moe_forward`; index tensors int32, weights and x fp32, all on the CPU.
        `round_to=torch.bfloat16` rounds where a bf16 GPU expert rounds (projection outputs, silu, products),
        so offloaded results track the resident ones more closely."""
        return self.start(x, gate, up, down, experts, pair_offsets, pair_tokens, pair_weights, round_to,
                          form=form).wait()

    def start(self, x: torch.Tensor, gate: ExpertMatrix, up: ExpertMatrix, down: ExpertMatrix,
              experts: torch.Tensor, pair_offsets: torch.Tensor, pair_tokens: torch.Tensor,
              pair_weights: torch.Tensor, round_to: torch.dtype = torch.float32, *,
              x_bf16: torch.Tensor | None = None, out: torch.Tensor | None = None,
              form: ExpertForm | None = None) -> PendingExperts:
        """`moe_forward` started on the pool's workers; returns at once. Call `.wait()` for the result; until
        then no other call may use the kernel (the lock is held). `x_bf16`: x in bf16, from a caller that knows x
        holds bf16 values exactly (a bf16 model's activations; skips checking it). `out`: a [T, H] fp32 buffer
        for the result (pinned memory, to copy it to the GPU)."""
        if not self.supports(gate, up, down):
            raise ValueError("the CPU expert kernel reads contiguous host F32/BF16/Q8_0/MXFP4/FP8_B32 stacks only")
        t, h = x.shape
        inter = gate.shape[0]
        x = x.float().contiguous()
        experts, pair_offsets, pair_tokens = (a.to(torch.int32).contiguous()
                                              for a in (experts, pair_offsets, pair_tokens))
        pair_weights = pair_weights.float().contiguous()
        act = torch.empty(pair_tokens.numel(), inter, dtype=torch.float32)
        y = torch.empty(t, h, dtype=torch.float32) if out is None else out
        if y.shape != (t, h) or y.dtype != torch.float32 or not y.is_contiguous():
            raise ValueError(f"out must be a contiguous fp32 [{t}, {h}] tensor")
        xb = actb = None
        if self.wants_bf16_activations(gate, up, down, round_to):
            xb = x_bf16.contiguous() if x_bf16 is not None else self.bf16_if_exact(x)
            if xb is not None:
                actb = torch.empty(pair_tokens.numel(), inter, dtype=torch.bfloat16)
        return self.launch(x, gate, up, down, experts, experts.numel(), pair_offsets, pair_tokens, pair_weights,
                           act, y, round_to, xb, actb, kernel_form(form))

    def bf16_if_exact(self, x: torch.Tensor) -> torch.Tensor | None:
        """x (contiguous fp32, host) in bf16 when it holds bf16 values exactly (a bf16 model's activations), else
        None (rounded values would change the result). In C on this thread: torch's conversion and comparison of
        more than 32k values run on its OpenMP pool, which then spins on the cores this kernel's workers need."""
        xb = torch.empty(x.shape, dtype=torch.bfloat16)
        return xb if self.lib.ft_to_bf16_exact(x.data_ptr(), xb.data_ptr(), x.numel()) else None

    def wants_bf16_activations(self, gate: ExpertMatrix, up: ExpertMatrix, down: ExpertMatrix,
                               round_to: torch.dtype) -> bool:
        """Whether a bf16 model's call also takes x in bf16: for the bf16 dot path (bf16 weights) and the AMX
        path (bf16 or Q8_0 weights)."""
        return self.bf16_dot and round_to == torch.bfloat16 and all(m.format != "F32" for m in (gate, up, down))

    @staticmethod
    def launch_constants(gate: ExpertMatrix, up: ExpertMatrix, down: ExpertMatrix,
                         form: ExpertForm | None = None) -> tuple:
        """The arguments of `launch` that depend only on a layer's matrices and form: a caller that launches the
        same layer often computes them once (the decode step's host thread pays ~10 µs for them otherwise)."""
        matrices = (gate, up, down)
        return ((*(m.data.data_ptr() for m in matrices), *(m.data.stride(0) * m.data.element_size() for m in matrices),
                 *(_TYPE_CODES[m.format] for m in matrices)), _form_args(form), gate.shape[0])

    def launch(self, x: torch.Tensor, gate: ExpertMatrix, up: ExpertMatrix, down: ExpertMatrix,
               experts: torch.Tensor, n_experts: int, pair_offsets: torch.Tensor, pair_tokens: torch.Tensor,
               pair_weights: torch.Tensor, act: torch.Tensor, y: torch.Tensor, round_to: torch.dtype,
               x_bf16: torch.Tensor | None, act_bf16: torch.Tensor | None,
               form: ExpertForm | None = None, constants: tuple | None = None) -> PendingExperts:
        """`start` without checks or conversions, for callers that keep their own buffers (the decode hot path):
        every tensor contiguous on the CPU in the kernel's dtypes (int32 indices, fp32 x/weights/act/y, bf16
        x_bf16/act_bf16 or None; `form` as `kernel_form` returns it), the first `n_experts` entries of
        `experts` used, act [pairs, I], y [T, H]. `constants`: `launch_constants` of these matrices and form."""
        t, h = x.shape
        matrices, form_args, inter = constants or self.launch_constants(gate, up, down, form)
        self._call_lock.acquire()
        rc = self.lib.ft_moe_start(
            *matrices, experts.data_ptr(), n_experts, pair_offsets.data_ptr(), pair_tokens.data_ptr(),
            pair_weights.data_ptr(), x.data_ptr(), act.data_ptr(), y.data_ptr(), t, h, inter,
            int(round_to == torch.bfloat16), None if x_bf16 is None else x_bf16.data_ptr(),
            None if act_bf16 is None else act_bf16.data_ptr(), *form_args)
        if rc != 0:
            self._call_lock.release()
            raise ValueError(f"CPU expert kernel rejected the shapes (hidden {h}, intermediate {inter})")
        # every buffer the workers read or write stays referenced until wait()
        return PendingExperts(self, y, (x, experts, pair_offsets, pair_tokens, pair_weights, act, x_bf16, act_bf16,
                                        form))

    def timing(self) -> tuple[int, float, float, float]:
        """Sums over the jobs waited for so far: (jobs, seconds from posting to the first task's start, to the
        last gate/up task's end, to the job's end). Differences of two calls describe the jobs between them."""
        out = (ctypes.c_double * 4)()
        self.lib.ft_moe_timing(out)
        return int(out[0]), out[1], out[2], out[3]

    def wake(self, spin_s: float) -> None:
        """Wakes sleeping workers to spin up to `spin_s` for a call about to come, so that their wake-up (tens of
        µs of system calls) overlaps the caller's wait instead of delaying the call. Nothing when none sleeps."""
        self.lib.ft_pool_wake(int(spin_s * 1e9))

    def set_tree_wake(self, on: bool) -> bool:
        """Sleeping workers woken as a binary tree (each woken worker wakes two more; the caller only the first
        two) instead of all by the caller. Returns whether it is on: never off Linux."""
        return bool(self.lib.ft_pool_set_tree_wake(int(on)))

    def set_caller_joins(self, joins: bool) -> bool:
        """Whether the thread that waits for a call runs its tasks too (default) or only waits (where the pool has
        workers; with none it always runs them). Returns the setting it replaces."""
        return bool(self.lib.ft_pool_set_caller_joins(int(joins)))

    def set_join(self, by_tasks: bool) -> bool:
        """A call ends with its last task (default), or (False, for measuring) only once every worker has also
        looked for tasks in it, so that a worker the OS has descheduled delays it. Returns whether by tasks."""
        return bool(self.lib.ft_pool_set_join(int(by_tasks)))

    def random_fill(self, t: torch.Tensor, seed: int, bound: float | None = None) -> None:
        """Seeded random bytes into a contiguous CPU tensor (`bound` None), or values uniform in [-bound, bound)
        into an f32/bf16 one, on all pool threads (freetoken/bench/random_fill.py is the torch form)."""
        kind = -1 if bound is None else {torch.float32: 0, torch.bfloat16: 1}[t.dtype]
        n = t.numel() * t.element_size() if bound is None else t.numel()
        with self._call_lock:
            self.lib.ft_random_fill(t.data_ptr(), n, seed % (1 << 64), kind, 0.0 if bound is None else bound)

    def warm(self, regions: list[tuple[int, int]]) -> bool:
        """Starts reading (address, bytes) regions into the workers' caches and returns at once: weights a job is
        about to compute from, read while the caller waits anyway. The next job cancels what is left. Skipped
        (False) while a job runs or where the pool has no workers; at most 64 regions are taken."""
        if not regions or not self._call_lock.acquire(blocking=False):
            return False
        try:
            n = len(regions)  # the kernel takes the first 64
            ptrs = (ctypes.c_void_p * n)(*(a for a, _ in regions))
            sizes = (ctypes.c_int64 * n)(*(b for _, b in regions))
            return self.lib.ft_warm(ptrs, sizes, n) > 0
        finally:
            self._call_lock.release()

    def warm_rows(self, constants: tuple, experts: torch.Tensor, hidden: int) -> bool:
        """`warm` in owned form: starts reading the rows a one-token call on `experts` (int32, the first 64 taken)
        will read, each by the worker that will compute it there once `set_owned_rows(True)` is on. `constants`:
        the layer's `launch_constants`. Skipped (False) as `warm` is."""
        if not len(experts) or not self._call_lock.acquire(blocking=False):
            return False
        try:
            matrices, _, inter = constants
            return self.lib.ft_warm_rows(*matrices, experts.data_ptr(), len(experts), hidden, inter) > 0
        finally:
            self._call_lock.release()

    def set_owned_rows(self, on: bool) -> bool:
        """Calls on the vector paths give each worker the same share of every expert's rows (on), the share
        `warm_rows` reads into that worker's caches, or claim their tasks in order (off, default). Returns the
        setting it replaces."""
        with self._call_lock:
            return bool(self.lib.ft_set_owned_rows(int(on)))

    def read_bytes(self, buf: torch.Tensor) -> int:
        """Reads every byte of `buf` once on all pool threads (the DRAM read-bandwidth probe)."""
        with self._call_lock:
            return self.lib.ft_read_bytes(buf.data_ptr(), buf.numel() * buf.element_size())
