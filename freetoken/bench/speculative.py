"""`ft bench speculative`: what speculative decoding with a multi-token-prediction layer (engine/speculative.py)
gains over plain decoding on a synthetic real-shape model, resident or offloaded, by the drafts' acceptance.

    ft bench speculative [--shape glm-4.5-air] [--layers 8] [--budgets all,0,8GiB] [--acceptance 0,0.5,0.8,1]
                         [--context 1024] [--tokens 64]

A random model cannot show a real acceptance rate: its MTP layer's drafts are almost never right, and its own
greedy output repeats one token (routing every step to the same experts, which flatters the expert cache). So
the rows force both, as `ft bench decode` teacher-forces its tokens: the reply's tokens are a seeded random
stream, and each draft is the stream's next token with probability ACCEPTANCE (another token otherwise). The
MTP layer still runs on every pass and each pass verifies two tokens, so the cost is the real one; only the
choices are forced. (DeepSeek-V3's report gives 85-90% acceptance for its MTP drafts.) Rows per budget: plain
decoding eager and, on CUDA, through CUDA graphs (what `ft serve` runs), then speculative decoding (eager) at
each acceptance; tok/s over the same timed tokens after the same prompt.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from freetoken.bench.decode import (
    _eager_step,
    _graph_step,
    _on_device,
    _sync,
    add_model_args,
    add_run_args,
    emit,
    result_header,
)
from freetoken.bench.synthetic import SHAPES, build_synthetic
from freetoken.engine.experts import ResidentExpertExecutor
from freetoken.engine.generator import GenerationEvent
from freetoken.engine.loader import attach_experts, build_executor
from freetoken.engine.models import family_for
from freetoken.engine.speculative import MtpSpeculator
from freetoken.units import parse_bytes


@dataclass(slots=True)
class Row:
    budget: str
    mode: str  # "plain, eager", "plain, graphs" or "speculative"
    tok_s: float
    acceptance: float | None = None  # measured (speculative rows)
    passes: int = 0  # forwards of the main model for the timed tokens


class _ForcedReply:
    """Hands out the stream's tokens in order whatever the logits (after reading the argmax, as greedy sampling
    would: one host sync a token)."""

    def __init__(self, tokens: list[int]):
        self.tokens, self.produced = tokens, 0

    def prefilled(self) -> None:
        pass

    def accept(self, logits: torch.Tensor) -> GenerationEvent:
        int(logits.argmax())
        token = self.tokens[self.produced]
        self.produced += 1
        finish = "length" if self.produced == len(self.tokens) else None
        return GenerationEvent([token], "", finish, 0, self.produced)


class _ForcedDrafts(MtpSpeculator):
    """The MTP layer runs as usual; its draft is replaced by the stream's next token with probability
    `acceptance`, else by another token."""

    def __init__(self, lm, stream: list[int], prompt_len: int, acceptance: float, seed: int):
        super().__init__(lm)
        self.stream, self.prompt_len, self.acceptance = stream, prompt_len, acceptance
        self.rng = random.Random(seed)

    def _draft(self, hidden, next_ids, cache, seq, start) -> int:
        super()._draft(hidden, next_ids, cache, seq, start)
        index = start + len(next_ids) + 1 - self.prompt_len  # the stream token the draft stands for
        right = self.stream[index] if index < len(self.stream) else 0
        return right if self.rng.random() < self.acceptance else (right + 1) % self.lm.args.decoder.vocab_size


def _plain(lm, prompt: torch.Tensor, stream: list[int], graphs: bool) -> tuple[float, int]:
    cache = lm.new_cache(initial_tokens=prompt.shape[0] + len(stream) + 8,
                         max_tokens=prompt.shape[0] + len(stream) + 8)
    seq = cache.new_sequence()
    for start in range(0, prompt.shape[0], 2048):
        lm.forward(prompt[start:start + 2048], cache, seq, "last")
    step = _graph_step(lm, cache) if graphs else _eager_step(lm, cache)
    if graphs:  # the capture, outside the timing
        branch = cache.fork(seq)
        step(branch, stream[0])
        cache.release(branch)
    _sync(lm.device)
    t0 = time.perf_counter()
    for token in stream:
        int(step(seq, token).argmax())
    elapsed = time.perf_counter() - t0
    cache.release(seq)
    return len(stream) / elapsed, len(stream)


def _speculative(lm, prompt: torch.Tensor, stream: list[int], acceptance: float, seed: int
                 ) -> tuple[float, float, int]:
    """Times the stream's tokens after the prompt's prefill and the first sampled token (`seed` picks which
    drafts are right)."""
    cache = lm.new_cache(initial_tokens=prompt.shape[0] + len(stream) + 8,
                         max_tokens=prompt.shape[0] + len(stream) + 8)
    seq = cache.new_sequence()
    first = (stream[0] + 1) % lm.args.decoder.vocab_size  # sampled after the prompt, before the timed stream
    speculator = _ForcedDrafts(lm, [first, *stream], prompt.shape[0], acceptance, seed)
    events = speculator.extend(_ForcedReply([first, *stream]), prompt.tolist(), cache, seq, 2048)
    next(events)
    _sync(lm.device)
    t0 = time.perf_counter()
    for _ in events:
        pass
    elapsed = time.perf_counter() - t0
    cache.release(seq)
    s = speculator.stats
    return len(stream) / elapsed, s.acceptance, s.proposed + s.redone  # (redone: recurrent layers' rejections)


@contextmanager
def _executor(lm, host: dict, budget: str, with_mtp: bool):
    """`lm` with an expert executor for `budget` attached: with the MTP layer (its experts one more layer), or
    as the model is served without it (no MTP module, its experts neither cached nor prefetched)."""
    device, dtype, n = lm.device, lm.dtype, lm.args.decoder.n_layers
    mtp, spec = lm.model.mtp, lm.moe_spec
    if not with_mtp:
        del lm.model.mtp
        host = {layer: le for layer, le in host.items() if layer != n}
        spec = dataclasses.replace(spec, moe_layers=tuple(x for x in spec.moe_layers if x != n))
    if budget == "all":
        executor = ResidentExpertExecutor({layer: _on_device(le, device, dtype) for layer, le in host.items()})
    else:
        executor = build_executor(host, spec, dtype, device, parse_bytes(budget), "freq", "auto")
    attach_experts(lm.model, executor)
    lm.experts = executor
    try:
        yield
    finally:
        lm.experts = None
        attach_experts(lm.model, None)
        lm.model.mtp = mtp
        del executor
        if device.type == "cuda":
            torch.cuda.empty_cache()


def bench(a: argparse.Namespace) -> list[Row]:
    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    lm = build_synthetic(a.shape, device=device, dtype=dtype, expert_cache=0, layers=a.layers, seed=a.seed,
                         expert_format=a.expert_format, prefill_ahead=False, mtp=True)
    host = lm.experts.host
    gen = torch.Generator().manual_seed(a.seed)
    ids = torch.randint(0, lm.args.decoder.vocab_size, (a.context + a.warmup + a.tokens,), generator=gen)
    prompt, warm, stream = ids[:a.context].to(device), ids[a.context:a.context + a.warmup].tolist(), \
        ids[a.context + a.warmup:].tolist()
    rows = []
    with torch.inference_mode():
        for budget in a.budgets:
            with _executor(lm, host, budget, with_mtp=False):
                if warm:  # the planner and the cache settle, untimed
                    _plain(lm, prompt, warm, graphs=False)
                modes = [("plain, eager", False)] + ([("plain, graphs", True)] if device.type == "cuda" else [])
                for mode, graphs in modes:
                    tok_s, passes = _plain(lm, prompt, stream, graphs)
                    rows.append(Row(budget, mode, tok_s, passes=passes))
                    print(_format(rows[-1], rows), file=sys.stderr, flush=True)
            with _executor(lm, host, budget, with_mtp=True):
                if warm:
                    _speculative(lm, prompt, warm, 0.5, a.seed)
                for acceptance in a.acceptance:
                    tok_s, measured, passes = _speculative(lm, prompt, stream, acceptance, a.seed)
                    rows.append(Row(budget, f"speculative, {acceptance:.0%} drafts right", tok_s, measured, passes))
                    print(_format(rows[-1], rows), file=sys.stderr, flush=True)
    return rows


def _format(r: Row, rows: list[Row]) -> str:
    base = {x.mode: x.tok_s for x in rows if x.budget == r.budget and x.mode.startswith("plain")}
    eager, graphs = base.get("plain, eager"), base.get("plain, graphs")
    acceptance = "" if r.acceptance is None else f"{r.acceptance:.0%}"
    ratios = [f"{r.tok_s / v:.2f}×" if v else "" for v in (eager, graphs)]
    return (f"| {r.budget} | {r.mode} | {acceptance} | {r.passes} | {r.tok_s:.2f} | {ratios[0]} | "
            f"{ratios[1] if graphs else '—'} |")


def render(rows: list[Row], a: argparse.Namespace) -> str:
    lines = [
        *result_header("Speculative decoding with an MTP layer", "speculative", a),
        f"- prompt {a.context} random tokens, then {a.tokens} timed tokens of a seeded random stream after "
        f"{a.warmup} untimed ones (forced: see `freetoken/bench/speculative.py`); budget `all` = every expert "
        "resident, else the offloaded executor's expert cache (auto miss path)",
        "",
        "| expert budget | decoding | drafts accepted | main-model passes | tok/s | vs plain eager | vs plain graphs |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
        *(_format(r, rows) for r in rows),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="ft bench speculative", description=__doc__.splitlines()[0])
    add_model_args(p)
    p.set_defaults(shape="glm-4.5-air")  # (a family with an MTP layer, the size of a local model)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--warmup", type=int, default=32, help="untimed plain decode tokens per budget first")
    p.add_argument("--budgets", default="all,0,8GiB", help="comma-separated expert-cache sizes ('all': resident)")
    p.add_argument("--acceptance", default="0,0.5,0.8,1", help="comma-separated shares of drafts forced right")
    add_run_args(p)
    a = p.parse_args(argv)
    a.argv, a.budgets = argv, a.budgets.split(",")
    a.acceptance = [float(x) for x in a.acceptance.split(",")]
    if any(not 0 <= x <= 1 for x in a.acceptance):
        p.error(f"--acceptance takes shares between 0 and 1, got {a.acceptance}")
    family = family_for(SHAPES[a.shape]["model_type"])
    if not hasattr(family, "with_mtp"):
        p.error(f"--shape {a.shape} ({family.MODEL_TYPE}) has no multi-token-prediction layer; take a shape of "
                "deepseek_v3, glm4_moe, glm_moe_dsa, qwen3_next or qwen3_5_moe")
    return emit(render(bench(a), a), a.out)
