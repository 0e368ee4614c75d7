"""A replay's report: three plots as PNG (TTFT per turn, decode tok/s per turn, TTFT CDF) and one self-contained
HTML file (the plots inlined, the summary and every turn); `compare_plot` draws several runs on one figure."""

from __future__ import annotations

import base64
import html
from pathlib import Path

from freetoken.eval.results import summary_table, turn_table


def _pyplot():
    import logging

    import matplotlib

    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # its font-cache notice on first use
    matplotlib.use("Agg")  # files only: no display needed, none opened
    import matplotlib.pyplot as plt

    return plt


def _by_replica(result: dict) -> dict[int, list[dict]]:
    """Each replica's turns in trace order."""
    order = {ident: i for i, ident in enumerate(result["trace"]["turn_ids"])}
    out: dict[int, list[dict]] = {}
    for t in result["turns"]:
        out.setdefault(t["replica"], []).append(t)
    return {r: sorted(ts, key=lambda t: order.get(t["id"], 0)) for r, ts in sorted(out.items())}


def _per_turn(ax, result: dict, key: str, label: str | None = None) -> None:
    ids = result["trace"]["turn_ids"]
    for replica, turns in _by_replica(result).items():
        xs = [ids.index(t["id"]) + 1 for t in turns if t.get(key) is not None]
        ys = [t[key] for t in turns if t.get(key) is not None]
        name = label if label is not None else (f"replica {replica}" if len(_by_replica(result)) > 1 else None)
        ax.plot(xs, ys, marker="o", markersize=3, linewidth=1, label=name)
        failed = [ids.index(t["id"]) + 1 for t in turns if t["error"]]
        if failed:
            ax.scatter(failed, [0] * len(failed), marker="x", color="red", zorder=3,
                       label="failed" if replica == 0 else None)
    ax.set_xlabel("turn (trace order)")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)


def _cdf(ax, result: dict, label: str | None = None) -> None:
    xs = sorted(t["ttft_s"] for t in result["turns"] if t["ttft_s"] is not None)
    if xs:
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=label)
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("share of turns")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)


def _title(result: dict) -> str:
    return f"{result['trace']['name']} · {result['label']}"


def plots(result: dict, out: Path) -> dict[str, Path]:
    plt = _pyplot()
    paths = {}
    for name, title, draw, ylabel in (
            ("ttft_per_turn", "TTFT per turn", lambda ax: _per_turn(ax, result, "ttft_s"), "TTFT (s)"),
            ("decode_per_turn", "decode per turn", lambda ax: _per_turn(ax, result, "decode_tok_s"), "decode tok/s"),
            ("ttft_cdf", "TTFT CDF", lambda ax: _cdf(ax, result), None)):
        fig, ax = plt.subplots(figsize=(7, 3.6), dpi=110)
        draw(ax)
        if ylabel:
            ax.set_ylabel(ylabel)
        summary = result["summary"]
        reference, long = summary["single_turn_decode_tok_s"], summary.get("single_turn_long_decode_tok_s")
        if name == "decode_per_turn" and reference:
            ax.axhline(reference, linestyle="--", color="gray", linewidth=1, label="single turn")
        if name == "decode_per_turn" and long:
            ax.axhline(long, linestyle=":", color="gray", linewidth=1,
                       label=f"single turn, {summary['long_reference_prompt_tokens']:,.0f}-token prompt")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        ax.set_title(f"{_title(result)}: {title}", fontsize=9)
        fig.tight_layout()
        paths[name] = out / f"{name}.png"
        fig.savefig(paths[name])
        plt.close(fig)
    return paths


def write_report(result: dict, out: Path) -> Path:
    """The PNGs and report.html under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    images = plots(result, out)
    info = [("trace", f"{result['trace']['name']} ({result['trace']['source']})"), ("endpoint", result["endpoint"]),
            ("model", result["model"]), ("protocol", result["protocol"]), ("concurrency", result["concurrency"]),
            ("fixed output lengths", result["fixed_output"]), ("think time", result["think"]),
            ("started", result["started_at"]), ("freetoken", result["freetoken"])]
    rows = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>" for k, v in info)
    figures = "".join(f'<figure><img alt="{n}" src="data:image/png;base64,'
                      f'{base64.b64encode(p.read_bytes()).decode()}"></figure>' for n, p in images.items())
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(_title(result))}</title>
<style>body{{font:14px system-ui,sans-serif;margin:2em;max-width:1100px}}table{{border-collapse:collapse}}
th,td{{padding:2px 8px;text-align:left;border-bottom:1px solid #ddd}}pre{{background:#f6f6f6;padding:1em;
overflow-x:auto}}figure{{display:inline-block;margin:0 1em 1em 0}}img{{max-width:100%}}</style></head><body>
<h1>ft eval: {html.escape(_title(result))}</h1><table>{rows}</table>
<h2>Summary</h2><pre>{html.escape(summary_table(result["summary"]))}</pre>
<h2>Plots</h2>{figures}
<h2>Turns</h2><pre>{html.escape(turn_table(result["turns"]))}</pre></body></html>
"""
    path = out / "report.html"
    path.write_text(page, encoding="utf-8")
    return path


def compare_plot(results: list[dict], path: Path) -> Path:
    """TTFT per turn, decode tok/s per turn and the TTFT CDF of every run, one figure."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4), dpi=110)
    for result in results:
        name = _title(result)
        _per_turn(axes[0], result, "ttft_s", name)
        _per_turn(axes[1], result, "decode_tok_s", name)
        _cdf(axes[2], result, name)
    axes[0].set_ylabel("TTFT (s)")
    axes[1].set_ylabel("decode tok/s")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
