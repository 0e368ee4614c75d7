"""The miss planner splits misses between copy and CPU so a step is never much slower than the better pure path,
and corrects a wrong seed from observed timings."""

from __future__ import annotations

import pytest

from freetoken.engine.offload.planner import LinearCost, MissPlanner

MB = 10**6
EXPERT = 9 * MB


def true_seconds(path: str, nbytes: float, copy_gb_s: float, cpu_gb_s: float) -> float:
    fixed, gb_s = (20e-6, copy_gb_s) if path == "copy" else (150e-6, cpu_gb_s)
    return fixed + nbytes / (gb_s * 1e9) if nbytes else 0.0


def step_seconds(split, copy_gb_s, cpu_gb_s) -> float:
    return max(true_seconds("copy", len(split.copy) * EXPERT, copy_gb_s, cpu_gb_s),
               true_seconds("cpu", len(split.cpu) * EXPERT, copy_gb_s, cpu_gb_s))


def test_linear_cost_recovers_fixed_and_bandwidth():
    cost = LinearCost(fixed=0.0, per_byte=1e-9)
    for n in [1, 3, 8, 2, 5, 7, 4, 6] * 3:
        cost.observe(n * EXPERT, 100e-6 + n * EXPERT / 40e9)
    assert cost.gb_s == pytest.approx(40, rel=1e-3) and cost.fixed == pytest.approx(100e-6, rel=1e-2)


def test_a_fit_that_wants_a_negative_fixed_part_goes_through_the_origin_instead():
    """Times growing faster than the size (CPU batches that spill caches, queueing that contends) make the free fit
    cross zero. It must still predict what the samples took, not a steep slope with its intercept cut off."""
    cost = LinearCost(fixed=50e-6, per_byte=1e-9)
    sizes = [1, 2, 4, 8, 3, 6] * 4
    for n in sizes:
        cost.observe(n * EXPERT, (n * EXPERT / 40e9) * (1 + 0.08 * n))  # superlinear: slower per byte when bigger
    assert cost.fixed == 0.0
    for n in (1, 4, 8):
        took = (n * EXPERT / 40e9) * (1 + 0.08 * n)
        assert 0.5 * took < cost.predict(n * EXPERT) < 1.6 * took


def test_an_anchored_fit_of_one_narrow_range_of_sizes_keeps_the_fixed_part_near_the_seed():
    """Decode's CPU jobs differ by an expert or two, and noise over that narrow range let the free fit put the
    whole time into the fixed part (H200, budget 0: CPU models of 315-740 GB/s + 376-1384 µs against jobs that
    ran at 50-73 GB/s). The planner's models are anchored at their seed's fixed part instead: they still predict
    what the samples took, but one expert is no longer judged as dear as five."""
    planner = MissPlanner(47, 70, cpu_fixed_s=100e-6)
    free = LinearCost(100e-6, 1e-9 / 70)
    for i in range(120):  # 4 or 5 experts, ~450 µs, 10 µs more for the fifth: as flat as the H200's samples
        n = 4 + i % 2
        took = 445e-6 + 10e-6 * (n - 4) + 3e-6 * (i % 3 - 1)
        planner.observe_cpu(n * EXPERT, took)
        free.observe(n * EXPERT, took)
    assert free.predict(EXPERT) > 0.9 * free.predict(5 * EXPERT)  # the unanchored fit: one expert as dear as five
    cpu = planner.cpu
    assert cpu.predict(4.5 * EXPERT) == pytest.approx(450e-6, rel=0.05)  # still what the samples took
    assert cpu.predict(EXPERT) < 0.75 * cpu.predict(5 * EXPERT)
    assert cpu.fixed < 0.7 * 450e-6


@pytest.mark.parametrize("fixed", [50e-6, 300e-6])
def test_an_anchored_fit_follows_samples_of_varied_sizes(fixed):
    """Samples over a wide range of sizes outweigh the anchor, also when the true fixed part is three times the
    seed's."""
    cost = LinearCost(100e-6, 1e-9 / 10, anchor=MissPlanner.ANCHOR)
    for n in [1, 3, 8, 2, 5, 7, 4, 6] * 8:
        cost.observe(n * EXPERT, fixed + n * EXPERT / 70e9)
    assert cost.gb_s == pytest.approx(70, rel=0.1) and cost.fixed == pytest.approx(fixed, rel=0.25)
    for n in (1, 8):
        assert cost.predict(n * EXPERT) == pytest.approx(fixed + n * EXPERT / 70e9, rel=0.1)


@pytest.mark.parametrize("copy_gb_s, cpu_gb_s, expect_cpu", [(50, 1, (0, 0)), (1, 50, (8, 8)), (30, 30, (3, 5))])
def test_split_follows_the_bandwidths(copy_gb_s, cpu_gb_s, expect_cpu):
    planner = MissPlanner(copy_gb_s, cpu_gb_s, copy_fixed_s=20e-6, cpu_fixed_s=150e-6)
    split = planner.split(list(range(8)), EXPERT)
    assert expect_cpu[0] <= len(split.cpu) <= expect_cpu[1] and len(split.cpu) + len(split.copy) == 8
    best_pure = min(true_seconds("copy", 8 * EXPERT, copy_gb_s, cpu_gb_s),
                    true_seconds("cpu", 8 * EXPERT, copy_gb_s, cpu_gb_s))
    assert step_seconds(split, copy_gb_s, cpu_gb_s) <= best_pure * 1.001


def test_experts_with_more_tokens_are_copied_and_free_slots_are_filled():
    planner = MissPlanner(30, 30)
    tokens = {"a": 5, "b": 1, "c": 1, "d": 9}
    split = planner.split(list(tokens), EXPERT, tokens_of=tokens.get)
    assert split.copy[0] == "d" and "d" not in split.cpu and split.cpu  # busiest expert copied, some on CPU
    assert not planner.split(list(tokens), EXPERT, tokens_of=tokens.get, min_copy=4).cpu


def test_a_link_still_busy_with_prefetches_moves_misses_to_the_cpu():
    planner = MissPlanner(30, 30, copy_fixed_s=0, cpu_fixed_s=0, learn=False)
    idle = planner.split(list(range(8)), EXPERT)
    busy = planner.split(list(range(8)), EXPERT, copy_busy_s=planner.copy.predict(4 * EXPERT))
    assert len(idle.cpu) == 4 and len(busy.cpu) == 6  # 2 copies after the backlog of 4 finish with 6 on the CPU
    assert busy.predicted_seconds == pytest.approx(planner.cpu.predict(6 * EXPERT))
    assert len(planner.split(list(range(8)), EXPERT, copy_busy_s=1.0).cpu) == 8  # nothing waits behind a jam


def test_copies_with_a_head_start_take_more_of_the_misses():
    """A prefetch queued before its layer's routing (GPU path "prefetch-lead") is sized with a negative backlog:
    its copies run that long before the CPU share can start."""
    planner = MissPlanner(30, 30, copy_fixed_s=0, cpu_fixed_s=0, learn=False)
    ahead = planner.split(list(range(8)), EXPERT, copy_busy_s=-planner.copy.predict(2 * EXPERT), cpu_first=True)
    assert len(ahead.copy) == 5 and len(ahead.cpu) == 3  # 5 copies, 2 of them before the routing, end with 3 on the CPU
    everything = planner.split(list(range(8)), EXPERT, copy_busy_s=-1.0, cpu_first=True)
    assert len(everything.copy) == 8  # copies that land before the routing leave the CPU nothing


@pytest.mark.parametrize("seed_cpu_gb_s", [500.0, 0.5])
def test_a_wrong_seed_is_corrected_online(seed_cpu_gb_s):
    """Seeded with a CPU bandwidth 25x off in either direction, the planner converges to within 10% of the
    better pure strategy for the machine it actually runs on (copy 25 GB/s, CPU 20 GB/s)."""
    copy_gb_s, cpu_gb_s = 25.0, 20.0
    planner = MissPlanner(copy_gb_s, seed_cpu_gb_s)
    for step in range(600):
        split = planner.split(list(range(1 + step % 8)), EXPERT)
        if split.copy:
            planner.observe_copy(len(split.copy) * EXPERT, true_seconds("copy", len(split.copy) * EXPERT,
                                                                       copy_gb_s, cpu_gb_s))
        if split.cpu:
            planner.observe_cpu(len(split.cpu) * EXPERT, true_seconds("cpu", len(split.cpu) * EXPERT,
                                                                     copy_gb_s, cpu_gb_s))
    assert planner.cpu.gb_s == pytest.approx(cpu_gb_s, rel=0.1)
    split = planner.split(list(range(8)), EXPERT)
    assert split.cpu and split.copy  # both paths pay on this machine
    best_pure = min(true_seconds(p, 8 * EXPERT, copy_gb_s, cpu_gb_s) for p in ("copy", "cpu"))
    assert step_seconds(split, copy_gb_s, cpu_gb_s) < 0.7 * best_pure  # hybrid beats both pure paths


def test_an_unused_path_is_probed():
    planner = MissPlanner(copy_gb_s=1000, cpu_gb_s=0.001)
    cpu_counts = [len(planner.split([1, 2, 3], EXPERT).cpu) for _ in range(2 * MissPlanner.PROBE_EVERY + 2)]
    assert sum(cpu_counts) == 2 and max(cpu_counts) == 1
    # the link is probed with half the misses: a lone copy is timed with a whole batch's fixed costs
    planner = MissPlanner(copy_gb_s=0.001, cpu_gb_s=1000)
    copy_counts = [len(planner.split(list(range(8)), EXPERT).copy) for _ in range(MissPlanner.PROBE_EVERY + 1)]
    assert copy_counts.count(4) == 1 and sum(copy_counts) == 4


def test_a_prefetch_that_covers_every_miss_leaves_two_for_the_cpu_probe():
    """Steps whose misses were all prefetched split nothing; they still count towards the CPU probe, and once
    it is due the prefetch holds two predicted experts back so the step has misses to probe with."""
    planner = MissPlanner(copy_gb_s=1000, cpu_gb_s=0.001)
    held = []
    for _ in range(MissPlanner.PROBE_EVERY + 2):
        held.append(planner.held_for_probe())
        if held[-1]:
            assert len(planner.split([1, 2], EXPERT).cpu) == 1  # the step probes the CPU with one of them
        else:
            planner.split([], EXPERT)  # every miss was prefetched
    assert held.count(2) == 1 and held[-1] == 0 and held[MissPlanner.PROBE_EVERY] == 2
    assert MissPlanner(1000, 0.001, learn=False).held_for_probe() == 0


def test_one_stalled_queueing_does_not_lock_the_link_out():
    planner = MissPlanner(30, 30, copy_fixed_s=0, cpu_fixed_s=0, issue_s=3e-6)
    planner.observe_issue(1, 0.05)  # a 50 ms stall while queueing one copy
    assert planner.issue_s < 10e-6
    assert len(planner.split(list(range(8)), EXPERT).copy) >= 3


def test_the_time_to_queue_copies_delays_the_cpu_and_is_learned():
    """One host thread queues the copies, then starts the CPU: where a copy takes long to queue (a kernel launch
    per copy, a slow host) the CPU share starts that much later. The issue time is measured, so a planner
    seeded with none learns it and predicts the step from it."""
    free = MissPlanner(30, 30, copy_fixed_s=0, cpu_fixed_s=0, learn=False)
    assert len(free.split(list(range(8)), EXPERT).cpu) == 4
    planner = MissPlanner(30, 30, copy_fixed_s=0, cpu_fixed_s=0)
    slow_issue = free.copy.predict(EXPERT) / 2  # queueing a copy takes half the time the link takes to move it
    for _ in range(60):
        planner.observe_issue(4, 4 * slow_issue)
    assert planner.issue_s == pytest.approx(slow_issue, rel=0.01)
    split = planner.split(list(range(8)), EXPERT)
    # in units of one expert's link time u: k on the CPU start after (8 - k) * u/2 of queueing, so the step
    # takes max((8 - k) u, (8 - k) u/2 + k u): 5.5 u at k = 3 (4 u at k = 4 with free queueing, 8 u for k = 8)
    assert len(split.cpu) == 3
    unit = planner.cpu.predict(EXPERT)
    assert split.predicted_seconds == pytest.approx(5 * planner.issue_s + 3 * unit)
    assert split.predicted_seconds == pytest.approx(5.5 * unit, rel=0.01)
    planner.observe_issue(0, 1.0)  # nothing queued: nothing learned
    assert planner.issue_s == pytest.approx(slow_issue, rel=0.01)


def test_with_the_cpu_share_started_first_the_queueing_delays_the_copies_instead():
    """GPU path "cpu-first": the CPU share starts, then the host queues the copies, so the CPU's k experts take
    k u and the copies max((8 - k) u/2, (8 - k) u) from the same start: 4 u at k = 4, as with free queueing."""
    planner = MissPlanner(30, 30, copy_fixed_s=0, cpu_fixed_s=0, learn=False,
                          issue_s=MissPlanner(30, 30, copy_fixed_s=0).copy.predict(EXPERT) / 2)
    unit = planner.cpu.predict(EXPERT)
    assert len(planner.split(list(range(8)), EXPERT).cpu) == 3  # copies first: 5.5 u
    split = planner.split(list(range(8)), EXPERT, cpu_first=True)
    assert len(split.cpu) == 4 and split.predicted_seconds == pytest.approx(4 * unit)


def test_the_planner_describes_its_current_model():
    planner = MissPlanner(40, 20, copy_fixed_s=20e-6, cpu_fixed_s=150e-6, issue_s=3e-6)
    assert planner.describe() == ("copy 40.0 GB/s + 20 µs, CPU 20.0 GB/s + 150 µs, "
                                  "queueing 0 µs + 3.0 µs a copy; ways measured (µs per miss): none yet; using split")
    planner.observe_issue(2, 10e-6)
    assert "µs a copy (latest 1: median 5.0 µs a copy);" in planner.describe()


def test_queueing_a_batch_is_learned_as_a_start_plus_a_cost_per_copy():
    """Starting a batch of copies (events, a graph launch) costs several copies' worth: once batch sizes have
    varied, the model separates the two, so a batch of one is not charged like a copy inside a batch of 16."""
    planner = MissPlanner(30, 30, issue_s=3e-6)
    for i in range(80):
        n = 1 + i % 16
        planner.observe_issue(n, 35e-6 + 9e-6 * n)
    assert planner.issue.fixed == pytest.approx(35e-6, rel=0.05)
    assert planner.issue.per_copy == pytest.approx(9e-6, rel=0.05)
    assert planner.issue.predict(2) == pytest.approx(53e-6, rel=0.05) and planner.issue.predict(0) == 0.0
