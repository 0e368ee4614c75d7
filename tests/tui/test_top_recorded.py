"""`ft top` from recorded stats: SVG snapshots at fixed terminal sizes, and stats that are missing, partial or
malformed (an older server, a dense model, a proxy's error page) drawn without a crash."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from freetoken.tui.app import TopApp
from freetoken.tui.panels import ExpertPanel, LogPanel, SessionsPanel, ThroughputPanel, TrafficPanel, VramPanel
from freetoken.tui.source import RecordedStats, Unreachable

RECORDED = json.loads((Path(__file__).parent / "recorded_stats.json").read_text())  # a tiny MoE server mid-request


def _app(frames) -> TopApp:
    return TopApp(RecordedStats(frames), interval=3600)  # no poll but the first and the ones a test makes


async def _second_frame(pilot) -> None:
    await pilot.app.poll()
    await pilot.pause()


@pytest.mark.parametrize("size", [(80, 24), (120, 40)])
def test_the_dashboard_at_a_fixed_size(size, snap_compare):
    assert snap_compare(_app(RECORDED), terminal_size=size, run_before=_second_frame)


def test_help_screen(snap_compare):
    async def help_open(pilot):
        await _second_frame(pilot)
        await pilot.press("question_mark")

    assert snap_compare(_app(RECORDED), terminal_size=(80, 24), run_before=help_open)


MALFORMED = [
    {},
    {"engine": "not an object", "activity": None, "requests": [1, 2], "model": 7},
    {"engine": {"experts": {"mode": "offloaded", "grid": "###", "hits": "many", "misses": None,
                            "guard_seconds_per_miss": [1]},
                "memory": {"total": "big", "weights": -1},
                "kv": {"pages_total": "x", "prefix_tree": [{"tokens": "a", "children": 3}, 5, {"more": "x"}]}},
     "activity": {"log": [1, "x", {"status": "bad"}], "running": [None, {"id": 1, "prompt_tokens": "?"}],
                  "tokens_generated": "lots"}},
    {"engine": {"experts": {"mode": "none"}, "memory": {"total": 0}}, "activity": {}},  # a dense model
    [1, 2, 3],
    {**RECORDED[1], "drafts": {"proposed": "x", "accepted": None}},
]


@pytest.mark.parametrize("frame", MALFORMED,
                         ids=["empty", "wrong-types", "partial", "dense", "not-an-object", "bad-drafts"])
def test_missing_or_malformed_stats_never_crash_a_panel(frame):
    async def scenario():
        app = _app([RECORDED[0], frame, RECORDED[1]])
        async with app.run_test(size=(80, 24)) as pilot:
            await app.poll()
            await pilot.pause()
            for panel in (VramPanel, ThroughputPanel, TrafficPanel, ExpertPanel, SessionsPanel, LogPanel):
                assert isinstance(app.query_one(panel).text.plain, str)
            await app.poll()  # good stats again: drawn again
            await pilot.pause()
            assert "tiny" in app.query_one("#status").render().plain

    asyncio.run(scenario())


def test_an_unreachable_source_is_said_and_the_next_answer_reconnects():
    async def scenario():
        app = _app([Unreachable("no answer from x (refused)"), RECORDED[0]])
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.pause()
            assert app.connected is False and "disconnected" in app.query_one("#status").render().plain
            await app.poll()
            await pilot.pause()
            assert app.connected and "reconnected" in app.query_one(LogPanel).text.plain

    asyncio.run(scenario())


def test_resize_on_a_source_that_refuses_says_why():
    async def scenario():
        app = _app(RECORDED)
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.press("plus")
            await pilot.pause()
            assert "resize refused: recorded stats" in app.query_one(LogPanel).text.plain

    asyncio.run(scenario())


@pytest.mark.parametrize("answer", [RECORDED[0], Unreachable("no answer from x (timed out)")])
def test_an_answer_arriving_after_the_app_quit_is_dropped(answer):
    """A slow server answers a poll after the app has quit and taken its widgets down: nothing is drawn and
    nothing raises (seen in CI as a NoMatches for the status line)."""
    import threading

    release = threading.Event()

    class Slow:
        url = "http://slow"

        def fetch(self):
            release.wait(10)
            if isinstance(answer, Exception):
                raise answer
            return answer

    async def scenario():
        app = TopApp(Slow(), interval=3600)
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.pause()
            late = asyncio.ensure_future(app.poll())
            await asyncio.sleep(0.05)
        release.set()  # the app's widgets are gone by now
        await late

    asyncio.run(scenario())


def test_a_speculative_servers_drafts_show_under_throughput():
    async def scenario():
        app = _app([RECORDED[0], {**RECORDED[1], "drafts": {"proposed": 40, "accepted": 31, "redone": 0}}])
        async with app.run_test(size=(120, 40)) as pilot:
            await app.poll()
            await pilot.pause()
            assert "drafts 31/40 accepted (78%)" in app.query_one(ThroughputPanel).text.plain

    asyncio.run(scenario())
