"""End-to-end check of the miss planner: its splits against the two pure miss paths, on measured step times, and
a search for the split's bias.

The planner's cost models can be wrong in ways its own samples do not show: the link slower while the CPU reads
DRAM, a CPU share that starts late, copies that delay the next layer's work (seen on the H200: gpt-oss-20b at
budget 0, where `auto` ran at 0.84× the CPU-only path with its models fitted). So decode layer-steps are also
timed whole, and now and then a window of them sends every miss down one pure path (all to the CPU, or all
copied) instead of the planner's split. The way that measured fastest per miss is used; the others are measured
again every so often, less often the worse they measured. The first window is not measured (the first copies,
the first CPU job and its threads pay one-off costs there), a window's stalls (a step far slower than its
median: a page fault, a collection) are left out of its measurement, and a way's estimate is the median of its
latest three windows, so that one odd window (the first steps after a long prefill measured the split at 3.5x
its later cost on the H200) can neither condemn a way nor crown it. A way that loses the lead is measured again
soon, at doubling intervals: a passing slowdown of the host's CPU (the cpu way and the split pay for it, the copies
do not) could otherwise leave the guard on the slower copies until that way's next turn, 24 windows later, and
until two more of its windows outvote the slow ones (seen in A1 at 57d4689 on an H100: whole turns of 26-27 tok/s
on the copies between turns of 30-31 on the cpu way).

The split itself can settle where it is not fastest: its models learn from the shares it chose, so a CPU that only
ever gets one expert a step looks dear per expert and keeps getting one (seen on the H200, Q8_0 at budget 0: rounds
of one build settled at 0.8 experts a step on the CPU and 22.4-22.9 tok/s, or at 4 and 24.2-25.2). So the split
carries a bias, whole experts moved to the CPU (negative: to the copies) beyond the planner's choice, searched by
hill climbing on the same windows: each neighbour of the best bias is measured twice, and one that beats it by the
margin becomes the best; then both neighbours of the new best are measured at once, and once neither wins, each
is measured again only every BIAS_EVERY windows, so a machine whose state changes is still followed (GPU path
"split-bias", experimental: see gpu_paths). No torch here.
"""

from __future__ import annotations

import statistics
from collections import deque

from freetoken.engine import gpu_paths

WAYS = ("split", "cpu", "copy")  # the planner's split first: the way expected to win


class PathGuard:
    WINDOW = 48  # layer-steps per window of one way (a token of a 48-layer model)
    SETTLE = 2  # layer-steps not counted after a change of way: they still carry the previous way's copies
    EXPLORE_EVERY = 24  # windows between measurements of a way that measured within FAR of the best
    FAR = 1.5  # a way this much slower than the best is measured four times less often
    MARGIN = 0.03  # another way must beat the current best by this much to replace it (no flapping on noise)
    RECENT = 3  # windows whose median is a way's estimate; a way measured fewer times is measured again soon
    STALL = 4.0  # a step this many times the window's median per miss is a stall, not the way's cost
    # windows in which the planner's models are still settling: the split measured then is measured three times
    # again after them (a pure way's cost does not depend on the models). Seen on the H200 (bf16, budget 0, a slow
    # CPU): the split's first windows at 195 µs a miss lost to the copy way's 178, and measured again only every
    # 24 windows it stayed lost, where a run that kept it measured 117-142.
    LEARNING = 16
    BIAS_EVERY = 24  # windows between measurements of each neighbouring bias once the search has settled
    # a neighbouring bias must beat the best by this much: one expert of a step's eight moves its time a few per
    # cent, so the ways' margin would stop the search on a gentle slope; a flat one lets it wander harmlessly
    BIAS_MARGIN = 0.015
    BIAS_FAR = 1.2  # a neighbouring bias this much slower than the best is measured four times less often
    BIAS_FRESH = 2  # windows of a neighbouring bias, since the best last moved, before it may replace it
    MAX_BIAS = 16  # experts a step (a step has at most a batch's pairs of misses)

    def __init__(self, window: int = WINDOW, explore_every: int = EXPLORE_EVERY, search_bias: bool | None = None):
        """`search_bias`: search the split's bias (default: as the GPU path "split-bias" says)."""
        self.window, self.explore_every = window, explore_every
        self.search_bias = gpu_paths.enabled("split-bias") if search_bias is None else search_bias
        self.way = WAYS[0]  # the way the current window uses
        self.bias = 0  # the current window's bias (the split's; 0 for a pure way)
        self.best = WAYS[0]
        self.best_bias = 0
        # an arm is (way, bias): the split at each bias tried, the pure ways at bias 0
        self._recent: dict[tuple[str, int], deque] = {}  # each arm's latest seconds per miss
        self._measured: dict[tuple[str, int], int] = {}  # windows measured of each arm
        self._fresh: dict[int, int] = {}  # windows measured of each bias since the best bias last moved
        self._since: dict[tuple[str, int], int] = {}  # windows since each arm last ran
        self._recheck: dict[str, int] = {}  # ways that lost the lead: windows until the next measurement (doubling)
        self._samples: list[tuple[float, int]] = []  # this window's (seconds, misses)
        self._most_misses = 0  # in any step measured: the bias search goes no further out
        self._windows = 0  # windows closed so far
        self._settle = window  # steps not to measure: the first window (one-off costs), a change's first steps
        # the latest windows: (way, bias, seconds per miss or None, steps, misses, median step seconds)
        self.history: deque[tuple[str, int, float | None, int, int, float]] = deque(maxlen=32)

    @property
    def seconds_per_miss(self) -> dict[str, float]:
        """Each way's estimate (the split's at its best bias), for ways measured so far."""
        return {way: est for way in WAYS if (est := self._estimate(self._arm(way))) is not None}

    def observe(self, seconds: float, misses: int) -> None:
        """One decode layer-step took `seconds` (host wall time, its waits included) with `misses` experts the
        cache lacked."""
        if self._settle:
            self._settle -= 1
            return
        self._samples.append((seconds, misses))
        self._most_misses = max(self._most_misses, misses)
        if len(self._samples) >= self.window:
            self._close_window()

    def rest(self) -> None:
        """The host did other work (a prefill chunk): the window in progress is dropped and the next one is not
        measured, as after a change of way, so the first steps after a long prefill count for no way (GPU path
        "guard-rest", on by default)."""
        self._samples = []
        self._settle = max(self._settle, self.window)

    @property
    def windows_closed(self) -> int:
        return self._windows

    def _window_per_miss(self) -> float | None:
        """Seconds per miss over the window's steps, stalls left out; None for a window of hits only."""
        rates = sorted(s / m for s, m in self._samples if m)
        if not rates:
            return None
        limit = self.STALL * rates[len(rates) // 2]
        kept = [(s, m) for s, m in self._samples if not m or s / m <= limit]
        return sum(s for s, _ in kept) / sum(m for _, m in kept)

    def _close_window(self) -> None:
        per_miss = self._window_per_miss()
        steps = sorted(s for s, _ in self._samples)
        arm = (self.way, self.bias)
        self.history.append((*arm, per_miss, len(steps), sum(m for _, m in self._samples), steps[len(steps) // 2]))
        if per_miss is not None:  # a window of hits only says nothing about the miss paths
            self._recent.setdefault(arm, deque(maxlen=self.RECENT)).append(per_miss)
            self._measured[arm] = self._measured.get(arm, 0) + 1
            if arm[0] == "split":
                self._fresh[arm[1]] = self._fresh.get(arm[1], 0) + 1
                self._update_bias(arm[1])
            self._update_best()
            if arm[0] in self._recheck:
                self._space_recheck(arm[0], per_miss)
        self._samples = []
        self._windows += 1
        if self._windows == self.LEARNING:  # the split's early windows ran on unsettled models: measure it anew
            self._measured = {arm: n for arm, n in self._measured.items() if arm[0] != "split"}
        following = self._next_arm()
        self.way, self.bias = following
        for key in self._since:
            self._since[key] += 1
        self._since[following] = 0
        self._settle = self.SETTLE if following != arm else 0

    def _space_recheck(self, way: str, per_miss: float) -> None:
        """After a window of a way that lost the lead: one that beat the best is measured again at once (its
        median needs a second good window), else twice as late as last time, until the usual interval."""
        best = self._estimate(self._arm(self.best))
        if best is not None and per_miss < best * (1 - self.MARGIN):
            self._recheck[way] = 1
        elif (later := 2 * self._recheck[way]) < self.explore_every:
            self._recheck[way] = later
        else:
            del self._recheck[way]

    def _estimate(self, arm: tuple[str, int]) -> float | None:
        recent = self._recent.get(arm)
        return statistics.median(recent) if recent else None

    def _update_bias(self, bias: int) -> None:
        """After a window of the split at `bias`: a neighbour measured enough that beats the best bias replaces
        it, and the search starts afresh around it (older windows of other biases were taken around another
        best)."""
        best = self._estimate(("split", self.best_bias))
        if bias == self.best_bias or best is None or self._fresh[bias] < self.BIAS_FRESH:
            return
        if self._estimate(("split", bias)) < best * (1 - self.BIAS_MARGIN):
            previous, self.best_bias = self.best_bias, bias
            for b in list(self._fresh):
                if b not in (bias, previous):
                    self._recent.pop(("split", b), None)
            self._fresh = {bias: self._fresh[bias], previous: self.BIAS_FRESH}

    def _update_best(self) -> None:
        est = self.seconds_per_miss
        challenger = min(est, key=est.get)
        if self.best not in est or est[challenger] < est[self.best] * (1 - self.MARGIN):
            if self.best in est:
                self._recheck[self.best] = 1
            self._recheck.pop(challenger, None)
            self.best = challenger

    def _next_arm(self) -> tuple[str, int]:
        est = self.seconds_per_miss
        unmeasured = [w for w in WAYS if w not in est]
        if unmeasured:
            return self._arm(unmeasured[0])
        due = [w for w in WAYS if w != self.best and self._since_arm(self._arm(w)) >= self._interval(w)]
        if due:
            return self._arm(max(due, key=lambda w: self._since_arm(self._arm(w))))
        if self.best == "split" and self.search_bias and (bias := self._neighbour_due()) is not None:
            return "split", bias
        return self._arm(self.best)

    def _arm(self, way: str) -> tuple[str, int]:
        """The arm a way runs as: the split at its best bias, a pure way at 0."""
        return way, self.best_bias if way == "split" else 0

    def _since_arm(self, arm: tuple[str, int]) -> int:
        return self._since.get(arm, 1 << 30)

    def _neighbour_due(self) -> int | None:
        """A bias next to the best one that is due a window: at once while it has fewer than BIAS_FRESH windows
        since the best last moved (the search is on), else every BIAS_EVERY windows."""
        if self._measured.get(("split", self.best_bias), 0) < self.BIAS_FRESH:
            return None  # the best's own estimate first: one odd window must not set the search off
        reach = min(self.MAX_BIAS, self._most_misses)  # further out every bias moves all of a step's misses
        neighbours = [b for b in (self.best_bias + 1, self.best_bias - 1) if abs(b) <= reach]
        searching = [b for b in neighbours if self._fresh.get(b, 0) < self.BIAS_FRESH]
        if searching:
            return searching[0]
        due = [b for b in neighbours if self._since_arm(("split", b)) >= self._bias_interval(b)]
        return max(due, key=lambda b: self._since_arm(("split", b))) if due else None

    def _bias_interval(self, bias: int) -> int:
        """Windows between measurements of a settled neighbour: four times BIAS_EVERY for one measured BIAS_FAR
        slower than the best (on the H200, bf16 at budget 0, one expert fewer on the CPU cost 1.65x a miss: each
        of its windows every BIAS_EVERY cost the run ~3%)."""
        est, best = self._estimate(("split", bias)), self._estimate(("split", self.best_bias))
        return self.BIAS_EVERY * (4 if est is not None and best is not None and est > self.BIAS_FAR * best else 1)

    def _interval(self, way: str) -> int:
        """Windows between measurements of `way`: a way measured fewer than RECENT times is measured again soon
        (one window can mislead), as is one that just lost the lead (at doubling intervals), one measured far
        slower than the best rarely."""
        est = self.seconds_per_miss
        if self._measured.get(self._arm(way), 0) < self.RECENT:
            return 1
        if way in self._recheck:
            return self._recheck[way]
        return self.explore_every * (4 if est[way] > self.FAR * est[self.best] else 1)

    def describe_history(self) -> str:
        """The latest windows, oldest first: way (the split with its bias), µs per miss, misses per step, median
        step µs."""
        def one(way: str, bias: int, per_miss: float | None, steps: int, misses: int, median: float) -> str:
            cost = f"{per_miss * 1e6:.0f}" if per_miss is not None else "-"
            name = f"{way}{bias:+d}" if way == "split" and bias else way
            return f"{name} {cost} ({misses / steps:.1f}/step, median {median * 1e6:.0f})"

        return "; ".join(one(*window) for window in self.history)

    def describe(self) -> str:
        est = self.seconds_per_miss
        parts = ", ".join(f"{w} {est[w] * 1e6:.0f}" for w in WAYS if w in est)
        return (f"ways measured (µs per miss): {parts or 'none yet'}; using {self.best}"
                f"{f' (bias {self.best_bias:+d})' if self.best == 'split' and self.best_bias else ''}")
