"""`ft eval compare A.json B.json …`: the runs' summaries side by side, each as a ratio to the first, and one
plot of them all."""

from __future__ import annotations

from freetoken.errors import FreeTokenError

# (summary key, row name, digits, whether higher is better)
METRICS = [("ttft_p50_s", "TTFT p50 s", 3, False), ("ttft_p95_s", "TTFT p95 s", 3, False),
           ("ttft_max_s", "TTFT max s", 3, False), ("prefill_tok_s_median", "prefill tok/s", 0, True),
           ("decode_tok_s_median", "decode tok/s", 1, True),
           ("decode_vs_single_turn", "decode vs single turn", 3, True),
           ("cached_share", "cached share", 3, True), ("wall_s", "wall s", 1, False), ("errors", "errors", 0, False)]


def compare_table(results: list[dict]) -> str:
    """Markdown table: a row per metric; per run its value and, after the first, its ratio to the first."""
    if len(results) < 2:
        raise FreeTokenError("ft eval compare needs at least two result files")
    names = [f"{r['trace']['name']} · {r['label']}" for r in results]
    head = "| metric | " + " | ".join(names) + " |"
    rows = [head, "| --- |" + " ---: |" * len(results)]
    for key, name, digits, higher_better in METRICS:
        base = results[0]["summary"].get(key)
        cells = []
        for i, r in enumerate(results):
            value = r["summary"].get(key)
            cell = "—" if value is None else f"{value:,.{digits}f}"
            if i and value is not None and base:
                ratio = value / base
                verdict = "" if abs(ratio - 1) < 0.02 else ", better" if (ratio > 1) == higher_better else ", worse"
                cell += f" ({ratio:.2f}×{verdict})"
            cells.append(cell)
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    traces = {r["trace"]["name"] for r in results}
    note = "" if len(traces) == 1 else "\n(different traces: per-turn ratios compare unlike turns)"
    return "\n".join(rows) + note
