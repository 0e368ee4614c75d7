"""The dashboard's panels: one widget each, drawn from one `/v1/stats` answer and the rates between answers.

Every read goes through `dig`, so a missing or malformed field shows as "—" instead of raising: the stats of an
older server, a dense model (no experts) or a CPU-only one draw the same panels with less in them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from rich.text import Text
from textual.widgets import Static

SPARK = "▁▂▃▄▅▆▇█"
HISTORY = 120  # rate samples kept for the sparklines (two minutes at one poll a second)


def dig(stats: object, *path: str, default: object = None) -> object:
    for key in path:
        if not isinstance(stats, dict) or key not in stats:
            return default
        stats = stats[key]
    return stats


def num(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def gib(nbytes: object) -> str:
    n = num(nbytes)
    return "—" if n is None else f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def fmt(value: object, spec: str = ".1f", suffix: str = "") -> str:
    n = num(value)
    return "—" if n is None else f"{n:{spec}}{suffix}"


def rate(bytes_per_s: float | None) -> str:
    if bytes_per_s is None:
        return "—"
    return f"{bytes_per_s / 1e9:.1f} GB/s" if bytes_per_s >= 1e8 else f"{bytes_per_s / 1e6:.1f} MB/s"


def sparkline(values: Sequence[float], width: int) -> str:
    values = list(values)[-width:]
    top = max(values, default=0.0)
    if top <= 0:
        return SPARK[0] * len(values)
    return "".join(SPARK[min(len(SPARK) - 1, int(v / top * (len(SPARK) - 1) + 0.5))] for v in values)


class Rates:
    """Per-second rates of the stats' counters between consecutive answers, kept for the sparklines."""

    COUNTERS = {
        "decode": ("activity", "tokens_generated"),
        "prefill": ("activity", "tokens_prefilled"),
        "pcie": ("engine", "experts", "bytes_copied"),
    }

    def __init__(self) -> None:
        self.last: tuple[float, dict] | None = None
        self.series: dict[str, deque] = {name: deque(maxlen=HISTORY) for name in (*self.COUNTERS, "cpu")}

    def add(self, t: float, stats: dict) -> None:
        if self.last is not None and t > self.last[0]:
            dt, before = t - self.last[0], self.last[1]
            for name, path in self.COUNTERS.items():
                self.series[name].append(self._delta(before, stats, path) / dt)
            cpu_bytes = num(dig(stats, "engine", "experts", "host_bytes_per_expert")) or 0.0
            self.series["cpu"].append(self._delta(before, stats, ("engine", "experts", "cpu_experts")) * cpu_bytes
                                      / dt)
        self.last = (t, stats)

    @staticmethod
    def _delta(before: dict, after: dict, path: tuple[str, ...]) -> float:
        a, b = num(dig(before, *path)), num(dig(after, *path))
        return max(0.0, b - a) if a is not None and b is not None else 0.0  # a restart resets the counters

    def now(self, name: str) -> float | None:
        return self.series[name][-1] if self.series[name] else None


class Panel(Static):
    """A bordered panel whose body is redrawn from the stats; each subclass draws its own body."""

    def __init__(self, title: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.border_title = title
        self.text = Text()  # what it shows now

    def show(self, stats: dict, rates: Rates) -> None:
        self.text = self.render_body(stats if isinstance(stats, dict) else {}, rates)
        self.update(self.text)

    def render_body(self, stats: dict, rates: Rates) -> Text:
        """The panel's text for one stats answer. Abstract: each panel below draws its own (Textual's widget
        metaclass rules out `abc`), and the base class is never mounted."""
        raise NotImplementedError(f"{type(self).__name__} must define render_body")


class VramPanel(Panel):
    PARTS = (("weights", "blue"), ("experts", "magenta"), ("kv", "green"), ("activations", "yellow"),
             ("other", "grey50"))  # other processes (or, on the host, the rest of the system)

    def render_body(self, stats: dict, rates: Rates) -> Text:
        memory = dig(stats, "engine", "memory", default={})
        total = num(dig(memory, "total"))
        self.border_title = f"Memory ({dig(memory, 'device', default='—')}, {gib(total)})"
        text = Text()
        width = max(10, self.size.width)
        if not total:
            return text.append("no memory figures from this server", style="dim")
        used = 0
        for name, color in self.PARTS:
            cells = int(round((num(dig(memory, name)) or 0) / total * width))
            text.append("█" * min(cells, width - used), style=color)
            used += min(cells, width - used)
        text.append("░" * (width - used), style="dim")
        text.append("\n")
        for name, color in self.PARTS:
            label = "other (NVML)" if name == "other" and dig(memory, "other_from") == "nvml" else name
            text.append("■ ", style=color).append(f"{label} {gib(dig(memory, name))}  ")
        return text.append(f"free {gib(dig(memory, 'free'))}", style="dim")


class ThroughputPanel(Panel):
    def render_body(self, stats: dict, rates: Rates) -> Text:
        width = max(8, self.size.width - 24)
        text = Text()
        for name, label in (("decode", "decode"), ("prefill", "prefill")):
            text.append(f"{label:<8}{fmt(rates.now(name), '>8.1f')} tok/s ")
            text.append(sparkline(rates.series[name], width) + "\n", style="cyan")
        activity = dig(stats, "activity", default={})
        requests = dig(stats, "requests", default={})
        text.append(f"TTFT p50 {fmt(dig(activity, 'ttft_p50_s'), '.2f', ' s')}  "
                    f"p95 {fmt(dig(activity, 'ttft_p95_s'), '.2f', ' s')}   "
                    f"done {fmt(dig(requests, 'completed'), '.0f')}  "
                    f"failed {fmt(dig(requests, 'failed'), '.0f')}")
        drafts = dig(stats, "drafts")
        if isinstance(drafts, dict):  # `ft serve --speculative`: how often the MTP layer's draft was picked
            proposed, accepted = num(drafts.get("proposed")) or 0, num(drafts.get("accepted")) or 0
            share = f" ({accepted / proposed:.0%})" if proposed else ""
            text.append(f"\ndrafts {accepted:.0f}/{proposed:.0f} accepted{share}")
        return text


class TrafficPanel(Panel):
    def render_body(self, stats: dict, rates: Rates) -> Text:
        ex = dig(stats, "engine", "experts", default={})
        text = Text()
        if dig(ex, "mode") != "offloaded":
            return text.append(f"experts {dig(ex, 'mode', default='—')}: no traffic", style="dim")
        misses, cpu = num(dig(ex, "misses")) or 0, num(dig(ex, "cpu_experts")) or 0
        prefetched, used = num(dig(ex, "prefetched")) or 0, num(dig(ex, "prefetch_used")) or 0
        pcie, host = rates.now("pcie"), rates.now("cpu")
        text.append(f"PCIe {rate(pcie)}   CPU experts {rate(host)}\n")
        text.append(f"misses {misses:.0f}: {100 * (1 - cpu / misses) if misses else 0:.0f}% copied, "
                    f"{100 * cpu / misses if misses else 0:.0f}% CPU · "
                    f"prefetch {100 * used / prefetched if prefetched else 0:.0f}% used\n")
        ways = dig(ex, "guard_seconds_per_miss", default={})
        ways = ways if isinstance(ways, dict) else {}
        measured = "  ".join(f"{w} {fmt(None if num(s) is None else num(s) * 1e6, '.0f', ' µs')}"
                             for w, s in ways.items())
        bias = num(dig(ex, "guard_bias")) or 0
        way = f"{dig(ex, 'guard_way', default='')}{f'{bias:+.0f}' if bias else ''}"
        return text.append(f"path {dig(ex, 'miss_path', default='—')} {way}  "
                           f"{measured}", style="dim")


class ExpertPanel(Panel):
    cursor = 0  # the grid row the pin key acts on (j / k move it)

    def render_body(self, stats: dict, rates: Rates) -> Text:
        ex = dig(stats, "engine", "experts", default={})
        text = Text()
        if dig(ex, "mode") in (None, "none"):
            return text.append("a dense model: no experts", style="dim")
        hits, misses = num(dig(ex, "hits")), num(dig(ex, "misses"))
        hit = hits / (hits + misses) if hits is not None and misses is not None and hits + misses else None
        self.border_title = (f"Experts {dig(ex, 'cached', default='—')}/{dig(ex, 'total_experts', default='—')} "
                             f"on device · hit {fmt(None if hit is None else 100 * hit, '.0f', '%')}")
        grid, rates_ = dig(ex, "grid", default=[]), dig(ex, "layer_hit_rate", default=[])
        if not isinstance(grid, list):
            return text.append("no expert grid from this server", style="dim")
        room, width = max(1, self.size.height - 1), max(4, self.size.width - 12)  # a line for the legend
        layers, pinned = dig(ex, "grid_layers", default=[]), dig(ex, "pinned_layers", default=[])
        layers = layers if isinstance(layers, list) and len(layers) == len(grid) else list(range(len(grid)))
        pinned = set(pinned) if isinstance(pinned, list) else set()
        first = min(max(0, self.cursor - room + 2), max(0, len(grid) - room + 1)) if len(grid) > room else 0
        shown = grid if len(grid) <= room else grid[first:first + room - 1]
        for i, row in enumerate(shown, start=first):
            rate = rates_[i] if isinstance(rates_, list) and i < len(rates_) else None
            marker = ">" if i == self.cursor else " "
            text.append(f"{marker}L{layers[i]!s:<3}", style="bold" if i == self.cursor else "")
            text.append("*" if layers[i] in pinned else " ", style="magenta")
            text.append(f"{fmt(None if num(rate) is None else 100 * num(rate), '>3.0f', '%')} ")
            for cell in str(row)[:width]:
                text.append("■" if cell == "#" else "▪" if cell == "+" else "·",
                            style="magenta" if cell == "#" else "yellow" if cell == "+" else "dim")
            text.append("\n")
        if len(shown) < len(grid):
            text.append(f"… {len(grid) - len(shown)} more layers (j/k)\n", style="dim")
        return text.append("■ on device  ▪ hot  · cold  * pinned", style="dim")


def tree_lines(nodes: object, indent: str = "", first: bool = True) -> list[str]:
    """The prefix cache's tree as indented lines: a node's tokens, "+N" under a fork (what that branch adds)."""
    lines = []
    nodes = nodes if isinstance(nodes, list) else []
    for i, n in enumerate(nodes):
        last = i == len(nodes) - 1
        more = num(dig(n, "more"))
        label = f"… {more:.0f} more" if more is not None else \
            f"{'' if first else '+'}{fmt(dig(n, 'tokens'), ',.0f')} tokens"
        lines.append(f"{indent}{'└' if last else '├'} {label}")
        lines += tree_lines(dig(n, "children", default=[]), indent + ("  " if last else "│ "), first=False)
    return lines


class SessionsPanel(Panel):
    def render_body(self, stats: dict, rates: Rates) -> Text:
        kv = dig(stats, "engine", "kv", default={})
        pages, free = num(dig(kv, "pages_total")), num(dig(kv, "pages_free"))
        text = Text(f"KV pages {fmt(None if pages is None or free is None else pages - free, '.0f')}/"
                    f"{fmt(pages, '.0f')} used, {fmt(dig(kv, 'pages_cached'), '.0f')} cached; "
                    f"reused {fmt(dig(kv, 'prefix_hit_tokens'), '.0f')} prompt tokens\n")
        running = dig(stats, "activity", "running", default=[])
        running = running if isinstance(running, list) else []
        room = max(1, self.size.height - 1)
        if not running:
            text.append("no request running\n", style="dim")
        for r in running[:room]:
            text.append(f"#{dig(r, 'id', default='?')}  prompt {fmt(dig(r, 'prompt_tokens'), '.0f')} "
                        f"({fmt(dig(r, 'cached_tokens'), '.0f')} cached)  "
                        f"generated {fmt(dig(r, 'generated'), '.0f')}  {fmt(dig(r, 'seconds'), '.1f', ' s')}\n")
        tree = tree_lines(dig(kv, "prefix_tree", default=[]))
        if tree:  # the cached conversations and where they fork: what a new prompt can start from
            text.append("cached prefixes\n", style="bold")
            for line in tree[:max(0, room - len(running) - 2)]:
                text.append(line + "\n", style="dim")
        return text


class LogPanel(Panel):
    """The server's answered requests, and the app's own messages (actions, disconnects)."""

    def __init__(self, title: str, **kwargs) -> None:
        super().__init__(title, **kwargs)
        self.notes: deque[tuple[str, str]] = deque(maxlen=32)

    def note(self, message: str, style: str = "") -> None:
        self.notes.append((message, style))

    def render_body(self, stats: dict, rates: Rates) -> Text:
        lines: list[tuple[str, str]] = []
        log = dig(stats, "activity", "log", default=[])
        for entry in log if isinstance(log, list) else []:
            status = num(dig(entry, "status")) or 0
            lines.append((f"{dig(entry, 'method', default='?')} {dig(entry, 'path', default='?')} "
                          f"{status:.0f} in {fmt(dig(entry, 'seconds'), '.2f', ' s')}",
                          "red" if status >= 400 else ""))
        lines += list(self.notes)
        text = Text()
        for message, style in lines[-max(1, self.size.height):]:
            text.append(message + "\n", style=style)
        return text
