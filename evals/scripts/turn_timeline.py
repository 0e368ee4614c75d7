"""What the GPU and the link do while the host works through an offloaded turn, layer by layer, from the Chrome
trace that `profile_turn.py --trace FILE` writes.

    python evals/scripts/turn_timeline.py TRACE.json.gz [--skip 2]

A layer's window runs from the host entering its MoE layer to entering the next one. Per window: the host's own
phases (the routing wait, streaming the next layer, the sorted pass's launches), and how busy the compute stream,
the link (host-to-device copies) and the copy stream's kernels (dequantizing launches) were, as shares of the
window and of the routing wait. A routing wait with an idle compute stream is the GPU waiting for copies; a busy
one is the GPU's own work. Then the kernels that filled the compute stream during the routing waits.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import statistics


def _load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "dur" in e]


def _stream(e: dict):
    return e.get("args", {}).get("stream", e.get("tid"))


def _busy(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of `intervals` (sorted by start) within [lo, hi]."""
    total, end = 0.0, lo
    for s, e in intervals:
        s, e = max(s, end), min(e, hi)
        if e > s:
            total += e - s
            end = e
        if s >= hi:
            break
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("--skip", type=int, default=2, help="layers left out at each end (the first streams nothing)")
    a = p.parse_args()
    events = _load(a.trace)
    host = collections.defaultdict(list)
    for e in events:
        if e.get("cat") == "user_annotation" and e["name"].startswith("ft."):
            host[e["name"][3:]].append((e["ts"], e["ts"] + e["dur"]))
    for ranges in host.values():
        ranges.sort()
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    memcpy_time = collections.Counter()
    for e in gpu:
        if e["cat"] == "gpu_memcpy":
            memcpy_time[_stream(e)] += e["dur"]
    copy_stream = memcpy_time.most_common(1)[0][0]
    kernel_time = collections.Counter()
    for e in gpu:
        if e["cat"] == "kernel" and _stream(e) != copy_stream:
            kernel_time[_stream(e)] += e["dur"]
    compute_stream = kernel_time.most_common(1)[0][0]

    def intervals(stream, cat):
        return sorted((e["ts"], e["ts"] + e["dur"]) for e in gpu if _stream(e) == stream and e["cat"] == cat)

    compute, link, dequant = (intervals(compute_stream, "kernel"), intervals(copy_stream, "gpu_memcpy"),
                              intervals(copy_stream, "kernel"))
    layers = host["layer"]
    rows = []
    in_wait = collections.Counter()
    for (start, _), (nxt, _) in list(zip(layers, layers[1:], strict=False))[a.skip:len(layers) - 1 - a.skip]:
        window = nxt - start
        inside = {name: [(s, e) for s, e in host.get(name, []) if start <= s < nxt]
                  for name in ("routing_wait", "stream_next", "compute_sorted")}
        waits = inside["routing_wait"]
        wait = sum(e - s for s, e in waits)
        row = dict(window=window, wait=wait,
                   stream_next=sum(e - s for s, e in inside["stream_next"]),
                   sorted=sum(e - s for s, e in inside["compute_sorted"]),
                   compute=_busy(compute, start, nxt) / window, link=_busy(link, start, nxt) / window,
                   dequant=_busy(dequant, start, nxt) / window,
                   compute_in_wait=sum(_busy(compute, s, e) for s, e in waits) / wait if wait else 0.0,
                   link_in_wait=sum(_busy(link, s, e) for s, e in waits) / wait if wait else 0.0)
        rows.append(row)
        for s, e in waits:
            for k in gpu:
                if k["cat"] == "kernel" and _stream(k) == compute_stream and k["ts"] < e and k["ts"] + k["dur"] > s:
                    in_wait[k["name"][:70]] += min(e, k["ts"] + k["dur"]) - max(s, k["ts"])
    print(f"{a.trace}: {len(layers)} MoE layers, {len(rows)} shown; compute stream {compute_stream}, copy stream "
          f"{copy_stream}")
    print("| layer window µs | routing wait µs | stream next µs | sorted pass µs | compute busy | link busy | "
          "dequant busy | compute busy in wait | link busy in wait |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['window']:.0f} | {r['wait']:.0f} | {r['stream_next']:.0f} | {r['sorted']:.0f} | "
              f"{r['compute']:.0%} | {r['link']:.0%} | {r['dequant']:.0%} | {r['compute_in_wait']:.0%} | "
              f"{r['link_in_wait']:.0%} |")
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print(f"| **median {med['window']:.0f}** | {med['wait']:.0f} | {med['stream_next']:.0f} | {med['sorted']:.0f} | "
          f"{med['compute']:.0%} | {med['link']:.0%} | {med['dequant']:.0%} | {med['compute_in_wait']:.0%} | "
          f"{med['link_in_wait']:.0%} |")
    total_wait = sum(r["wait"] for r in rows)
    print("compute-stream kernels during the routing waits (share of the waits' time):")
    for name, t in in_wait.most_common(8):
        print(f"  {t / total_wait:6.1%}  {name}")


if __name__ == "__main__":
    main()
