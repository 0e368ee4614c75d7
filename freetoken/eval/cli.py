"""`ft eval`: replay multi-turn agent traces against an endpoint; tables, a JSON result, plots and an HTML report.

    ft eval --trace NAME|PATH [--endpoint URL] [--protocol auto|openai|responses|anthropic] [--concurrency N]
            [--out DIR] [--scale F] [--param KEY=VALUE] [--think] [--no-fixed-output] [-- SERVE-ARGS...]
    ft eval compare A.json B.json ... [--out FILE.png]
    ft eval generate NAME [--scale F] [--seed N] [--param KEY=VALUE] --out FILE.jsonl
    ft eval list

Without --endpoint the command starts its own `ft serve` (the arguments after `--`, e.g. `-- --model M
--expert-cache 8GiB`) on a free port and stops it at the end.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import sys
import time
from pathlib import Path

from freetoken import __version__
from freetoken.errors import FreeTokenError
from freetoken.eval import shapes
from freetoken.eval.trace import ROUTES, Trace, read_trace, write_trace

log = logging.getLogger("freetoken.eval")


def load_trace(spec: str, scale: float = 1.0, seed: int = 0, params: dict | None = None) -> tuple[Trace, str]:
    """A bundled trace by name (generated with these parameters) or a trace file; and where it came from."""
    if spec in shapes.names():
        return shapes.generate(spec, scale=scale, seed=seed, **(params or {})), f"generated: {spec}"
    if params or scale != 1.0:
        raise FreeTokenError("--scale and --param shape the bundled traces only; a trace file replays as written")
    path = Path(spec)
    if not path.exists():
        raise FreeTokenError(f"no trace {spec!r}: give a bundled trace ({', '.join(shapes.names())}) or the path "
                             "of a trace file")
    return read_trace(path), str(path)


def _params(pairs: list[str]) -> dict[str, float]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        try:
            if not sep:
                raise ValueError(pair)
            out[key] = float(value)
        except ValueError:
            raise FreeTokenError(f"--param {pair!r}: write KEY=NUMBER, e.g. --param turns=8") from None
    return out


def run(a: argparse.Namespace, serve_args: list[str]) -> int:
    from freetoken.eval.local_server import LocalServer

    trace, source = load_trace(a.trace, a.scale, a.seed, _params(a.param))
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(a.out or Path("ft-eval") / f"{trace.name}-{stamp}")
    headers = {"Authorization": f"Bearer {a.api_key}", "x-api-key": a.api_key} if a.api_key else {}
    if a.endpoint:
        if serve_args:
            raise FreeTokenError("arguments after -- go to the ft serve this command starts; with --endpoint "
                                 "there is none")
        return _replay(a, trace, source, out, a.endpoint.rstrip("/"), headers, started_server=None)
    with LocalServer(serve_args, out / "serve.log") as server:
        return _replay(a, trace, source, out, server.url, headers, started_server=serve_args)


def _replay(a, trace: Trace, source: str, out: Path, endpoint: str, headers: dict, started_server) -> int:
    from tqdm import tqdm

    from freetoken import host_load
    from freetoken.eval.replay import ReplayOptions, replay, served_model, server_counters
    from freetoken.eval.report import write_report
    from freetoken.eval.results import FORMAT, VERSION, summarize, summary_table, turn_table, write_result

    model = a.model or served_model(endpoint, headers) or "default"
    opts = ReplayOptions(endpoint, model, a.protocol, a.concurrency, not a.no_fixed_output, a.think,
                         a.reference_runs, a.reference_context, not a.no_fixed_output, headers)
    out.mkdir(parents=True, exist_ok=True)
    live = open(out / "turns.jsonl", "w", encoding="utf-8")  # each turn as it finishes: kept if the run dies
    before = server_counters(endpoint, headers)
    opts.engine_counters = before is not None  # freetoken's server: its expert counters around each turn
    opts.host_load = host_load.is_local(endpoint) and host_load.read() is not None
    bar = tqdm(total=len(trace.turns) * a.concurrency, desc=f"ft eval {trace.name}", unit="turn", file=sys.stderr,
               disable=a.quiet)

    def on_turn(result) -> None:
        data = result.to_json()
        live.write(json.dumps(data) + "\n")
        live.flush()
        bar.set_postfix_str(f"{data['id']} TTFT {data['ttft_s'] or 0:.2f}s" + (" failed" if data["error"] else ""))
        bar.update(1)

    started_at, t0 = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), time.perf_counter()
    interrupted = False
    collected: list = []
    try:
        results, reference = replay(trace, opts, on_turn=lambda r: (collected.append(r), on_turn(r)))
    except KeyboardInterrupt:
        interrupted, results, reference = True, collected, []
    finally:
        bar.close()
        live.close()
    wall = time.perf_counter() - t0
    after = server_counters(endpoint, headers)
    order = {t.id: i for i, t in enumerate(trace.turns)}
    turns = [r.to_json() for r in sorted(results, key=lambda r: (r.replica, order[r.turn.id]))]
    ref = [{**o.to_json(), "when": when, "prompt": kind} for when, kind, o in reference]
    result = {
        "format": FORMAT, "version": VERSION, "freetoken": __version__, "started_at": started_at,
        "label": a.label or model, "endpoint": endpoint, "model": model, "protocol": a.protocol,
        "concurrency": a.concurrency, "fixed_output": not a.no_fixed_output, "ignore_eos": opts.ignore_eos,
        "think": "honoured" if a.think else "skipped", "server_args": started_server, "interrupted": interrupted,
        "trace": {"name": trace.name, "source": source, "description": trace.description, "generator": trace.generator,
                  "turn_ids": [t.id for t in trace.turns], "sessions": trace.sessions},
        "warmup": opts.warmup.to_json() if opts.warmup else None, "reference": ref, "turns": turns,
        "summary": summarize(turns, ref, wall),
        "server_usage": _usage_delta(before, after)}
    path = write_result(result, out)
    report = write_report(result, out)
    if not a.quiet:
        print(turn_table(turns) + "\n")
    print(summary_table(result["summary"]))
    print(f"\nresult: {path}\nreport: {report}")
    failed = [t for t in turns if t["error"]]
    if failed:
        first = failed[0]
        print(f"ft eval: {len(failed)} of {len(turns)} turns failed; first: {first['id']}: {first['error']}",
              file=sys.stderr)
        if any(_too_long(t["error"]) for t in failed):
            print("ft eval: prompts past the server's context: shrink a bundled trace with --scale (e.g. 0.25) or "
                  "serve a model with a longer context", file=sys.stderr)
    return 130 if interrupted else 1 if failed else 0


def _too_long(error: str) -> bool:
    """A context-length refusal, in OpenAI's or Anthropic's words."""
    return "maximum context length" in error or "prompt is too long" in error


def _usage_delta(before: dict | None, after: dict | None) -> dict | None:
    """freetoken's own token counters over the run (a check of the per-turn usage), None from other servers."""
    if not before or not after:
        return None
    return {k: after.get(k, 0) - before.get(k, 0) for k in ("received", "completed", "failed", "prompt_tokens",
                                                             "completion_tokens")}


def compare(argv: list[str]) -> int:
    from freetoken.eval.compare import compare_table
    from freetoken.eval.report import compare_plot
    from freetoken.eval.results import read_result

    p = argparse.ArgumentParser(prog="ft eval compare", description="Compare ft eval results side by side.")
    p.add_argument("results", nargs="+", help="result.json files (or their run folders); the first is the base")
    p.add_argument("--out", default="compare.png", help="the plot's path (default compare.png)")
    a = p.parse_args(argv)
    results = [read_result(r) for r in a.results]
    print(compare_table(results))
    print(f"\nplot: {compare_plot(results, Path(a.out))}")
    return 0


def generate(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="ft eval generate", description="Write a bundled trace as a JSONL file.")
    p.add_argument("name", choices=shapes.names())
    p.add_argument("--out", required=True, help="the .jsonl file to write")
    _shape_args(p)
    a = p.parse_args(argv)
    trace = shapes.generate(a.name, scale=a.scale, seed=a.seed, **_params(a.param))
    print(f"wrote {write_trace(trace, a.out)} ({len(trace.turns)} turns, sessions {', '.join(trace.sessions)})")
    return 0


def list_traces() -> int:
    for name in shapes.names():
        params = ", ".join(f"{k}={v:g}" for k, v in shapes.DEFAULTS[name].items())
        print(f"{name:<12} {shapes.DESCRIPTIONS[name]}\n{'':<12} parameters: {params}")
    return 0


def _shape_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scale", type=float, default=1.0, help="multiply every token length of a bundled trace")
    p.add_argument("--seed", type=int, default=0, help="a bundled trace's seed (default 0)")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="a bundled trace's parameter (ft eval list shows them), e.g. --param turns=8")


def main(verb: str, argv: list[str]) -> int:
    if argv and argv[0] == "compare":
        return compare(argv[1:])
    if argv and argv[0] == "generate":
        return generate(argv[1:])
    if argv and argv[0] == "list":
        return list_traces()
    serve_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, serve_args = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(prog="ft eval", description="Replay an agent trace against an endpoint (or an "
                                "ft serve it starts) and report TTFT and throughput. Also: ft eval compare | "
                                "generate | list.")
    p.add_argument("--trace", required=True, help=f"a bundled trace ({', '.join(shapes.names())}) or a file")
    p.add_argument("--endpoint", help="the server's base URL (default: start ft serve with the args after --)")
    p.add_argument("--protocol", default="auto", choices=["auto", *ROUTES],
                   help="send every turn in this protocol (default auto: each turn's own)")
    p.add_argument("--concurrency", type=int, default=1, help="copies of the trace replayed at once (default 1)")
    p.add_argument("--out", help="folder for result.json, the report and plots (default ft-eval/TRACE-TIME)")
    p.add_argument("--model", help="the model name sent (default: the first in the endpoint's /v1/models)")
    p.add_argument("--label", help="the run's name in reports and comparisons (default: the model)")
    p.add_argument("--api-key", default=os.environ.get("FREETOKEN_API_KEY"), help="sent as Bearer and x-api-key")
    p.add_argument("--think", action="store_true", help="wait each turn's think time before sending it")
    p.add_argument("--no-fixed-output", action="store_true",
                   help="let the server end replies (default: ask for each turn's recorded length, ignore_eos)")
    p.add_argument("--reference-runs", type=int, default=3,
                   help="single-turn requests measured before the trace and as many after it, for the decode "
                        "ratio (default 3)")
    p.add_argument("--reference-context", type=int, default=0, metavar="TOKENS",
                   help="also measure the references over a prompt of about this many tokens (the trace's "
                        "contexts), so a decode gap can be told from the longer context's own cost (default 0: "
                        "short references only)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    _shape_args(p)
    a = p.parse_args(argv)
    if a.concurrency < 1:
        raise FreeTokenError(f"--concurrency must be at least 1, got {a.concurrency}")
    if a.reference_context < 0:
        raise FreeTokenError(f"--reference-context must be 0 or more tokens, got {a.reference_context}")
    return run(a, serve_args)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="freetoken: %(message)s")
    sys.exit(main("eval", sys.argv[1:]))
