"""`ft bench serve`: what the server costs per generated token against in-process generation, and the aggregate
throughput of 1, 4, 16 concurrent streaming sessions (continuous batching), on one loaded model.

    ft bench serve [--model M] [--device D] [--expert-cache SIZE] [--sessions 1,4,16] [--tokens 128]

The server is the real app on a loopback uvicorn in this process; sessions are OpenAI streaming chat requests
(greedy, EOS ignored so every session generates exactly `--tokens`), each concurrent one from a process of its
own, as agents are (client threads in the server's process would contend with its engine thread for the GIL).
Overhead compares the single-session server's time per token (first token to last) with a warm in-process
generator's decode time per token for the same prompt, both medians of `--repeats` runs. Each concurrency row is
timed on its second round: the first captures the CUDA graphs of the batch sizes it passes through.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime as dt
import multiprocessing
import shlex
import statistics
import sys
import time

import torch

from freetoken.bench.serve_client import PROMPT, session
from freetoken.engine.commands import _load, _model_args
from freetoken.engine.generator import Generator
from freetoken.engine.sampling import SamplingParams


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="ft bench serve", description=__doc__.splitlines()[0])
    _model_args(p)
    p.add_argument("--sessions", default="1,4,16", help="concurrent sessions per row (default 1,4,16)")
    p.add_argument("--tokens", type=int, default=128, help="tokens each session generates (default 128)")
    p.add_argument("--repeats", type=int, default=3, help="runs of the single-session rows (median)")
    p.add_argument("--commit", default="unknown", help="the commit measured, for the result's header")
    p.add_argument("--out", help="also write the markdown result here")
    a = p.parse_args(argv)
    sessions = [int(s) for s in a.sessions.split(",")]
    lm = _load(a)
    ids = lm.tokenizer.encode(lm.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}]))
    params = SamplingParams(temperature=0, max_tokens=a.tokens, ignore_eos=True)
    gen = Generator(lm)  # one generator, as the server keeps one: its KV pool and CUDA graphs stay warm
    local = [_in_process(gen, ids, params) for _ in range(a.repeats + 1)][1:]  # the first run warms up
    per_token = statistics.median(local)

    from freetoken.server.app import create_app
    from freetoken.server.engine import ServingEngine
    from freetoken.server.local import serve_in_thread

    engine = ServingEngine(lm, "bench", max_batch=max(sessions))
    url, server, thread = serve_in_thread(create_app(engine))
    try:
        spawn = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as client:
            client.submit(session, url, a.tokens).result()  # warm-up (graphs, allocator)
            single = statistics.median(client.submit(session, url, a.tokens).result()[1] for _ in range(a.repeats))
        rows = []
        for n in sessions:
            with concurrent.futures.ProcessPoolExecutor(n, mp_context=spawn) as pool:
                list(pool.map(_ready, range(n)))  # the clients' interpreters are up before the clock starts
                list(pool.map(session, [url] * n, [a.tokens] * n))  # untimed: captures this batch size's graphs
                t0 = time.perf_counter()
                results = list(pool.map(session, [url] * n, [a.tokens] * n))
                wall = time.perf_counter() - t0
            tokens = sum(r[0] for r in results)
            rows.append((n, tokens / wall, statistics.median(r[1] for r in results), wall))
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        engine.close()
    text = _render(a, argv, lm, per_token, single, rows)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    return 0


def _ready(_: int) -> None:
    """A no-op each client process runs once, so the pool has started them all."""


def _in_process(gen: Generator, ids: list[int], params: SamplingParams) -> float:
    """Seconds per decoded token of the in-process generator (first token to last)."""
    last = None
    for ev in gen.stream(ids, params, decode_text=True):
        last = ev
    t = last.timings
    return (t.prefill_s + t.decode_s - t.first_token_s) / max(last.completion_tokens - 1, 1)


def _render(a, argv, lm, per_token: float, single: float, rows: list[tuple]) -> str:
    device = torch.cuda.get_device_name(lm.device) if lm.device.type == "cuda" else "CPU"
    lines = [
        f"# Server overhead and concurrent throughput, {a.model or 'default model'}, {device}",
        "",
        f"- date: {dt.date.today().isoformat()}; torch {torch.__version__}; commit: {a.commit}",
        f"- command: `{shlex.join(['ft', 'bench', 'serve', *argv])}`",
        f"- {a.tokens} tokens per session, greedy, EOS ignored; medians of {a.repeats} runs for single streams",
        "",
        "| path | ms per token | vs in-process |",
        "| --- | ---: | ---: |",
        f"| in-process generator | {per_token * 1e3:.2f} | — |",
        f"| server, 1 streaming session | {single * 1e3:.2f} | {single / per_token - 1:+.1%} |",
        "",
        "| concurrent sessions | aggregate tok/s | ms per token per session (median) | wall s |",
        "| ---: | ---: | ---: | ---: |",
        *(f"| {n} | {rate:.1f} | {per * 1e3:.2f} | {wall:.1f} |" for n, rate, per, wall in rows),
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
