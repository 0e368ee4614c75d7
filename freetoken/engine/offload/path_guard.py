"""End-to-end check of the miss planner: its splits against the two pure miss paths, on measured step times.

The planner's cost models can be wrong in ways its own samples do not show: the link slower while the CPU reads
DRAM, a CPU share that starts late, copies that delay the next layer's work (seen on the H200: gpt-oss-20b at
budget 0, where `auto` ran at 0.84× the CPU-only path with its models fitted). So decode layer-steps are also
timed whole, and now and then a window of them sends every miss down one pure path (all to the CPU, or all
copied) instead of the planner's split. The way that measured fastest per miss is used; the others are measured
again every so often, less often the worse they measured. No torch here.
"""

from __future__ import annotations

WAYS = ("split", "cpu", "copy")  # the planner's split first: the way expected to win


class PathGuard:
    WINDOW = 48  # layer-steps per window of one way (a token of a 48-layer model)
    SETTLE = 2  # layer-steps not counted after a change of way: they still carry the previous way's copies
    EXPLORE_EVERY = 24  # windows between measurements of a way that measured within FAR of the best
    FAR = 1.5  # a way this much slower than the best is measured four times less often
    MARGIN = 0.03  # another way must beat the current best by this much to replace it (no flapping on noise)
    FORGET = 0.5  # weight of a window's measurement in its way's estimate

    def __init__(self, window: int = WINDOW, explore_every: int = EXPLORE_EVERY):
        self.window, self.explore_every = window, explore_every
        self.way = WAYS[0]  # the way the current window uses
        self.best = WAYS[0]
        self.seconds_per_miss: dict[str, float] = {}
        self._since = dict.fromkeys(WAYS, 0)  # windows since each way last ran
        self._steps = self._misses = 0
        self._seconds = 0.0
        self._settle = 0  # steps of this window still to skip

    def observe(self, seconds: float, misses: int) -> None:
        """One decode layer-step took `seconds` (host wall time, its waits included) with `misses` experts the
        cache lacked."""
        self._steps += 1
        if self._settle:
            self._settle -= 1
            return
        self._seconds += seconds
        self._misses += misses
        if self._steps >= self.window:
            self._close_window()

    def _close_window(self) -> None:
        if self._misses:  # a window of hits only says nothing about the miss paths
            per_miss = self._seconds / self._misses
            old = self.seconds_per_miss.get(self.way)
            self.seconds_per_miss[self.way] = per_miss if old is None else \
                (1 - self.FORGET) * old + self.FORGET * per_miss
            self._update_best()
        self._steps = self._misses = 0
        self._seconds = 0.0
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
        est = self.seconds_per_miss
        return self.explore_every * (4 if est[way] > self.FAR * est[self.best] else 1)

    def describe(self) -> str:
        est = self.seconds_per_miss
        parts = ", ".join(f"{w} {est[w] * 1e6:.0f}" for w in WAYS if w in est)
        return f"ways measured (µs per miss): {parts or 'none yet'}; using {self.best}"
