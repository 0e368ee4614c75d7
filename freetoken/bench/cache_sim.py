"""`ft bench cache`: expert-cache hit rates of each policy and cache size, from recorded routing.

Hit rates depend only on which experts each step routes to, not on the device, so a routing trace is recorded
once (prefill, then teacher-forced decode of random tokens through a synthetic model) and replayed through the
torch-free `ExpertCache` for every policy and size. Hit rates are counted over decode steps only; the cache is
warmed by the prefill as in the engine.
"""

from __future__ import annotations

import argparse
import datetime as dt
import shlex
import sys
from pathlib import Path

import torch

from freetoken.bench.synthetic import SHAPES, build_synthetic
from freetoken.engine.offload.expert_cache import ExpertCache
from freetoken.engine.offload.policy import POLICIES, make_policy

Step = list[tuple[int, list[int]]]  # one forward pass: (layer, distinct experts) per MoE layer


def record_routing(lm, context: int, tokens: int, seed: int = 0) -> tuple[Step, list[Step]]:
    """(the prefill step, one step per decode token) of a synthetic model."""
    steps: list[Step] = []
    forward = lm.experts.forward

    def record(layer, hidden, topk_ids, topk_weights):
        steps[-1].append((layer, torch.unique(topk_ids).tolist()))
        return forward(layer, hidden, topk_ids, topk_weights)

    lm.experts.forward = record
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, lm.args.decoder.vocab_size, (context + tokens,), generator=gen)
    cache = lm.new_cache(initial_tokens=context + tokens)
    seq = cache.new_sequence()
    with torch.inference_mode():
        steps.append([])
        lm.forward(ids[:context].to(lm.device), cache, seq, "last")
        for t in ids[context:].tolist():
            steps.append([])
            lm.forward(torch.tensor([t], device=lm.device), cache, seq, "last")
    lm.experts.forward = forward
    return steps[0], steps[1:]


def replay(prefill: Step, decode: list[Step], capacity: int, policy: str) -> float:
    """Decode hit rate of a cache of `capacity` experts."""
    cache = ExpertCache(capacity, make_policy(policy))
    for i, step in enumerate([prefill, *decode]):
        if i == 1:
            hits_before, misses_before = cache.counters.hits, cache.counters.misses
        for layer, experts in step:
            keys = [(layer, e) for e in experts]
            cache.begin_step(keys)
            for key in keys:
                if cache.lookup(key) is None:
                    cache.admit(key)
    hits, misses = cache.counters.hits - hits_before, cache.counters.misses - misses_before
    return hits / max(hits + misses, 1)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="ft bench cache", description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-30b-a3b-routing", choices=sorted(SHAPES))
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--skews", default="0,0.5,1.0", help="comma-separated Zipf exponents of expert popularity")
    p.add_argument("--fractions", default="0.05,0.1,0.15,0.3", help="cache sizes as fractions of all experts")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--commit", default="unknown")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    policies, fractions = a.policies.split(","), [float(f) for f in a.fractions.split(",")]
    lines = [
        f"# Expert-cache hit rates by policy, routing of synthetic {a.shape}",
        "",
        f"- date: {dt.date.today().isoformat()}; commit: {a.commit}; torch {torch.__version__} (CPU: hit rates do "
        "not depend on the device)",
        f"- command: `{shlex.join(['ft', 'bench', 'cache', *argv])}`",
        f"- prefill {a.context} random tokens, then {a.tokens} teacher-forced decode tokens; hit rate over decode",
        "",
        "| router skew | cache (of all experts) | " + " | ".join(policies) + " |",
        "| --- | --- | " + " | ".join("---:" for _ in policies) + " |",
    ]
    for skew in (float(s) for s in a.skews.split(",")):
        lm = build_synthetic(a.shape, dtype=torch.float32, seed=a.seed, skew=skew)
        prefill, decode = record_routing(lm, a.context, a.tokens, a.seed)
        total = lm.moe_spec.total_routed_experts
        for fraction in fractions:
            rates = [replay(prefill, decode, int(fraction * total), policy) for policy in policies]
            lines.append(f"| {skew:g} | {fraction:.0%} ({int(fraction * total)}) | "
                         + " | ".join(f"{r:.1%}" for r in rates) + " |")
            print(lines[-1], file=sys.stderr, flush=True)
    table = "\n".join(lines) + "\n"
    print(table)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(table)
    return 0
