"""The CPU expert kernel computes the reference's function on random inputs, for every format it reads."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from freetoken.kernels.cpu_experts import build, reference
from freetoken.kernels.cpu_experts.reference import ExpertMatrix
from support.cpu_kernel import NEVER, block_bf16_from, expert_matrix, random_routing


@pytest.mark.parametrize("formats", [("F32",) * 3, ("BF16",) * 3, ("Q8_0",) * 3, ("MXFP4",) * 3, ("FP8_B32",) * 3,
                                     ("Q8_0", "BF16", "F32"), ("MXFP4", "MXFP4", "BF16")])
@pytest.mark.parametrize("tokens", [1, 3, 8, 11])
@pytest.mark.parametrize("round_to", [torch.float32, torch.bfloat16])
def test_kernel_matches_the_reference(kernel, formats, tokens, round_to):
    gen = torch.Generator().manual_seed(tokens * 7 + len(set(formats)))
    hidden, inter, experts = 96, 64, 6
    gate, up = (expert_matrix(f, experts, inter, hidden, gen) for f in formats[:2])
    down = expert_matrix(formats[2], experts, hidden, inter, gen)
    x = torch.randn(tokens + 1, hidden, generator=gen)  # the last token is routed nowhere
    routing = random_routing(tokens, experts, 2, gen)
    want = reference.moe_forward(x, gate, up, down, *routing, round_to=round_to)
    got = kernel.moe_forward(x, gate, up, down, *routing, round_to=round_to)
    assert torch.isfinite(got).all() and torch.equal(got[-1], torch.zeros(hidden))
    tol = 1e-5 if round_to == torch.float32 else 2e-2  # bf16 rounding points can land on either side of a tie
    assert (got - want).norm() / want.norm() < tol
    assert torch.equal(got, kernel.moe_forward(x, gate, up, down, *routing, round_to=round_to))  # deterministic


@pytest.mark.parametrize("tokens", [1, 6])
@pytest.mark.parametrize("hidden", [96, 80])
def test_bf16_activations_take_the_bf16_dot_path_and_match(kernel, tokens, hidden):
    """A bf16 model's activations are bf16 values: with AVX-512-BF16 the kernel multiplies bf16 by bf16 (exact
    products, fp32 sums), which must agree with the reference's bf16 rounding points."""
    gen = torch.Generator().manual_seed(tokens + hidden)
    gate, up = (expert_matrix("BF16", 5, 64, hidden, gen) for _ in range(2))
    down = expert_matrix("BF16", 5, hidden, 64, gen)
    x = torch.randn(tokens, hidden, generator=gen).bfloat16().float()
    routing = random_routing(tokens, 5, 2, gen)
    want = reference.moe_forward(x, gate, up, down, *routing, round_to=torch.bfloat16)
    got = kernel.moe_forward(x, gate, up, down, *routing, round_to=torch.bfloat16)
    assert (got - want).norm() / want.norm() < 2e-2
    pending = kernel.start(x, gate, up, down, *routing, round_to=torch.bfloat16)
    uses_bf16_dot = pending._keep_alive[7] is not None  # act_bf16
    pending.wait()
    assert uses_bf16_dot == kernel.bf16_dot


def test_activations_go_to_bf16_only_when_they_are_bf16_values(kernel):
    """The kernel's own conversion (in C, off torch's thread pool) keeps exact values and refuses rounded ones:
    an fp32 model's activations with round_to bf16 take the fp32 path, as the reference does."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(40, 2048, generator=gen).bfloat16().float()  # 80k values: past torch's 32k parallel grain
    xb = kernel.bf16_if_exact(x)
    assert xb is not None and xb.dtype == torch.bfloat16 and torch.equal(xb.float(), x)
    x[17, 5] += 2.0 ** -12 * abs(float(x[17, 5]))  # one value off the bf16 grid
    assert kernel.bf16_if_exact(x) is None
    gate, up = (expert_matrix("BF16", 5, 64, 96, gen) for _ in range(2))
    down = expert_matrix("BF16", 5, 96, 64, gen)
    x = torch.randn(3, 96, generator=gen)
    routing = random_routing(3, 5, 2, gen)
    pending = kernel.start(x, gate, up, down, *routing, round_to=torch.bfloat16)
    assert pending._keep_alive[7] is None  # no act_bf16: the fp32 path
    want = reference.moe_forward(x, gate, up, down, *routing, round_to=torch.bfloat16)
    assert (pending.wait() - want).norm() / want.norm() < 2e-2


def _form_case(formats, tokens: int, round_to: torch.dtype, gen: torch.Generator):
    """6 experts (hidden 96, intermediate 64) in `formats`, `tokens` tokens large enough that a low clamp bites
    (bf16-exact for a bf16 model), each routed to 2 experts."""
    hidden, inter, experts = 96, 64, 6
    gate, up = (expert_matrix(f, experts, inter, hidden, gen) for f in formats[:2])
    down = expert_matrix(formats[2], experts, hidden, inter, gen)
    x = torch.randn(tokens, hidden, generator=gen) * 3
    if round_to == torch.bfloat16:
        x = x.bfloat16().float()
    return gate, up, down, x, random_routing(tokens, experts, 2, gen)


@pytest.mark.parametrize("formats", [("F32",) * 3, ("BF16",) * 3, ("Q8_0",) * 3, ("MXFP4",) * 3])
@pytest.mark.parametrize("tokens", [1, 3, 8])
@pytest.mark.parametrize("round_to", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["swiglu", "gpt-oss", "v4"])
def test_biases_and_the_clamped_swiglu_match_the_reference(kernel, formats, tokens, round_to, activation):
    """gpt-oss's experts: biases on all three projections and (u.clamp(±limit) + 1) · g · σ(αg) with g clamped
    above; or V4's silu(min(g, limit)) · clamp(u, ±limit); the limit is low enough here that the clamps bite.
    Vector path, int16 Q8_0 path and tiles alike."""
    clamped = activation == "gpt-oss"
    gen = torch.Generator().manual_seed(tokens + 3 * clamped + len(formats[0]) + 7 * (activation == "v4"))
    hidden, inter, experts = 96, 64, 6
    gate, up, down, x, routing = _form_case(formats, tokens, round_to, gen)
    form = reference.ExpertForm(torch.randn(experts, inter, generator=gen),
                              torch.randn(experts, inter, generator=gen),
                              torch.randn(experts, hidden, generator=gen), clamped, 1.702, 0.8,
                              clamp_silu=activation == "v4")
    want = reference.moe_forward(x, gate, up, down, *routing, round_to=round_to, form=form)
    plain = reference.moe_forward(x, gate, up, down, *routing, round_to=round_to)
    got = kernel.moe_forward(x, gate, up, down, *routing, round_to=round_to, form=form)
    tol = 1e-5 if round_to == torch.float32 else 2e-2
    assert (got - want).norm() / want.norm() < tol
    assert (plain - want).norm() / want.norm() > 0.1  # the form changes the result: the check has teeth


@pytest.mark.parametrize("formats", [("F32",) * 3, ("BF16",) * 3, ("Q8_0",) * 3])
@pytest.mark.parametrize("tokens", [1, 3, 8])
@pytest.mark.parametrize("round_to", [torch.float32, torch.bfloat16])
def test_v4_clamped_swiglu_without_biases_matches_the_reference(kernel, formats, tokens, round_to):
    """DeepSeek-V4's experts carry no biases: the clamps ride the plain SwiGLU path (rounded where a plain bf16
    expert rounds), and the limit bites at this scale."""
    gate, up, down, x, routing = _form_case(formats, tokens, round_to,
                                            torch.Generator().manual_seed(31 + tokens + len(formats[0])))
    form = reference.ExpertForm(limit=0.8, clamp_silu=True)
    want = reference.moe_forward(x, gate, up, down, *routing, round_to=round_to, form=form)
    plain = reference.moe_forward(x, gate, up, down, *routing, round_to=round_to)
    got = kernel.moe_forward(x, gate, up, down, *routing, round_to=round_to, form=form)
    tol = 1e-5 if round_to == torch.float32 else 2e-2
    assert (got - want).norm() / want.norm() < tol
    assert (plain - want).norm() / want.norm() > 0.1


@pytest.mark.parametrize("fmt", ["F32", "Q8_0"])
@pytest.mark.parametrize("round_to", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("v4", [False, True])
def test_epilogues_computed_a_vector_at_a_time_match_one_by_one(kernel, fmt, round_to, v4):
    """Rows of 16+ tokens of one expert take the vector forms of the epilogues (ft_set_vector_act): the activation,
    its sigmoid's exp a vector polynomial, equal to libm's value by value to fp32 rounding (with bf16 rounding, to
    the rare flip of a rounding point), and each pair's output (the same arithmetic a lane at a time). Inputs large
    enough that the exp's clamps are reached (|g| past 88), 40 tokens an expert (two vectors and a rest)."""
    gen = torch.Generator().manual_seed(17 + v4 + 2 * (round_to == torch.bfloat16))
    gate, up = (expert_matrix(fmt, 3, 64, 96, gen) for _ in range(2))
    down = expert_matrix(fmt, 3, 96, 64, gen)
    x = torch.randn(40, 96, generator=gen) * torch.logspace(-1, 2, 40).unsqueeze(1)
    if round_to == torch.bfloat16:
        x = x.bfloat16().float()
    every = list(range(40))
    routing = (torch.tensor([0, 2], dtype=torch.int32), torch.tensor([0, 40, 80], dtype=torch.int32),
               torch.tensor(every + every, dtype=torch.int32), torch.rand(80, generator=gen))
    form = reference.ExpertForm(limit=5.0, clamp_silu=True) if v4 else None
    vector = kernel.moe_forward(x, gate, up, down, *routing, round_to=round_to, form=form)
    assert kernel.lib.ft_set_vector_act(0) == 1
    try:
        one_by_one = kernel.moe_forward(x, gate, up, down, *routing, round_to=round_to, form=form)
    finally:
        kernel.lib.ft_set_vector_act(1)
    want = reference.moe_forward(x, gate, up, down, *routing, round_to=round_to, form=form)
    gates = torch.einsum("th,ih->ti", x, gate.expert(0).float())
    assert gates.abs().max() > 88  # the clamps of the exp are reached
    assert torch.isfinite(vector).all()
    close = 1e-6 if round_to == torch.float32 else 1e-3
    assert (vector - one_by_one).norm() / one_by_one.norm() < close
    tol = 1e-5 if round_to == torch.float32 else 2e-2
    assert (vector - want).norm() / want.norm() < tol


@pytest.mark.parametrize("fmt", ["F32", "BF16", "Q8_0", "MXFP4", "FP8_B32"])
@pytest.mark.parametrize("tokens", [1, 2, 5])
def test_eight_lane_dots_match_the_sixteen_lane_ones(kernel, fmt, tokens):
    """On x86 without AVX-512 the dot products run on 8-lane registers (dots_avx2.h); `ft_set_avx2_dots` switches
    them on or off anywhere AVX2 is, so both forms are checked on every x86 CI machine. fp32 activations and the
    int16 path off keep every row on these dot products; float rows of 100 leave a tail of 4."""
    before = kernel.lib.ft_set_avx2_dots(1)
    if before < 0:
        pytest.skip("built without AVX2: there is one form only")
    gen = torch.Generator().manual_seed(tokens)
    hidden, inter, experts = (96, 64, 6) if fmt not in ("F32", "BF16") else (100, 64, 6)
    gate, up = (expert_matrix(fmt, experts, inter, hidden, gen) for _ in range(2))
    down = expert_matrix(fmt, experts, hidden, inter, gen)
    x = torch.randn(tokens, hidden, generator=gen)
    routing = random_routing(tokens, experts, 2, gen)
    want = reference.moe_forward(x, gate, up, down, *routing)
    outs = []
    kernel.lib.ft_set_q16(0)
    try:
        for on in (0, 1):
            kernel.lib.ft_set_avx2_dots(on)
            outs.append(kernel.moe_forward(x, gate, up, down, *routing))
    finally:
        kernel.lib.ft_set_avx2_dots(before)
        kernel.lib.ft_set_q16(1)
    for got in outs:
        assert (got - want).norm() / want.norm() < 1e-5
    # two summation orders: a sign the switch took effect. With AVX-512 the 16-lane reduction of one accumulator is
    # the 8-lane form's two accumulators added: float rows at one accumulator pair (tokens 1-2) agree bit for bit.
    if kernel.q16_sixteen_lanes and fmt in ("F32", "BF16") and tokens <= 2:
        assert (outs[0] - outs[1]).abs().max() <= 1e-5 * want.abs().max()
    else:
        assert not torch.equal(outs[0], outs[1])
    assert (outs[0] - outs[1]).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("fmt", ["BF16", "Q8_0", "MXFP4"])
def test_the_vector_paths_prefetch_changes_no_result(kernel, fmt):
    """ft_set_dots_prefetch (software prefetch ahead in each row on the vector paths and the int16 path; 4 KiB by
    default) reads further ahead only: the same result bit for bit at any distance, on every dot path this CPU has
    (16- and 8-lane fp32, bf16 dots, int16 at one token), for passes of 1-4 tokens."""
    gen = torch.Generator().manual_seed(9)
    gate, up = (expert_matrix(fmt, 3, 64, 256, gen) for _ in range(2))
    down = expert_matrix(fmt, 3, 256, 64, gen)
    x = torch.randn(5, 256, generator=gen).bfloat16().float()
    routing = (torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([0, 5, 7, 8], dtype=torch.int32),
               torch.tensor([0, 1, 2, 3, 4, 1, 3, 2], dtype=torch.int32), torch.rand(8, generator=gen))
    avx2 = kernel.lib.ft_set_avx2_dots(0)
    kernel.lib.ft_set_avx2_dots(avx2)
    default = kernel.lib.ft_set_dots_prefetch(0)
    assert default == 4096
    kernel.lib.ft_set_amx(2, 6, 1)  # tiles off: the vector paths only
    try:
        for lanes in (0, 1) if avx2 >= 0 else (avx2,):
            kernel.lib.ft_set_avx2_dots(lanes)
            for bf16_from in (NEVER, 1):
                with block_bf16_from(kernel, bf16_from):
                    outs = []
                    for ahead in (0, 64, 4096):
                        assert kernel.lib.ft_set_dots_prefetch(ahead) in (0, 64)
                        outs.append(kernel.moe_forward(x, gate, up, down, *routing, round_to=torch.bfloat16))
                    assert kernel.lib.ft_set_dots_prefetch(0) == 4096
                assert outs[0].abs().sum() > 0 and all(torch.equal(o, outs[0]) for o in outs[1:])
    finally:
        kernel.lib.ft_set_avx2_dots(avx2)
        kernel.lib.ft_set_amx(2, 6, 0)
        kernel.lib.ft_set_dots_prefetch(default)


@pytest.mark.parametrize("hidden", [40, 17])
def test_float_rows_of_any_length(kernel, hidden):
    gen = torch.Generator().manual_seed(hidden)
    gate, up, down = (expert_matrix("BF16", 3, o, i, gen) for o, i in ((24, hidden), (24, hidden), (hidden, 24)))
    x = torch.randn(5, hidden, generator=gen)
    routing = random_routing(5, 3, 2, gen)
    want = reference.moe_forward(x, gate, up, down, *routing)
    assert torch.allclose(kernel.moe_forward(x, gate, up, down, *routing), want, atol=1e-5, rtol=1e-5)


def test_unsupported_formats_are_refused(kernel):
    gen = torch.Generator().manual_seed(0)
    half = ExpertMatrix.of(torch.randn(2, 8, 32, generator=gen).half())
    assert not kernel.supports(half, half, half)
    with pytest.raises(ValueError, match="F32/BF16/Q8_0/MXFP4/FP8_B32"):
        kernel.moe_forward(torch.randn(1, 32), half, half, half, *random_routing(1, 2, 1, gen))


def test_read_probe_reads_every_byte(kernel):
    buf = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8)
    assert kernel.read_bytes(buf) == int(np.bitwise_xor.reduce(buf.numpy().view(np.uint64)))


def test_each_job_reports_where_its_time_went(kernel):
    """`timing()` sums, per job waited for: posting → first task, → last gate/up task, → last down task."""
    gen = torch.Generator().manual_seed(5)
    gate, up, down = (expert_matrix("BF16", 8, o, i, gen) for o, i in ((64, 128), (64, 128), (128, 64)))
    before = kernel.timing()
    for _ in range(3):
        kernel.moe_forward(torch.randn(2, 128, generator=gen), gate, up, down, *random_routing(2, 8, 2, gen))
    after = kernel.timing()
    jobs, first, gate_up, total = (a - b for a, b in zip(after, before, strict=True))
    assert jobs == 3 and 0 < first <= gate_up <= total


def test_every_file_the_kernel_includes_is_part_of_its_build_key():
    """A header missing from build.PARTS would leave an edited kernel's cached build in use."""
    texts = [build.SOURCE.read_text(), *(build.SOURCE.with_name(part).read_text() for part in build.PARTS)]
    included = {name for text in texts for name in re.findall(r'#include "([^"]+)"', text)}
    assert included and included <= set(build.PARTS)


def test_build_is_cached_and_failures_fall_back(tmp_path, monkeypatch, caplog):
    first = build.build(tmp_path)
    assert first is not None and build.build(tmp_path) == first and len(list(tmp_path.iterdir())) == 1
    monkeypatch.setenv("CC", "false")  # a compiler that always fails, with a different build key
    monkeypatch.setattr(build, "_compiler", lambda: "/bin/false")
    assert build.build(tmp_path / "other") is None
    assert "plain-torch path" in caplog.text
    monkeypatch.setenv("FREETOKEN_CPU_KERNEL", "0")
    assert build.load(tmp_path) is None


def test_concurrent_callers_are_serialised(kernel):
    """The pool runs one job at a time: callers on several threads each get their own correct result."""
    from concurrent.futures import ThreadPoolExecutor

    gen = torch.Generator().manual_seed(5)
    gate, up = (expert_matrix("BF16", 4, 32, 64, gen) for _ in range(2))
    down = expert_matrix("BF16", 4, 64, 32, gen)
    cases = [(torch.randn(3, 64, generator=gen), random_routing(3, 4, 2, gen)) for _ in range(8)]
    want = [reference.moe_forward(x, gate, up, down, *r) for x, r in cases]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda c: kernel.moe_forward(c[0], gate, up, down, *c[1]), cases * 4))
    assert all(torch.allclose(g, want[i % 8], atol=1e-5, rtol=1e-5) for i, g in enumerate(got))


def test_workers_woken_ahead_run_the_next_job_or_sleep_again(kernel):
    """`wake` before a job: the job's result is the reference's, whether it comes while the woken workers spin
    for it, after their spin ran out (they went back to sleep), or after several wakes in a row."""
    import time

    gen = torch.Generator().manual_seed(6)
    gate, up = (expert_matrix("BF16", 4, 32, 64, gen) for _ in range(2))
    down = expert_matrix("BF16", 4, 64, 32, gen)
    x, routing = torch.randn(2, 64, generator=gen), random_routing(2, 4, 2, gen)
    want = reference.moe_forward(x, gate, up, down, *routing)
    for pause_s, spin_s, wakes in ((0.0, 1e-3, 1), (0.02, 1e-3, 1), (0.001, 1e-4, 3), (0.3, 0.0, 2)):
        time.sleep(0.3)  # past the workers' own spin: asleep
        for _ in range(wakes):
            kernel.wake(spin_s)
        time.sleep(pause_s)
        assert torch.allclose(kernel.moe_forward(x, gate, up, down, *routing), want, atol=1e-5, rtol=1e-5)


_TREE_WAKE_SCRIPT = """
import sys, time, torch
from freetoken.kernels.cpu_experts import reference
from freetoken.kernels.cpu_experts.kernel import CpuExpertKernel
from freetoken.kernels.cpu_experts.reference import ExpertMatrix
kernel = CpuExpertKernel.get(threads=9)
assert kernel.threads == 9, kernel.threads
gen = torch.Generator().manual_seed(7)
gate, up = (ExpertMatrix.of((torch.randn(4, 32, 64, generator=gen) * 0.1).bfloat16()) for _ in range(2))
down = ExpertMatrix.of((torch.randn(4, 64, 32, generator=gen) * 0.1).bfloat16())
x = torch.randn(2, 64, generator=gen)
routing = (torch.tensor([0, 2], dtype=torch.int32), torch.tensor([0, 2, 3], dtype=torch.int32),
           torch.tensor([0, 1, 1], dtype=torch.int32), torch.rand(3, generator=gen))
want = kernel.moe_forward(x, gate, up, down, *routing)  # the same sums in the same order on any thread
assert torch.allclose(want, reference.moe_forward(x, gate, up, down, *routing), atol=1e-5, rtol=1e-4)
print("tree wake-up", kernel.set_tree_wake(True))
kernel.set_join(False)  # every worker must check in: a worker the tree left asleep hangs the job
for i in range(40):
    tree = i % 10 < 7  # mostly tree, with switches while workers sleep either way
    kernel.set_tree_wake(tree)
    time.sleep((0.0, 0.0005, 0.003)[i % 3])  # spinning, just asleep, long asleep
    if i % 4 == 1:
        kernel.wake(1e-4)
    got = kernel.moe_forward(x, gate, up, down, *routing)
    assert torch.equal(got, want), i
print("ok")
"""


def test_the_tree_wake_up_wakes_every_worker_for_every_job(tmp_path):
    """Eight workers (a tree three deep) asleep, spinning or woken ahead, the wake-up switched between the tree
    and the broadcast while they sleep: every job completes (a worker left asleep would hang it: the join is set
    to wait for all of them) with the reference's result. Its own process: the pool's size is fixed at its start."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "FREETOKEN_HOME": str(tmp_path)}
    # run from tmp_path: from the repository's root `-c` would import the source tree, where kernels/ is not
    # freetoken.kernels (the installed package maps it)
    run = subprocess.run([sys.executable, "-c", _TREE_WAKE_SCRIPT], capture_output=True, text=True, timeout=120,
                         env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.splitlines()
    assert lines[-1] == "ok"
    assert lines[0] == f"tree wake-up {sys.platform.startswith('linux')}"


_OVERSUBSCRIBED_SCRIPT = """
import os, random, time, torch
from freetoken.kernels.cpu_experts import reference
from freetoken.kernels.cpu_experts.kernel import CpuExpertKernel
from freetoken.kernels.cpu_experts.reference import ExpertMatrix
threads = 3 * len(os.sched_getaffinity(0)) + 1
kernel = CpuExpertKernel.get(threads=threads)
assert kernel.threads == threads, kernel.threads
assert kernel.set_join(True)
gen = torch.Generator().manual_seed(8)
cases = []
for tokens, experts, hidden, inter in ((1, 2, 64, 32), (3, 4, 128, 64), (1, 4, 2048, 96), (9, 8, 256, 128)):
    gate, up = (ExpertMatrix.of((torch.randn(experts, inter, hidden, generator=gen) * 0.1).bfloat16())
                for _ in range(2))
    down = ExpertMatrix.of((torch.randn(experts, hidden, inter, generator=gen) * 0.1).bfloat16())
    x = torch.randn(tokens, hidden, generator=gen)
    ids = torch.arange(experts, dtype=torch.int32)
    offsets = torch.arange(experts + 1, dtype=torch.int32) * tokens
    pair_tokens = torch.arange(tokens, dtype=torch.int32).repeat(experts)
    routing = (ids, offsets, pair_tokens, torch.rand(experts * tokens, generator=gen))
    want = kernel.moe_forward(x, gate, up, down, *routing)
    assert torch.allclose(want, reference.moe_forward(x, gate, up, down, *routing), atol=1e-4, rtol=1e-4)
    cases.append((x, gate, up, down, routing, want))
buf = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=gen)
checksum = kernel.read_bytes(buf)
rng = random.Random(8)
for i in range(600):
    if rng.random() < 0.1:
        assert kernel.read_bytes(buf) == checksum, i  # another job function, another task count
        continue
    if rng.random() < 0.2:  # the caller runs tasks too, or only waits for the workers
        kernel.set_caller_joins(rng.random() < 0.5)
    if rng.random() < 0.2:  # each worker its own rows first (owned tasks), or tasks claimed in order
        kernel.set_owned_rows(rng.random() < 0.5)
    x, gate, up, down, routing, want = rng.choice(cases)
    if rng.random() < 0.3:  # a background read that the next job cancels part way (or finds finished)
        if rng.random() < 0.5:
            assert kernel.warm([(buf.data_ptr(), rng.randrange(1, buf.numel())), (buf.data_ptr(), 4096)])
        else:
            assert kernel.warm_rows(kernel.launch_constants(gate, up, down), routing[0], x.shape[1])
        if rng.random() < 0.3:
            time.sleep(rng.choice((0.0, 0.0002, 0.002)))
    got = kernel.moe_forward(x, gate, up, down, *routing)
    assert torch.equal(got, want), i
    if rng.random() < 0.05:
        time.sleep(0.001)
print("ok")
"""


def test_jobs_end_with_their_last_task_while_workers_are_descheduled(tmp_path):
    """Three times as many threads as cores, so the OS deschedules workers all the time: a job ends when its last
    task is done (not when every worker has checked in), and a worker that wakes late must claim nothing of a job
    that has ended nor anything past the end of the next one — jobs of different task counts and functions in a
    row give exactly their results, whether the caller runs tasks too or only waits (`set_caller_joins`), and
    whether a background read (`warm`, `warm_rows`) is still running when a job is posted (the job cancels and
    drains it), and whether the tasks are claimed in order or each worker's own first (`set_owned_rows`)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "FREETOKEN_HOME": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", _OVERSUBSCRIBED_SCRIPT], capture_output=True, text=True,
                         timeout=300, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.splitlines()[-1] == "ok"


def test_a_caller_that_only_waits_gets_the_same_result(kernel):
    """`set_caller_joins(False)`: the workers run every task and the caller only waits (GPU path
    "cpu-caller-waits"); with no worker at all the caller still runs them."""
    gen = torch.Generator().manual_seed(10)
    gate, up = (expert_matrix("Q8_0", 4, 64, 256, gen) for _ in range(2))
    down = expert_matrix("Q8_0", 4, 256, 64, gen)
    x = torch.randn(3, 256, generator=gen)
    routing = random_routing(3, 4, 2, gen)
    joined = kernel.moe_forward(x, gate, up, down, *routing)
    assert kernel.set_caller_joins(False) is True
    try:
        waited = kernel.moe_forward(x, gate, up, down, *routing)
    finally:
        assert kernel.set_caller_joins(True) is (kernel.threads == 1)  # forced on where there is no worker
    assert torch.equal(joined, waited)


def test_warming_reads_in_the_background_until_the_next_job(kernel):
    """`warm` returns at once; the next job (here the read probe, then an expert job) cancels what is left and
    gives its exact result. It is skipped while a job is in flight and where the pool has no workers."""
    gen = torch.Generator().manual_seed(11)
    buf = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8, generator=gen)  # far more than a job's gap reads
    checksum = kernel.read_bytes(buf)
    gate, up = (expert_matrix("Q8_0", 4, 64, 256, gen) for _ in range(2))
    down = expert_matrix("Q8_0", 4, 256, 64, gen)
    x = torch.randn(2, 256, generator=gen)
    routing = random_routing(2, 4, 2, gen)
    want = kernel.moe_forward(x, gate, up, down, *routing)
    regions = [(buf.data_ptr(), buf.numel()), (gate.data.data_ptr(), gate.data.numel())]
    assert kernel.warm(regions) is (kernel.threads > 1)
    assert kernel.read_bytes(buf) == checksum
    assert kernel.warm(regions) is (kernel.threads > 1)
    assert torch.equal(kernel.moe_forward(x, gate, up, down, *routing), want)
    pending = kernel.start(x, gate, up, down, *routing)
    assert kernel.warm(regions) is False  # the job holds the kernel
    assert torch.equal(pending.wait(), want)
    assert kernel.warm([]) is False


@pytest.mark.parametrize("fmt", ["Q8_0", "MXFP4", "FP8_B32"])
@pytest.mark.parametrize("tokens", [2, 5, 8, 40])
def test_block_formats_of_a_bf16_model_compute_what_a_bf16_gpu_expert_computes(kernel, fmt, tokens):
    """At several tokens per expert, block-format weights (Q8_0, MXFP4, FP8_B32) of a bf16 model are dequantized
    to bf16 (in registers on the bf16 dot path; on tiles in the tile, or once per row block when several token
    tiles share it), as the GPU path dequantizes them, so the result equals the reference run on bf16-dequantized
    weights."""
    if not kernel.amx and not kernel.bf16_dot:
        pytest.skip("neither AMX nor AVX-512-BF16 on this CPU: such experts take the fp32 path")
    gen = torch.Generator().manual_seed(3)
    gate, up = (expert_matrix(fmt, 4, 64, 96, gen) for _ in range(2))
    down = expert_matrix(fmt, 4, 96, 64, gen)
    as_bf16 = [ExpertMatrix.of(torch.stack([m.expert(e) for e in range(4)]).bfloat16()) for m in (gate, up, down)]
    x = torch.randn(tokens, 96, generator=gen).bfloat16().float()  # (with AMX, tiles from 6 tokens on)
    every = list(range(tokens))
    routing = (torch.tensor([0, 2], dtype=torch.int32), torch.tensor([0, tokens, 2 * tokens], dtype=torch.int32),
               torch.tensor(every + every, dtype=torch.int32), torch.rand(2 * tokens, generator=gen))
    want = reference.moe_forward(x, *as_bf16, *routing, round_to=torch.bfloat16)
    with block_bf16_from(kernel, 2) as default:  # the bf16 dot path at every count of several tokens
        got = kernel.moe_forward(x, gate, up, down, *routing, round_to=torch.bfloat16)  # (int8 tiles: off)
    # (the fp32 path, with fp32 weights, is 4e-3 to 6e-3 away from this for Q8_0 and FP8_B32; MXFP4's values
    # are bf16 values, so both paths meet it exactly)
    assert (got - want).norm() / want.norm() < 2e-4
    if tokens >= default:  # by default too, from that many tokens on
        by_default = kernel.moe_forward(x, gate, up, down, *routing, round_to=torch.bfloat16)
        assert (by_default - want).norm() / want.norm() < 2e-4
    if fmt != "MXFP4" and not kernel.amx:  # and it is the bf16 dot path that meets it here
        with block_bf16_from(kernel, NEVER):
            fp32_path = kernel.moe_forward(x, gate, up, down, *routing, round_to=torch.bfloat16)
        assert (fp32_path - want).norm() / want.norm() > 1e-3


@pytest.mark.parametrize("fmt", ["Q8_0", "BF16", "F32"])
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_owned_rows_and_their_warming_give_the_same_results(kernel, fmt, tokens):
    """`set_owned_rows(True)`: each worker first runs its own share of every expert's rows (then takes others'
    unclaimed tasks, phase by phase), which changes who computes a row, never what: bit-equal results on every
    path (the int16 path at 1 token, the vector paths, tiles at 40), also right after `warm_rows` read the
    experts' rows (the job cancels what is left of it)."""
    gen = torch.Generator().manual_seed(12 + tokens)
    gate, up = (expert_matrix(fmt, 6, 96, 256, gen) for _ in range(2))
    down = expert_matrix(fmt, 6, 256, 96, gen)
    x = torch.randn(tokens, 256, generator=gen).bfloat16().float()
    routing = random_routing(tokens, 6, 2, gen)
    want = kernel.moe_forward(x, gate, up, down, *routing, round_to=torch.bfloat16)
    constants = kernel.launch_constants(gate, up, down)
    assert kernel.set_owned_rows(True) is False
    try:
        for _ in range(3):
            assert torch.equal(kernel.moe_forward(x, gate, up, down, *routing, round_to=torch.bfloat16), want)
            assert kernel.warm_rows(constants, routing[0], 256) is (kernel.threads > 1)
        pending = kernel.start(x, gate, up, down, *routing, round_to=torch.bfloat16)
        assert kernel.warm_rows(constants, routing[0], 256) is False  # the job holds the kernel
        assert torch.equal(pending.wait(), want)
    finally:
        assert kernel.set_owned_rows(False) is True
    assert kernel.warm_rows(constants, routing[0][:0], 256) is False
