"""End-to-end check of the miss planner: its splits against the two pure miss paths, on measured step times.

The planner's cost models can be wrong in ways its own samples do not show: the link slower while the CPU reads
DRAM, a CPU share that starts late, copies that delay the next layer's work (seen on the H200: gpt-oss-20b at
budget 0, where `auto` ran at 0.84× the CPU-only path with its models fitted). So decode layer-steps are also
timed whole, and now and then a window of them sends every miss down one pure path (all to the CPU, or all
copied) instead of the planner's split. The way that measured fastest per miss is used; the others are measured
again every so often, less often the worse they measured. The first window is not measured (the first copies,
the first CPU job and its threads pay one-off costs there), a window's stalls (a step far slower than its
median: a page fault, a collection) are left out of its measurement, and a way's estimate is the median of its
latest three windows, so that one odd window (the first steps after a long prefill measured the split at 3.5x
its later cost on the H200) can neither condemn a way nor crown it. No torch here.
"""

from __future__ import annotations

import statistics
from collections import deque

WAYS = ("split", "cpu", "copy")  # the planner's split first: the way expected to win


class PathGuard:
    WINDOW = 48  # layer-steps per window of one way (a token of a 48-layer model)
    SETTLE = 2  # layer-steps not counted after a change of way: they still carry the previous way's copies
    EXPLORE_EVERY = 24  # windows between measurements of a way that measured within FAR of the best
    FAR = 1.5  # a way this much slower than the best is measured four times less often
    MARGIN = 0.03  # another way must beat the current best by this much to replace it (no flapping on noise)
    RECENT = 3  # windows whose median is a way's estimate; a way measured fewer times is measured again soon
    STALL = 4.0  # a step this many times the window's median per miss is a stall, not the way's cost

    def __init__(self, window: int = WINDOW, explore_every: int = EXPLORE_EVERY):
        self.window, self.explore_every = window, explore_every
        self.way = WAYS[0]  # the way the current window uses
        self.best = WAYS[0]
        self.seconds_per_miss: dict[str, float] = {}
        self._since = dict.fromkeys(WAYS, 0)  # windows since each way last ran
        self._measured = dict.fromkeys(WAYS, 0)  # windows measured of each way
        self._recent = {way: deque(maxlen=self.RECENT) for way in WAYS}  # each way's latest seconds per miss
        self._samples: list[tuple[float, int]] = []  # this window's (seconds, misses)
        self._settle = window  # steps not to measure: the first window (one-off costs), a change's first steps
        # the latest windows: (way, seconds per miss or None, steps, misses, median step seconds), for diagnostics
        self.history: deque[tuple[str, float | None, int, int, float]] = deque(maxlen=32)

    def observe(self, seconds: float, misses: int) -> None:
        """One decode layer-step took `seconds` (host wall time, its waits included) with `misses` experts the
        cache lacked."""
        if self._settle:
            self._settle -= 1
            return
        self._samples.append((seconds, misses))
        if len(self._samples) >= self.window:
            self._close_window()

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
        self.history.append((self.way, per_miss, len(steps), sum(m for _, m in self._samples),
                             steps[len(steps) // 2]))
        if per_miss is not None:  # a window of hits only says nothing about the miss paths
            self._recent[self.way].append(per_miss)
            self.seconds_per_miss[self.way] = statistics.median(self._recent[self.way])
            self._measured[self.way] += 1
            self._update_best()
        self._samples = []
        previous, self.way = self.way, self._next_way()
        for way in WAYS:
            self._since[way] = 0 if way == self.way else self._since[way] + 1
        self._settle = self.SETTLE if self.way != previous else 0

    def _update_best(self) -> None:
        est = self.seconds_per_miss
        challenger = min(est, key=est.get)
        if self.best not in est or est[challenger] < est[self.best] * (1 - self.MARGIN):
            self.best = challenger

    def _next_way(self) -> str:
        est = self.seconds_per_miss
        unmeasured = [w for w in WAYS if w not in est]
        if unmeasured:
            return unmeasured[0]
        due = [w for w in WAYS if w != self.best and self._since[w] >= self._interval(w)]
        return max(due, key=self._since.get) if due else self.best

    def _interval(self, way: str) -> int:
        """Windows between measurements of `way`: a way measured fewer than RECENT times is measured again soon
        (one window can mislead), one measured far slower than the best rarely."""
        est = self.seconds_per_miss
        if self._measured[way] < self.RECENT:
            return 1
        return self.explore_every * (4 if est[way] > self.FAR * est[self.best] else 1)

    def describe_history(self) -> str:
        """The latest windows, oldest first: way, µs per miss, misses per step, median step µs."""
        def one(way: str, per_miss: float | None, steps: int, misses: int, median: float) -> str:
            cost = f"{per_miss * 1e6:.0f}" if per_miss is not None else "-"
            return f"{way} {cost} ({misses / steps:.1f}/step, median {median * 1e6:.0f})"

        return "; ".join(one(*window) for window in self.history)

    def describe(self) -> str:
        est = self.seconds_per_miss
        parts = ", ".join(f"{w} {est[w] * 1e6:.0f}" for w in WAYS if w in est)
        return f"ways measured (µs per miss): {parts or 'none yet'}; using {self.best}"
