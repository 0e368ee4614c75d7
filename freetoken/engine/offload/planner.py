"""The miss planner: for one layer's cache misses, how many to copy to the GPU and how many to compute on the CPU.

Both paths read host DRAM and run at the same time, so a step's miss time is the slower of the two. Each path's
time is modelled as `seconds = fixed + bytes / bandwidth`, fitted online (exponentially forgetting least
squares) from the timings the executor observes, seeded from the calibration profile. One host thread queues
the copies and starts the CPU share, so the queueing (a few µs a copy for a dense expert, more where a copy
needs a kernel launch; measured online too) delays whichever comes second: the copies in decode (GPU path
"cpu-first"), the CPU share in prefill chunks and with that path off. The planner picks the
split that minimises the predicted step time, so with honest estimates it is never slower than either pure
strategy; a path that goes unused is re-probed now and then (one miss) so a wrong seed cannot lock it out.
Estimates can still be dishonest in ways no single path's samples show, so decode's splits are also checked end to end
against the pure paths, and shifted by whole experts where a shift measures faster (`PathGuard`). `LinkQueue` tells a
step how long the link still owes the copies queued before it. No torch here: the executor measures, this module only
decides.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from freetoken.engine.offload.path_guard import PathGuard


@dataclass(slots=True)
class LinearCost:
    """Online fit of seconds = fixed + per_byte * bytes, forgetting old samples geometrically.

    `anchor` > 0 adds a standing pseudo-sample of that weight, never forgotten: an empty job costs the seed's
    fixed part. Samples of a narrow range of sizes (a decode step's misses differ by one or two experts) fix the
    line's height there but hardly its slope, and the free fit can put nearly all of the time into the fixed
    part. Seen on the H200 at budget 0: CPU models of 315-740 GB/s + 376-1384 µs against jobs that ran at 50-73
    GB/s, so the planner judged one expert on the CPU as dear as five, and the prefetch then copied everything.
    The anchor leans an ill-determined slope towards the seed's fixed part, while samples of varied sizes
    outweigh it. Its error is the safe one: a fixed part set too low makes small CPU shares look cheap, they run,
    and their samples correct it; one set too high keeps them from running at all."""

    fixed: float
    per_byte: float
    decay: float = 0.95
    anchor: float = 0.0
    _anchor_fixed: float = field(init=False, default=0.0)
    _n: float = 0.0
    _sx: float = 0.0
    _sy: float = 0.0
    _sxx: float = 0.0
    _sxy: float = 0.0
    samples: int = 0

    def __post_init__(self) -> None:
        self._anchor_fixed = self.fixed

    def predict(self, nbytes: float) -> float:
        return self.fixed + self.per_byte * nbytes if nbytes else 0.0

    def observe(self, nbytes: float, seconds: float) -> bool:
        """Adds a sample; True when the sizes seen so far varied enough to fit both terms (else only the slope
        moved)."""
        d = self.decay
        self._n, self._sx, self._sy = d * self._n + 1, d * self._sx + nbytes, d * self._sy + seconds
        self._sxx, self._sxy = d * self._sxx + nbytes * nbytes, d * self._sxy + nbytes * seconds
        self.samples += 1
        n = self._n + self.anchor  # the anchor: `anchor` samples of 0 bytes in the seed's fixed time
        mean_x, mean_y = self._sx / n, (self._sy + self.anchor * self._anchor_fixed) / n
        var = self._sxx / n - mean_x * mean_x
        if var > (0.05 * mean_x) ** 2 and self.samples >= 4:  # sizes varied enough to separate the two terms
            slope = (self._sxy / n - mean_x * mean_y) / var
            if slope > 0 and mean_y >= slope * mean_x:
                self.per_byte, self.fixed = slope, mean_y - slope * mean_x
                return True
            if slope > 0:
                # The free fit wants a negative fixed part (time superlinear in size, or noise). Clamping it at 0
                # and keeping the steep slope predicted far more than any sample took (seen on the H200: a CPU
                # model of 2.7 GB/s against samples at 39, 152 µs to queue a copy against 58): the best fit
                # with a non-negative fixed part goes through the origin.
                self.per_byte, self.fixed = self._sxy / self._sxx, 0.0
                return True
        if self._sx > 0:  # one size only: keep the fixed part, attribute the rest to bandwidth
            mean_x, mean_y = self._sx / self._n, self._sy / self._n
            self.per_byte = max(mean_y - self.fixed, 0.1 * mean_y) / mean_x
        return False

    @property
    def gb_s(self) -> float:
        return 1e-9 / self.per_byte if self.per_byte > 0 else float("inf")


class IssueCost:
    """Host seconds to queue a batch of n copies: fixed + per_copy * n. Starting a batch (events, a graph launch)
    costs several times one more copy in it (~35 µs against ~9 on the H200 host for fused Q8_0 copies), so a
    per-copy mean alone would charge a small batch as if every copy paid the batch's start. Until the batch sizes
    seen have varied enough to separate the two, the per-copy part is a running mean from the seed (the fixed part
    stays at its seed); then a forgetting least-squares fit sets both."""

    DECAY = 0.9  # forgetting of the running mean

    def __init__(self, per_copy_s: float, fixed_s: float = 0.0):
        self.per_copy, self.fixed = per_copy_s, fixed_s
        self._fit = LinearCost(fixed_s, per_copy_s, decay=self.DECAY)

    def predict(self, copies: int) -> float:
        return self.fixed + self.per_copy * copies if copies else 0.0

    def observe(self, copies: int, seconds: float) -> None:
        # one stalled step (a page fault, a collection) must not lock the copy path out: a sample counts for at
        # most a few times the current estimate, so a lasting change still shows within a few steps
        sample = min(seconds, 4 * self.predict(copies) + 20e-6 * copies)
        if self._fit.observe(copies, sample):
            self.per_copy, self.fixed = self._fit.per_byte, self._fit.fixed
        else:
            d = self.DECAY
            self.per_copy = d * self.per_copy + (1 - d) * max(sample - self.fixed, 0.0) / copies


class LinkQueue:
    """When the copy link will have worked through the copies queued on it, by the copy model: each batch
    starts when the link is free (or when queued) and takes its predicted time. The executor says when the
    copies are known to have landed (an event), so a slow prediction does not pile up."""

    def __init__(self):
        self.free_at = 0.0  # host clock (perf_counter) seconds

    def queued(self, now: float, seconds: float) -> None:
        self.free_at = max(self.free_at, now) + seconds

    def drained(self, now: float) -> None:
        self.free_at = min(self.free_at, now)

    def backlog(self, now: float) -> float:
        """Seconds from `now` until copies queued now would start."""
        return max(0.0, self.free_at - now)


@dataclass(slots=True)
class Split:
    copy: list  # items to fetch into the GPU cache
    cpu: list  # items to compute where they live
    predicted_seconds: float  # of the models' choice (before the guard's bias)


class MissPlanner:
    PROBE_EVERY = 256  # layer-steps a path may go unused before one miss is sent down it to re-measure it

    TOKEN_WEIGHT = 0.1  # CPU cost of each token beyond an expert's first, in units of the expert's bytes
    ANCHOR = 1.0  # weight of the path models' pseudo-sample at the seed's fixed part (`LinearCost`), ~1/20 of theirs

    def __init__(self, copy_gb_s: float, cpu_gb_s: float, copy_fixed_s: float = 20e-6, cpu_fixed_s: float = 100e-6,
                 learn: bool = True, issue_s: float = 0.0, probe_every: int = PROBE_EVERY,
                 issue_fixed_s: float = 0.0, guard: bool = True):
        """`learn=False` keeps the given costs (a fixed split, for reproducible runs) and never probes.
        `issue_s` / `issue_fixed_s`: host seconds to queue one more copy / to start a batch, until measured.
        `guard`: check the splits end to end against the pure paths (decode's planner; with `learn` only)."""
        self.copy = LinearCost(copy_fixed_s, 1e-9 / copy_gb_s, anchor=self.ANCHOR)
        self.cpu = LinearCost(cpu_fixed_s, 1e-9 / cpu_gb_s, anchor=self.ANCHOR)
        self.issue = IssueCost(issue_s, issue_fixed_s)
        self.learn = learn
        self.probe_every = probe_every
        self.guard = PathGuard() if guard and learn else None
        self._idle = {"copy": 0, "cpu": 0}
        self.steps = 0
        # the latest raw samples (GB/s of copy and CPU batches, µs to queue one copy), for diagnostics
        self.recent = {"copy": deque(maxlen=64), "cpu": deque(maxlen=64), "issue": deque(maxlen=64)}

    def split(self, misses: list, expert_bytes: int, tokens_of=lambda m: 1, min_copy: int = 0,
              observe: bool = True, copy_busy_s: float = 0.0, cpu_first: bool = False) -> Split:
        """Orders `misses` so the experts with the most tokens are copied first (a copy costs the same for any
        number of tokens, CPU work grows with them), then picks how many to leave to the CPU. At least
        `min_copy` are copied (the executor fills free cache slots: a copy's value outlives the step).
        `copy_busy_s`: the link is still busy that long (earlier prefetches) before this step's copies start.
        `observe=False`: a what-if (prefetch sizing) that does not count as a step or probe a path.
        `cpu_first`: the host starts the CPU share before it queues the copies (GPU path "cpu-first"), so their
        queueing delays the copies, not the CPU share."""
        self.steps += observe
        n = len(misses)
        if n == 0:
            if observe and self.learn:  # neither path ran: a step without misses counts towards both probes
                self._probe(0, 0)
            return Split([], [], 0.0)
        tokens = sorted(((tokens_of(m), i) for i, m in enumerate(misses)), reverse=True)
        ordered = [misses[i] for _, i in tokens]
        way = self.guard.way if self.guard is not None else "split"
        if way != "split":  # the guard is measuring (or has chosen) a pure path; free slots are still filled
            on_cpu = n - min(min_copy, n) if way == "cpu" else 0
            return Split(ordered[:n - on_cpu], ordered[n - on_cpu:], 0.0)
        # The candidates' times, inlined (`LinearCost.predict`, `IssueCost.predict`, `cpu_bytes`): this runs on
        # the decode step's critical path, before the CPU share starts.
        copy, cpu, issue_cost, weight = self.copy, self.cpu, self.issue, self.TOKEN_WEIGHT
        best_cpu, best_t, cpu_bytes = 0, float("inf"), 0.0
        for on_cpu in range(n - min(min_copy, n) + 1):
            copies = n - on_cpu
            if on_cpu:  # the CPU takes the next-cheapest miss
                cpu_bytes += expert_bytes * (1 + weight * (tokens[copies][0] - 1))
            # by default the host queues the copies first, then starts the CPU
            issue = issue_cost.fixed + issue_cost.per_copy * copies if copies else 0.0
            copy_t = copy_busy_s + max(issue, copy.fixed + copy.per_byte * expert_bytes * copies) if copies else 0.0
            cpu_delay = 0.0 if cpu_first else issue
            t = max(copy_t, cpu_delay + cpu.fixed + cpu.per_byte * cpu_bytes if on_cpu else 0.0)
            if t < best_t - 1e-12:
                best_cpu, best_t = on_cpu, t
        if self.guard is not None and self.guard.bias:  # the guard's correction of the models (its search)
            best_cpu = min(max(best_cpu + self.guard.bias, 0), n - min(min_copy, n))
        best_cpu = self._probe(best_cpu, n) if min_copy == 0 and observe and self.learn else best_cpu
        return Split(ordered[:n - best_cpu], ordered[n - best_cpu:], best_t)

    def held_for_probe(self) -> int:
        """How many predicted experts a prefetch should leave to arrive as misses: two once the CPU path is
        due a probe. A prefetch that copies every expert the next step needs leaves that step no misses to
        split, so without this a CPU model that started pessimistic would never be measured again (seen on the
        H200: 48 layers, 16k context, budget 0 — every miss copied, 66% of the floor)."""
        return 2 if self.learn and self._idle["cpu"] >= self.probe_every else 0

    def cpu_bytes(self, expert_bytes: int, tokens: int) -> float:
        """What one expert with `tokens` tokens weighs in the CPU model: its bytes, plus the arithmetic of every
        token beyond the first (light: the CPU cost model is bytes over a bandwidth, the weight only ranks and
        scales; the fitted bandwidth absorbs its error where token counts are alike, as in one prefill chunk)."""
        return expert_bytes * (1 + self.TOKEN_WEIGHT * (tokens - 1))

    def _probe(self, on_cpu: int, n: int) -> int:
        for path, used in (("cpu", on_cpu > 0), ("copy", on_cpu < n)):
            self._idle[path] = 0 if used else self._idle[path] + 1
        if n >= 2 and self._idle["cpu"] >= self.probe_every:
            self._idle["cpu"] = 0
            return 1
        if n >= 2 and self._idle["copy"] >= self.probe_every:  # half the misses: one copy alone would be
            self._idle["copy"] = 0  # timed with a batch's fixed costs and make the link look slower than it is
            return n - n // 2
        return on_cpu

    def observe_step(self, seconds: float, misses: int) -> None:
        """A decode layer-step took `seconds`, waits included, with `misses` experts the cache lacked."""
        if self.guard is not None:
            self.guard.observe(seconds, misses)

    def describe(self) -> str:
        """The current model (and the median of its latest raw samples), for logs and benchmark diagnostics."""
        def seen(kind: str, unit: str) -> str:
            r = self.recent[kind]
            return f" (latest {len(r)}: median {statistics.median(r):.1f} {unit})" if r else ""

        return (f"copy {self.copy.gb_s:.1f} GB/s + {self.copy.fixed * 1e6:.0f} µs{seen('copy', 'GB/s')}, "
                f"CPU {self.cpu.gb_s:.1f} GB/s + {self.cpu.fixed * 1e6:.0f} µs{seen('cpu', 'GB/s')}, "
                f"queueing {self.issue.fixed * 1e6:.0f} µs + {self.issue.per_copy * 1e6:.1f} µs a copy"
                f"{seen('issue', 'µs a copy')}" + (f"; {self.guard.describe()}" if self.guard else ""))

    def observe_copy(self, nbytes: int, seconds: float) -> None:
        if self.learn:
            self.copy.observe(nbytes, seconds)
            self.recent["copy"].append(nbytes / seconds / 1e9 if seconds > 0 else 0.0)

    @property
    def issue_s(self) -> float:
        """Host seconds to queue one more copy (the per-copy part of the issue model)."""
        return self.issue.per_copy

    def observe_issue(self, copies: int, seconds: float) -> None:
        """The host took `seconds` to queue `copies` copies."""
        if self.learn and copies:
            self.recent["issue"].append(seconds / copies * 1e6)
            self.issue.observe(copies, seconds)

    def observe_cpu(self, nbytes: int, seconds: float) -> None:
        if self.learn:
            self.cpu.observe(nbytes, seconds)
            self.recent["cpu"].append(nbytes / seconds / 1e9 if seconds > 0 else 0.0)
