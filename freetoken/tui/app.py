"""`ft top`: the live dashboard of a running engine (Textual).

Data flows one way: a poller fetches `/v1/stats` once a second (in a thread, so the screen never waits on the
network), the rates between answers are updated, and each panel redraws itself from the answer. An unreachable
server is said so in the status line and polled again (a restarted server is picked up by itself). Actions (the
resize keys) go to the server's admin routes; their result or error lands in the log panel.
"""

from __future__ import annotations

import asyncio
import time

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Footer, Static

from freetoken.tui.panels import (
    ExpertPanel,
    LogPanel,
    Rates,
    SessionsPanel,
    ThroughputPanel,
    TrafficPanel,
    VramPanel,
    dig,
    gib,
    num,
)
from freetoken.tui.source import ActionFailed, Unreachable

HELP = """[b]ft top[/b] — a running freetoken server, live

[b]+[/b]  grow the expert cache one step (from free memory, else the KV pool)
[b]-[/b]  shrink it one step, giving the memory to the KV pool
[b]j[/b] / [b]k[/b]  move the layer cursor   [b]x[/b]  pin / unpin that layer's experts
[b]p[/b]  pause / resume updates      [b]r[/b]  poll now
[b]?[/b]  this help                   [b]q[/b]  quit

Grid: ■ expert on the device, ▪ routed to lately but not on it, · cold;
* a pinned layer (its experts stay on the device until unpinned).
A step is 1/16 of the model's routed experts (whole slots).
Press any key to close."""


class HelpScreen(ModalScreen):
    def compose(self) -> ComposeResult:
        yield Static(HELP)

    def on_key(self) -> None:
        self.dismiss()


class TopApp(App):
    CSS_PATH = "top.tcss"
    TITLE = "freetoken"
    BINDINGS = [
        Binding("plus,equals_sign", "grow_experts", "+experts"),
        Binding("minus", "shrink_experts", "-experts"),
        Binding("j", "layer(1)", "next layer", show=False),
        Binding("k", "layer(-1)", "previous layer", show=False),
        Binding("x", "pin", "pin layer"),
        Binding("p", "pause", "pause"),
        Binding("r", "poll", "poll now"),
        Binding("question_mark", "help", "help"),
        Binding("q", "quit", "quit"),
    ]

    def __init__(self, source, interval: float = 1.0, clock=time.monotonic):
        super().__init__()
        self.source, self.interval, self.clock = source, interval, clock
        self.stats: dict = {}
        self.rates = Rates()
        self.connected: bool | None = None  # None until the first answer or failure
        self.paused = False
        self.problem = ""

    def compose(self) -> ComposeResult:
        yield Static(id="status")
        yield VramPanel("Memory", id="memory")
        with Horizontal(id="middle"):
            with Vertical(id="left"):
                yield ThroughputPanel("Throughput", id="throughput")
                yield TrafficPanel("Traffic", id="traffic")
                yield SessionsPanel("Sessions", id="sessions")
            yield ExpertPanel("Expert cache", id="experts")
        yield LogPanel("Requests", id="log")
        yield Footer()

    async def on_mount(self) -> None:
        self.redraw()
        await self.poll()
        self.set_interval(self.interval, self.poll)

    async def poll(self) -> None:
        if self.paused:
            return
        try:
            stats = await asyncio.to_thread(self.source.fetch)
            if self._widgets_gone():
                return
            if not isinstance(stats, dict):
                raise Unreachable(f"{getattr(self.source, 'url', 'the server')} sent stats that are not an object")
        except Unreachable as e:
            if self._widgets_gone():
                return
            if self.connected is not False:
                self.log_panel.note(f"disconnected: {e}; retrying every {self.interval:g} s", "red")
            self.connected, self.problem = False, str(e)
        else:
            if self.connected is False:
                self.log_panel.note("reconnected", "green")
            self.connected, self.problem = True, ""
            self.stats = stats
            recorded = num(stats.get("_t"))  # recorded stats carry their own clock
            self.rates.add(self.clock() if recorded is None else recorded, stats)
        self.redraw()

    def _widgets_gone(self) -> bool:
        """The app quit while a fetch was in flight: its widgets are gone (a slow server, seen in CI)."""
        return not self.query("#status")

    @property
    def log_panel(self) -> LogPanel:
        return self.query_one(LogPanel)

    def redraw(self) -> None:
        state = "paused" if self.paused else {True: "live", False: "disconnected", None: "connecting"}[self.connected]
        model = dig(self.stats, "model", default="—")
        running, queued = dig(self.stats, "running", default="—"), dig(self.stats, "queued", default="—")
        line = f"{model} · {getattr(self.source, 'url', '')} · {state} · running {running} · queued {queued}"
        self.query_one("#status", Static).update(line + (f" · {self.problem}" if self.problem else ""))
        for panel in self.query("Panel"):
            panel.show(self.stats, self.rates)

    def on_resize(self) -> None:
        self.redraw()

    # -- actions --

    def action_pause(self) -> None:
        self.paused = not self.paused
        self.log_panel.note("updates paused" if self.paused else "updates resumed")
        self.redraw()

    async def action_poll(self) -> None:
        await self.poll()

    def action_layer(self, delta: int) -> None:
        grid = dig(self.stats, "engine", "experts", "grid", default=[])
        panel = self.query_one(ExpertPanel)
        panel.cursor = max(0, min(panel.cursor + delta, len(grid) - 1 if isinstance(grid, list) else 0))
        self.redraw()

    async def action_pin(self) -> None:
        """Pins the layer under the cursor (all its experts kept on the device), or unpins it."""
        ex = dig(self.stats, "engine", "experts", default={})
        layers, pinned = dig(ex, "grid_layers", default=[]), dig(ex, "pinned_layers", default=[])
        cursor = self.query_one(ExpertPanel).cursor
        if not isinstance(layers, list) or not 0 <= cursor < len(layers):
            self.log_panel.note("no expert grid from this server to pin a layer of", "red")
            self.redraw()
            return
        layer = layers[cursor]
        pin = layer not in (pinned if isinstance(pinned, list) else [])
        try:
            done = await asyncio.to_thread(self.source.pin, layer, pin)
        except (ActionFailed, Unreachable) as e:
            self.log_panel.note(f"pin refused: {e}", "red")
        else:
            self.log_panel.note(f"layer {layer} {'pinned' if pin else 'unpinned'}: {done.get('pinned_experts')} "
                                "experts pinned in all", "green")
        await self.poll()

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    async def action_grow_experts(self) -> None:
        await self._move(+1)

    async def action_shrink_experts(self) -> None:
        await self._move(-1)

    def _step_bytes(self) -> tuple[int, int, int] | None:
        ex, kv = dig(self.stats, "engine", "experts", default={}), dig(self.stats, "engine", "memory", default={})
        slot, total, slots = (num(dig(ex, k)) for k in ("slot_bytes", "total_experts", "slots"))
        if dig(ex, "mode") != "offloaded" or not slot or not total or slots is None:
            return None
        return int(slot * max(1, total // 16)), int(slot * slots), int(num(dig(kv, "kv")) or 0)

    async def _move(self, sign: int) -> None:
        """Moves one step of memory into or out of the expert cache (the KV pool shrinks first when it must give the
        room, so the device never holds both at once); says what happened in the log."""
        step = self._step_bytes()
        if step is None:
            self.log_panel.note("this server's experts are not offloaded (start it with --expert-cache SIZE)", "red")
            self.redraw()
            return
        size, experts, kv = step
        free = num(dig(self.stats, "engine", "memory", "free")) or 0
        try:
            if sign > 0:
                took_kv = free < size  # the device has no room of its own: the KV pool gives it
                if took_kv:
                    await asyncio.to_thread(self.source.resize_kv, kv - size)
                try:
                    done = await asyncio.to_thread(self.source.resize_experts, experts + size)
                except ActionFailed:
                    if took_kv:
                        await asyncio.to_thread(self.source.resize_kv, kv)  # give the KV its room back
                    raise
            else:  # what the expert cache gives goes to the KV pool (more context)
                done = await asyncio.to_thread(self.source.resize_experts, experts - size)
                await asyncio.to_thread(self.source.resize_kv, kv + (experts - int(done.get("bytes", experts))))
        except (ActionFailed, Unreachable) as e:
            self.log_panel.note(f"resize refused: {e}", "red")
        else:
            self.log_panel.note(f"expert cache now {gib(done.get('bytes'))} ({done.get('slots')} slots)", "green")
        await self.poll()
