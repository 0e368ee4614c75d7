"""The path guard keeps `auto` from being much slower than the better pure miss path when the planner's cost models
are wrong, measuring whole layer-steps; and the link queue tells a step how long earlier copies still hold the
link."""

from __future__ import annotations

import random

import pytest

from freetoken.engine.offload.path_guard import PathGuard
from freetoken.engine.offload.planner import LinkQueue, MissPlanner

MB = 10**6


def run(guard: PathGuard, per_miss: dict[str, float], steps: int, misses: int = 4, noise: float = 0.05,
        seed: int = 0) -> list[str]:
    """Feeds `steps` layer-steps that take `per_miss[way]` seconds a miss (±noise), returns each step's way."""
    rng = random.Random(seed)
    ways = []
    for _ in range(steps):
        ways.append(guard.way)
        guard.observe(per_miss[guard.way] * misses * (1 + rng.uniform(-noise, noise)), misses)
    return ways


def test_a_split_slower_than_the_cpu_path_is_replaced_by_it():
    """The gpt-oss-20b case on the H200: the fitted split ran at 0.84x the CPU-only path."""
    guard = PathGuard(window=24)
    ways = run(guard, {"split": 1.19e-3, "cpu": 1.0e-3, "copy": 1.6e-3}, 6000)
    assert guard.best == "cpu"
    late = ways[2000:]
    assert late.count("cpu") / len(late) > 0.93  # the other ways are only re-measured now and then
    assert "split" in late  # ... but they are: the machine may change


def test_a_split_faster_than_both_pure_paths_is_kept_at_a_small_exploration_cost():
    guard = PathGuard(window=48)
    per_miss = {"split": 0.8e-3, "cpu": 1.0e-3, "copy": 1.8e-3}
    ways = run(guard, per_miss, 20000)
    assert guard.best == "split"
    late = ways[3000:]
    mean = sum(per_miss[w] for w in late) / len(late)
    assert mean < 1.03 * per_miss["split"]  # exploring costs under 3% against always splitting
    assert late.count("copy") < late.count("cpu")  # a way far slower is measured less often


def test_a_change_of_machine_state_is_followed():
    guard = PathGuard(window=16, explore_every=8)
    run(guard, {"split": 1.2e-3, "cpu": 1.0e-3, "copy": 2.0e-3}, 3000)
    assert guard.best == "cpu"
    run(guard, {"split": 0.7e-3, "cpu": 1.0e-3, "copy": 2.0e-3}, 3000, seed=1)
    assert guard.best == "split"


def test_ways_within_the_margin_do_not_flap():
    guard = PathGuard(window=16, explore_every=4)
    bests = []
    for i in range(200):
        run(guard, {"split": 1.0e-3, "cpu": 1.01e-3, "copy": 3e-3}, 16, noise=0.0, seed=i)
        bests.append(guard.best)
    assert sum(a != b for a, b in zip(bests, bests[1:], strict=False)) <= 1


def test_windows_of_hits_only_change_no_estimate():
    guard = PathGuard(window=8)
    run(guard, {"split": 1e-3, "cpu": 1e-3, "copy": 1e-3}, 16, misses=0)
    assert guard.seconds_per_miss == {} and guard.way == "split"


def test_one_off_costs_and_stalls_do_not_condemn_a_way():
    """The H200's gpt-oss-20b run at 8 GiB measured the split at 5.6x the CPU path in its first window (the
    first copies and CPU job) and then hardly measured it again. The first window is not measured; a stall
    inside a window is left out; a way measured once is measured again at once."""
    guard = PathGuard(window=10)
    per_miss = {"split": 0.8e-3, "cpu": 1.0e-3, "copy": 2.0e-3}
    for _ in range(10):  # the first window: one-off costs, ignored
        guard.observe(0.5, 4)
    assert guard.seconds_per_miss == {}
    ways = []
    for step in range(200):
        ways.append(guard.way)
        stall = 0.2 if step % 10 == 5 else 0.0  # one stalled step per window
        guard.observe(per_miss[guard.way] * 4 + stall, 4)
    assert guard.best == "split" and guard.seconds_per_miss["split"] == pytest.approx(0.8e-3, rel=0.01)


def test_one_odd_window_cannot_condemn_a_way():
    """The H200 at 16 GiB, 16k context: the split's first measured window (right after the prefill) cost 3.5x
    its second; averaged, the two kept the guard on the CPU way (0.93x the split's speed) for the whole run. A
    way's estimate is the median of its latest windows, and a way is measured again until it has three."""
    guard = PathGuard(window=10)
    per_miss = {"split": 0.8e-3, "cpu": 1.0e-3, "copy": 2.0e-3}
    run(guard, per_miss, 10)  # the first window, not measured
    run(guard, {**per_miss, "split": 2.8e-3}, 10)  # the split's first measured window, odd
    assert guard.seconds_per_miss["split"] == pytest.approx(2.8e-3, rel=0.06)
    ways = run(guard, per_miss, 400)
    assert guard.best == "split" and guard.seconds_per_miss["split"] == pytest.approx(0.8e-3, rel=0.06)
    assert ways[200:].count("split") / 200 > 0.85


def test_a_passing_slowdown_of_the_cpu_ways_does_not_keep_the_guard_on_the_copies():
    """A1 at 57d4689 (H100): a few windows in which the host's CPU ran slow (the cpu way and the split, not the
    copies) handed the lead to the copies, 8% slower in normal times, and the guard stayed there for whole turns:
    the cpu way was measured again only after 24 windows and needed two more good windows to outvote its slow
    ones. A way that loses the lead is measured again soon, at doubling intervals."""
    window = 48
    normal = {"split": 1.20e-3, "cpu": 1.0e-3, "copy": 1.08e-3}
    slow = {**normal, "split": 1.35e-3, "cpu": 1.25e-3}
    guard = PathGuard(window=window)
    run(guard, normal, 200 * window)
    assert guard.best == "cpu"
    run(guard, slow, 6 * window, seed=1)
    assert guard.best == "copy"  # the slowdown is real while it lasts
    bests = []
    for i in range(40):
        run(guard, normal, window, seed=2 + i)
        bests.append(guard.best)
    assert bests.index("cpu") < 8 and bests[8:].count("cpu") == len(bests) - 8


def test_the_planner_sends_every_miss_down_the_guards_way():
    planner = MissPlanner(30, 30, copy_fixed_s=0, cpu_fixed_s=0)
    assert planner.guard is not None and not MissPlanner(30, 30, learn=False).guard
    assert MissPlanner(30, 30, guard=False).guard is None
    misses = list(range(6))
    split = planner.split(misses, 9 * MB)
    assert split.copy and split.cpu  # the planner's own split
    planner.guard.way = "cpu"
    assert sorted(planner.split(misses, 9 * MB).cpu) == misses
    assert len(planner.split(misses, 9 * MB, min_copy=2).copy) == 2  # free cache slots are still filled
    planner.guard.way = "copy"
    assert sorted(planner.split(misses, 9 * MB).copy) == misses
    assert "ways measured" in planner.describe()


def test_observed_steps_reach_the_guard():
    planner = MissPlanner(30, 30)
    planner.guard = PathGuard(window=4)
    for _ in range(8):  # the first window is not measured
        planner.observe_step(1e-3, 2)
    assert planner.guard.seconds_per_miss == {"split": pytest.approx(0.5e-3)} and planner.guard.way == "cpu"


def test_the_link_queue_adds_up_queued_copies_until_they_land():
    link = LinkQueue()
    link.queued(10.0, 0.002)
    assert link.backlog(10.0) == pytest.approx(0.002)
    link.queued(10.001, 0.003)  # queued behind the first batch: starts at 10.002
    assert link.backlog(10.001) == pytest.approx(0.004)
    assert link.backlog(10.006) == 0.0
    link.queued(10.010, 0.001)  # an idle link starts a batch when it is queued
    assert link.backlog(10.010) == pytest.approx(0.001)
    link.drained(10.0102)  # an event said every copy has landed, earlier than predicted
    assert link.backlog(10.0102) == 0.0


def test_after_a_rest_the_next_window_counts_for_no_way():
    """A prefill chunk between decode steps (`rest`): the window in progress is dropped, and the first window
    after it (the first steps after a long prefill, slow whichever way runs) is not measured."""
    guard = PathGuard(window=10)
    per_miss = {"split": 1e-3, "cpu": 1e-3, "copy": 2e-3}
    run(guard, per_miss, 10 + 10 * 4)  # past the unmeasured first window, four windows measured
    before, closed = dict(guard.seconds_per_miss), guard.windows_closed
    run(guard, {"split": 9e-3, "cpu": 9e-3, "copy": 9e-3}, 5)  # half a window, then the host prefills
    guard.rest()
    run(guard, {"split": 9e-3, "cpu": 9e-3, "copy": 9e-3}, 10)  # the first window after it: slow, not measured
    assert guard.seconds_per_miss == before and guard.windows_closed == closed
    run(guard, per_miss, 10)
    assert guard.windows_closed == closed + 1 and guard.history[-1][2] == pytest.approx(per_miss[guard.history[-1][0]],
                                                                                         rel=0.06)


def test_the_latest_windows_are_kept_for_diagnostics():
    guard = PathGuard(window=8)
    run(guard, {"split": 1e-3, "cpu": 2e-3, "copy": 3e-3}, 8 * 40, noise=0.0)
    assert len(guard.history) == guard.history.maxlen  # bounded
    way, bias, per_miss, steps, misses, median = guard.history[-1]
    assert steps == 8 and misses == 8 * 4 and per_miss == pytest.approx({"split": 1e-3, "cpu": 2e-3,
                                                                          "copy": 3e-3}[way])
    assert median == pytest.approx(per_miss * 4)
    assert "(4.0/step, median" in guard.describe_history()


def run_biased(guard: PathGuard, per_miss, steps: int, misses: int = 8, noise: float = 0.02, seed: int = 0):
    """Feeds `steps` layer-steps costing `per_miss(way, bias)` seconds a miss (±noise); returns each step's arm."""
    rng = random.Random(seed)
    arms = []
    for _ in range(steps):
        arms.append((guard.way, guard.bias))
        guard.observe(per_miss(guard.way, guard.bias) * misses * (1 + rng.uniform(-noise, noise)), misses)
    return arms


def valley(at: int, depth: float = 0.04):
    """A split whose cost falls by `depth` per expert of bias towards `at` (the pure ways far dearer)."""
    return lambda way, bias: {"cpu": 1.5e-3, "copy": 2.0e-3}.get(way, 1e-3 * (1 + depth * abs(bias - at)))


def test_the_split_bias_is_searched_to_the_fastest_one():
    """The H200's Q8_0 at budget 0: the models settled at one expert a step on the CPU where four ran 10% faster.
    The guard walks the bias to the fastest split and then stays there but for rare neighbour windows."""
    guard = PathGuard(window=48, search_bias=True)
    arms = run_biased(guard, valley(3), 48 * 60)
    assert guard.best == "split" and guard.best_bias == 3
    late = arms[48 * 40:]
    assert sum(arm == ("split", 3) for arm in late) / len(late) > 0.8
    assert "(bias +3)" in guard.describe() and "split+2" in guard.describe_history()


def test_the_bias_search_walks_both_ways_and_follows_a_change():
    guard = PathGuard(window=16, search_bias=True)
    run_biased(guard, valley(-2), 16 * 60)
    assert guard.best_bias == -2
    run_biased(guard, valley(1), 16 * 200, seed=1)
    assert guard.best_bias == 1


def test_a_flat_split_keeps_its_bias():
    """Biases within the margin of each other (noise only) leave the models' split alone."""
    guard = PathGuard(window=16, search_bias=True)
    arms = run_biased(guard, valley(0, depth=0.0), 16 * 300, noise=0.01)
    assert guard.best_bias == 0 and {b for _, b in arms} <= {-1, 0, 1}


def test_no_bias_search_while_a_pure_way_is_best_or_when_off():
    guard = PathGuard(window=16, search_bias=True)
    costs = lambda way, bias: {"cpu": 0.5e-3, "copy": 2.0e-3}.get(way, 1e-3 * (1 + 0.04 * abs(bias - 3)))  # noqa: E731
    arms = run_biased(guard, costs, 16 * 40)
    assert guard.best == "cpu" and guard.best_bias == 0 and {b for _, b in arms} == {0}
    off = PathGuard(window=16, search_bias=False)
    run_biased(off, valley(3), 16 * 40)
    assert off.best_bias == 0 and off.bias == 0


def test_the_search_goes_no_further_than_a_step_has_misses():
    guard = PathGuard(window=16, search_bias=True)
    arms = run_biased(guard, valley(9), 16 * 120, misses=2)
    assert max(b for _, b in arms) <= 2 and guard.best_bias == 2


def test_the_bias_search_is_off_unless_named(monkeypatch):
    from freetoken.engine import gpu_paths

    def fresh():
        gpu_paths.enabled.cache_clear()
        gpu_paths._named.cache_clear()

    monkeypatch.delenv("FREETOKEN_EXPERIMENTAL", raising=False)
    fresh()
    assert not PathGuard().search_bias
    monkeypatch.setenv("FREETOKEN_EXPERIMENTAL", "split-bias")
    fresh()
    try:
        assert PathGuard().search_bias
    finally:
        monkeypatch.delenv("FREETOKEN_EXPERIMENTAL")
        fresh()


def test_the_planner_moves_whole_experts_by_the_guards_bias():
    planner = MissPlanner(30, 30, copy_fixed_s=0, cpu_fixed_s=0)
    misses = list(range(6))
    plain = len(planner.split(misses, 9 * MB, observe=False).cpu)
    planner.guard.bias = 2
    assert len(planner.split(misses, 9 * MB, observe=False).cpu) == plain + 2
    planner.guard.bias = -10
    assert planner.split(misses, 9 * MB, observe=False).cpu == []
    planner.guard.bias = 10
    assert len(planner.split(misses, 9 * MB, observe=False, min_copy=2).copy) == 2  # free slots are still filled


def test_a_neighbouring_bias_far_slower_is_measured_rarely():
    """bf16 at budget 0 on the H200: one expert fewer on the CPU cost 1.65x a miss; measured every 24 windows it
    cost the run ~3%. A neighbour far slower is measured every 96."""
    guard = PathGuard(window=16, search_bias=True)
    cliff = lambda way, bias: {"cpu": 1.5e-3, "copy": 2.0e-3}.get(way, 1e-3 * (1.65 if bias < 0 else 1 + 0.05 * bias))  # noqa: E731
    arms = run_biased(guard, cliff, 16 * 400)
    late = arms[16 * 100:]
    assert guard.best_bias == 0
    assert late.count(("split", -1)) < late.count(("split", 1)) / 2
    plain = PathGuard(window=16, search_bias=False)  # the pure ways' own exploration, for comparison
    plain_late = run_biased(plain, cliff, 16 * 400)[16 * 100:]
    extra = sum(cliff(*arm) for arm in late) / sum(cliff(*arm) for arm in plain_late)
    assert extra < 1.01  # the search costs under 1% more than exploring the pure ways alone


def test_a_split_measured_while_its_models_settled_is_measured_again(monkeypatch):
    """The H200 at budget 0 on a slow CPU: the split's first windows (its models unsettled) lost to the copy way
    and were then measured only every 24 windows (every 96 once far slower). Once the models have had LEARNING
    windows, the split is measured again three times, so a split that has become the fastest way is used."""
    late_split = {"split": 0.8e-3, "cpu": 1.4e-3, "copy": 1.0e-3}
    learning = PathGuard.LEARNING

    def best_after(guard: PathGuard) -> str:
        run(guard, {**late_split, "split": 1.6e-3}, 8 * learning)  # the models still settling
        assert guard.best == "copy"
        run(guard, late_split, 8 * 12, seed=1)
        return guard.best

    assert best_after(PathGuard(window=8, search_bias=False)) == "split"
    monkeypatch.setattr(PathGuard, "LEARNING", 10**9)  # without the second look
    # ... and with a way that lost the lead measured again only once (the split lost it while still settling)
    monkeypatch.setattr(PathGuard, "_space_recheck", lambda guard, way, per_miss: guard._recheck.pop(way))
    assert best_after(PathGuard(window=8, search_bias=False)) == "copy"
