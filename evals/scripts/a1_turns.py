"""Per-turn engine diagnostics of `ft eval` runs against `ft serve` (A1 results): for each turn its decode rate
beside what the server did in it (the path guard's way and windows, the CPU expert kernel's rate), so a slow turn
can be told from a turn that did more work.

    python evals/scripts/a1_turns.py RESULT.json [...]          a table per run, then its summary
    python evals/scripts/a1_turns.py --brief RESULT.json [...]  one line per run: turns by the guard's final way

A turn's windows are the path guard's measurement windows that closed during it (one decode token each): misses
a token, the median layer-step and its time per miss. "CPU GB/s" is the CPU expert kernel's rate over the turn's
decode steps. Results of servers without these counters print dashes.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
from pathlib import Path


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _num(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def turn_row(turn: dict) -> dict:
    """One turn's decode rate and the server's view of it."""
    engine = turn.get("engine") or {}
    windows = engine.get("guard_windows") or []  # [way, bias, µs per miss, layer-steps, misses, median µs]
    return {"id": turn["id"], "prompt": turn.get("prompt_tokens"), "decode": turn.get("decode_tok_s"),
            "way": engine.get("guard_way"), "misses": _median([w[4] for w in windows]),
            "layer_step_us": _median([w[5] for w in windows]),
            "per_miss_us": _median([w[2] for w in windows if w[2] is not None]),
            "cpu_gb_s": engine.get("step_cpu_gb_s")}


def correlation(xs: list[float], ys: list[float]) -> float | None:
    if len(xs) < 3 or len(set(xs)) < 2 or len(set(ys)) < 2:
        return None
    return statistics.correlation(xs, ys)


def report(path: Path) -> str:
    result = json.loads(path.read_text())
    rows = [turn_row(t) for t in result["turns"]]
    lines = [f"## {path}", "", "| turn | prompt tokens | decode tok/s | guard way | misses a token | layer-step µs | "
             "µs per miss | CPU GB/s |", "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['id']} | {r['prompt'] or '—'} | {_num(r['decode'])} | {r['way'] or '—'} | "
                     f"{_num(r['misses'], 0)} | {_num(r['layer_step_us'])} | {_num(r['per_miss_us'])} | "
                     f"{_num(r['cpu_gb_s'])} |")
    paired = [(r["decode"], r["cpu_gb_s"]) for r in rows if r["decode"] and r["cpu_gb_s"]]
    corr = correlation([p[0] for p in paired], [p[1] for p in paired])
    summary = result.get("summary", {})
    lines += ["", f"decode vs single turn {_num(summary.get('decode_vs_single_turn'), 3)}×; correlation of decode "
                  f"tok/s with CPU GB/s over the turns {_num(corr, 2)}", ""]
    return "\n".join(lines)


def brief(path: Path) -> str:
    """Turns by the path guard's way when they ended, with their median decode rate."""
    rates = collections.defaultdict(list)
    for turn in json.loads(path.read_text())["turns"]:
        if turn.get("decode_tok_s"):
            rates[(turn.get("engine") or {}).get("guard_way")].append(turn["decode_tok_s"])
    return "guard way at turn end: " + ", ".join(f"{way} {len(r)} turns at {statistics.median(r):.1f} tok/s"
                                                 for way, r in rates.items())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+", type=Path)
    p.add_argument("--brief", action="store_true", help="one line per run: turns by the guard's final way")
    a = p.parse_args()
    for path in a.results:
        print(brief(path) if a.brief else report(path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
