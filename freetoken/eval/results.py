"""The result of one replay (`freetoken-eval-result`, version 1): every turn's measurements, the run's summary,
and the terminal table. The JSON is what `ft eval compare` and the report read."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from freetoken.errors import FreeTokenError

FORMAT, VERSION = "freetoken-eval-result", 1


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100) of `values`, None when empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(turns: list[dict], reference: list[dict], wall_s: float) -> dict[str, Any]:
    ok = [t for t in turns if t["error"] is None]
    ttft = [t["ttft_s"] for t in ok if t["ttft_s"] is not None]
    decode = [t["decode_tok_s"] for t in ok if t["decode_tok_s"]]
    prefill = [t["prefill_tok_s"] for t in ok if t["prefill_tok_s"]]
    long_ref = [r for r in reference if r.get("prompt") == "long"]  # over a long prompt (--reference-context)
    reference = [r for r in reference if r.get("prompt") != "long"]  # the short ones (all, in older results)
    ref = [r["decode_tok_s"] for r in reference if r.get("decode_tok_s")]  # before and after the trace
    sides = {side: [r["decode_tok_s"] for r in reference if r.get("decode_tok_s") and r.get("when") == side]
             for side in ("before", "after")}
    prompt = sum(t["prompt_tokens"] or 0 for t in ok)
    cached = sum(t["cached_tokens"] or 0 for t in ok)
    decode_median = statistics.median(decode) if decode else None
    ref_median = statistics.median(ref) if ref else None
    host = [t["host"] for t in ok if t.get("host")]  # this machine's CPUs during each turn (a local endpoint)
    # past each reply's first pieces (results of older runs lack it): a gap only here is spread over the reply,
    # one only in the plain ratio sits at the replies' starts
    steady = [t["steady_decode_tok_s"] for t in ok if t.get("steady_decode_tok_s")]
    ref_steady = [r["steady_decode_tok_s"] for r in reference if r.get("steady_decode_tok_s")]
    steady_median = statistics.median(steady) if steady else None
    ref_steady_median = statistics.median(ref_steady) if ref_steady else None
    long_rates = [r["decode_tok_s"] for r in long_ref if r.get("decode_tok_s")]
    long_median = statistics.median(long_rates) if long_rates else None
    long_prompt = [r["prompt_tokens"] for r in long_ref if r.get("prompt_tokens")]
    return {
        "turns": len(turns), "ok": len(ok), "errors": len(turns) - len(ok), "wall_s": round(wall_s, 3),
        "ttft_p50_s": percentile(ttft, 50), "ttft_p95_s": percentile(ttft, 95), "ttft_max_s": max(ttft, default=None),
        "ttft_mean_s": statistics.fmean(ttft) if ttft else None,
        "prefill_tok_s_median": statistics.median(prefill) if prefill else None,
        "decode_tok_s_median": decode_median, "single_turn_decode_tok_s": ref_median,
        "single_turn_before_tok_s": statistics.median(sides["before"]) if sides["before"] else None,
        "single_turn_after_tok_s": statistics.median(sides["after"]) if sides["after"] else None,
        "decode_vs_single_turn": decode_median / ref_median if decode_median and ref_median else None,
        "steady_decode_tok_s_median": steady_median, "single_turn_steady_decode_tok_s": ref_steady_median,
        "steady_decode_vs_single_turn": steady_median / ref_steady_median
        if steady_median and ref_steady_median else None,
        "long_reference_prompt_tokens": statistics.median(long_prompt) if long_prompt else None,
        "single_turn_long_decode_tok_s": long_median,
        "decode_vs_single_turn_long": decode_median / long_median if decode_median and long_median else None,
        "prompt_tokens": prompt, "cached_tokens": cached, "cached_share": cached / prompt if prompt else None,
        "output_tokens": sum(t["output_tokens"] or 0 for t in ok),
        "host_busy_median": statistics.median(h["busy"] for h in host) if host else None,
        "host_busy_max": max((h["busy"] for h in host), default=None),
        "host_steal_max": max((h["steal"] for h in host), default=None),
    }


def write_result(result: dict, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "result.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


def read_result(path: str | Path) -> dict:
    path = Path(path)
    if path.is_dir():
        path = path / "result.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise FreeTokenError(f"cannot read the result {path}: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FreeTokenError(f"{path} is not an ft eval result (not JSON: {e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise FreeTokenError(f"{path} is not an ft eval result (no \"format\": \"{FORMAT}\")")
    if data.get("version") != VERSION:
        raise FreeTokenError(f"{path} is result version {data.get('version')!r}; this freetoken reads {VERSION}")
    return data


def _num(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def turn_table(turns: list[dict]) -> str:
    """Per-turn lines (markdown-style, readable in a terminal): in trace order for each replica."""
    head = "| replica | turn | label | prompt | cached | new | out | TTFT s | prefill tok/s | decode tok/s | error |"
    rows = [head, "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for t in turns:
        rows.append(f"| {t['replica']} | {t['id']} | {t['label']} | {t['prompt_tokens'] or '—'} | "
                    f"{t['cached_tokens'] if t['cached_tokens'] is not None else '—'} | {t['new_prompt_tokens'] or '—'}"
                    f" | {t['output_tokens'] or '—'} | {_num(t['ttft_s'], 3)} | {_num(t['prefill_tok_s'], 0)} | "
                    f"{_num(t['decode_tok_s'], 1)} | {(t['error'] or '')[:60]} |")
    return "\n".join(rows)


def _sides(summary: dict) -> str:
    """The references' medians before and after the trace, where both were measured (results of older runs
    lack them)."""
    before, after = summary.get("single_turn_before_tok_s"), summary.get("single_turn_after_tok_s")
    return "" if before is None or after is None else f" (before {before:.1f}, after {after:.1f})"


def summary_table(summary: dict) -> str:
    share = summary["cached_share"]
    ratio = summary["decode_vs_single_turn"]
    rows = [("turns (ok / errors)", f"{summary['ok']} / {summary['errors']}"),
            ("TTFT p50 / p95 / max s", f"{_num(summary['ttft_p50_s'], 3)} / {_num(summary['ttft_p95_s'], 3)} / "
                                       f"{_num(summary['ttft_max_s'], 3)}"),
            ("prefill tok/s (median)", _num(summary["prefill_tok_s_median"], 0)),
            ("decode tok/s (median)", _num(summary["decode_tok_s_median"], 1)),
            ("single-turn decode tok/s", _num(summary["single_turn_decode_tok_s"], 1) + _sides(summary)),
            ("decode vs single turn", "—" if ratio is None else f"{ratio:.3f}×"),
            *([("  past each reply's first pieces", f"{summary['steady_decode_vs_single_turn']:.3f}× "
                f"({summary['steady_decode_tok_s_median']:.1f} against "
                f"{summary['single_turn_steady_decode_tok_s']:.1f} tok/s)")]
              if summary.get("steady_decode_vs_single_turn") else []),
            *([(f"single turn at {summary['long_reference_prompt_tokens']:,.0f} tokens of context",
                f"{summary['single_turn_long_decode_tok_s']:.1f} tok/s; decode vs it "
                f"{summary['decode_vs_single_turn_long']:.3f}×")]
              if summary.get("decode_vs_single_turn_long") else []),
            ("prompt tokens (cached)", f"{summary['prompt_tokens']:,} ({'—' if share is None else f'{share:.1%}'})"),
            ("output tokens", f"{summary['output_tokens']:,}"),
            ("wall s", _num(summary["wall_s"], 1))]
    if summary.get("host_busy_median") is not None:  # results of older runs, or a remote endpoint, lack it
        rows.append(("host CPUs during turns", f"busy {summary['host_busy_median']:.0%} median, "
                                               f"{summary['host_busy_max']:.0%} max; steal "
                                               f"{summary['host_steal_max']:.1%} max"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
