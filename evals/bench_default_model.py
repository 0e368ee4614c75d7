"""Decode and prefill speed of one model through freetoken, with Hugging Face `transformers` on the same file
and device as the same-run baseline. Writes a Markdown table (device, commit, command, date) to --out.

    python evals/bench_default_model.py --device cuda --out evals/results/default-model-h200.md

Decode tok/s counts the tokens after the first (time to first token is reported as prefill). Medians over
--repeats runs after one warm-up run. Greedy, EOS ignored, so every run produces exactly --tokens tokens.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from freetoken.engine.generator import Generator, SamplingParams
from freetoken.engine.loader import load_model

PROMPT = "Explain in a few paragraphs how a hash map works and when to prefer a tree map instead."


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_freetoken(lm, prompt_ids: list[int], tokens: int, repeats: int) -> dict:
    gen = Generator(lm)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    runs = []
    for i in range(repeats + 1):
        _sync(lm.device)
        last = None
        for ev in gen.stream(prompt_ids, params, decode_text=False):
            last = ev
        _sync(lm.device)
        if i:  # run 0 warms up kernels and the allocator
            t = last.timings
            runs.append(((tokens - 1) / t.decode_s, len(prompt_ids) / t.prefill_s))
    return {"decode": statistics.median(r[0] for r in runs), "prefill": statistics.median(r[1] for r in runs)}


def bench_transformers(path: Path, device: torch.device, dtype: torch.dtype, prompt_ids: list[int], tokens: int,
                       repeats: int) -> dict:
    from transformers import AutoModelForCausalLM

    if path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    model = model.to(device).eval()
    ids = torch.tensor([prompt_ids], device=device)

    def timed(n: int) -> float:
        _sync(device)
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
        _sync(device)
        return time.perf_counter() - start

    timed(tokens)  # warm-up
    firsts = [timed(1) for _ in range(repeats)]
    fulls = [timed(tokens) for _ in range(repeats)]
    first = statistics.median(firsts)
    return {"decode": (tokens - 1) / (statistics.median(fulls) - first), "prefill": len(prompt_ids) / first}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} CPU, {os.cpu_count()} cores, torch threads " \
           f"{torch.get_num_threads()}"


def commit() -> str:
    if os.environ.get("FREETOKEN_COMMIT"):
        return os.environ["FREETOKEN_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model source (default: the embedded default model)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-baseline", action="store_true", help="skip the transformers baseline")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    device = torch.device(a.device)
    dtype = getattr(torch, a.dtype) if a.dtype else None
    lm = load_model(a.model, device=device, dtype=dtype)
    tok = lm.tokenizer
    prompt_ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPT}]))
    rows = [("freetoken", bench_freetoken(lm, prompt_ids, a.tokens, a.repeats))]
    if not a.no_baseline:
        del lm
        rows.append(("transformers", bench_transformers(
            Path(_source_path(a.model)), device, dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32),
            prompt_ids, a.tokens, a.repeats)))
    table = render(rows, a, device, len(prompt_ids))
    print(table)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(table)
    return 0


def _source_path(model: str | None) -> Path:
    from freetoken.engine.sources import resolve_model_source

    return resolve_model_source(model)


def render(rows, a, device: torch.device, prompt_len: int) -> str:
    base = rows[-1][1]["decode"] if len(rows) > 1 else None
    lines = [
        f"# Default-model speed on {device_name(device)}",
        "",
        f"- date: {dt.date.today().isoformat()}; commit: {commit()}; torch {torch.__version__}",
        f"- command: `{shlex.join([sys.executable.split('/')[-1], *sys.argv])}`",
        f"- model: {_source_path(a.model).name}; prompt {prompt_len} tokens; {a.tokens} generated tokens, "
        f"greedy; median of {a.repeats} runs after a warm-up",
        "",
        "| engine | decode tok/s | prefill tok/s | decode vs transformers |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, r in rows:
        ratio = f"{r['decode'] / base:.2f}×" if base else "—"
        lines.append(f"| {name} | {r['decode']:.1f} | {r['prefill']:.0f} | {ratio} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
