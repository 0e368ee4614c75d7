"""Named GPU fast paths and their switches. A path is built and checked on the CPU (Triton's interpreter, torch's
fallbacks) first and stays EXPERIMENTAL, off unless named in FREETOKEN_EXPERIMENTAL (comma-separated), until a
device run shows it right and faster; then it moves to MEASURED, on by default, and FREETOKEN_DISABLE (same form)
turns it off to compare or to work around a driver. Each measured path names the result file that earned it.
"""

from __future__ import annotations

import functools
import logging
import os

log = logging.getLogger(__name__)

MEASURED = {
    "ahead-batches": ("offloaded prefill streams the next layer's experts ahead 8 at a time (one event, one "
                      "dequantizing launch for block formats, one batched copy for dense) instead of one by one: "
                      "a 500-token turn after 20k tokens at 16 GiB 1.07-1.09x and cold 1.11x in Q8_0 (two orders), "
                      "bf16 within noise", "evals/results/reuse-qwen3-30b-a3b-20k-h200.md"),
    "batch-paged-decode": ("a captured batched decode step's attention as the paged split-KV Triton kernel over all "
                           "its rows, each row's keys read in place (5-15x the gathering form's speed)",
                           "evals/results/decode-attention-h200.md"),
    "batch-graphs": ("continuous-batching decode steps of several sequences replay CUDA graphs per batch size",
                     "evals/results/serve-q3-8l-h200.md"),
    "copy-batch": ("offloaded copies of pinned dense (bf16) experts queued by one cudaMemcpyBatchAsync per batch "
                   "(CUDA 12.8+) instead of one cudaMemcpyAsync per projection: bf16 D1 auto 1.02-1.12x in seven of "
                   "eight A/B pairs over two leases (0.96x in one), medians 1.05x at budget 0 and 1.04x at 16 GiB; "
                   "block-format experts: copy-batch-blocks", "evals/results/d1-copy-batch-h200.md"),
    "guard-rest": ("the path guard does not measure decode's first window (a token's layer-steps) after a prefill "
                   "chunk, and drops the window in progress: A1 without reuse at 16 GiB (075c0b1, H100) claude-code "
                   "0.958 -> 1.002x and openclaw 0.960 -> 1.004x of single-turn decode (the same lease)",
                   "evals/results/a1-qwen3-30b-a3b-16gib-h200.md"),
    "hyper-sinkhorn": ("DeepSeek-V4's hyper-connection weights (sigmoids, softmax, 20 Sinkhorn rounds on a 4x4 "
                       "matrix) as one Triton launch per block instead of ~130 (kernels/hyper_sinkhorn; 56 instead "
                       "of 1,582 µs a call): V4's eager decode 1.55-1.88x resident, 1.38-1.54x offloaded",
                       "evals/results/d1-deepseek-v4-hyper-sinkhorn-h200.md"),
    "cpu-first": ("offloaded decode starts a layer's CPU share before queueing its copies (start 154-258 -> 68-80 "
                  "µs after the routing at 8-16 GiB; auto +6% at 8 GiB, +17% at 16 GiB, equal at budget 0)",
                  "evals/results/d1-qwen3-30b-a3b-bf16-1k-h200.md"),
    "emit-after-launch": ("a decode step replayed whole from CUDA graphs hands the previous step's tokens to the "
                          "server after launching the next (single-stream server overhead +9.3% -> +1.7%)",
                          "evals/results/serve-q3-8l-h200.md"),
    "grouped-mm": ("long chunks' experts as sorted grouped matmuls (torch._grouped_mm, bf16 on Hopper and newer)",
                   "evals/results/p1-grouped-mm-paged-decode-8l-h200.md"),
    "paged-decode": ("captured decode attention as a paged split-KV Triton kernel (kernels/paged_decode)",
                     "evals/results/p1-grouped-mm-paged-decode-8l-h200.md"),
    "prefill-ahead": ("offloaded long prefill chunks stream the next layer's experts while a layer computes",
                      "evals/results/p1-qwen3-30b-a3b-bf16-h200.md"),
    "stream-short-chunks": ("offloaded prefill chunks of a few hundred tokens (an agent's next turn, an edit's "
                            "suffix) stream the next layer's experts like long chunks and copy all their misses, "
                            "instead of splitting them between copies and the CPU: a 500-token turn after 20k "
                            "tokens at a 16 GiB budget 1.10 -> 0.88 s (bf16), 1.06 -> 0.72 s (Q8_0)",
                            "evals/results/reuse-qwen3-30b-a3b-20k-h200.md"),
    "recurrent-graphs": ("decode of models with recurrent layers through CUDA graphs (state in static buffers)",
                         "evals/results/d1-qwen3.5-35b-a3b-8l-graphs-h200.md"),
}
EXPERIMENTAL: dict[str, str] = {
    "block-store": "offloaded quantized experts (Q8_0, MXFP4, FP8) keep the whole expert cache in their block format "
                   "on the device, dequantized into a staging slot when a step needs them: about twice the experts "
                   "per byte for Q8_0 (a higher hit rate), a few µs of device work per expert a step (--block-cache "
                   "sets the share explicitly)",
    "delta-decode": "Gated DeltaNet decode steps as one Triton launch per layer (kernels/gated_delta)",
    "delta-prefill": "the chunked Gated DeltaNet's chunk-to-chunk loop as one Triton launch per layer",
    "prefetch-early": "captured decode queues the next layer's prefetch at the end of a layer's host work, not after "
                      "the next segment's launch (large experts: gpt-oss-20b's auto ran below cpu at budget 0)",
    "prefetch-lead": "offloaded decode sizes the next layer's prefetch crediting its copies with their head start "
                     "over that layer's CPU share (the measured time from queueing a prefetch to its layer's "
                     "routing), so the prefetch copies more of what the CPU would otherwise compute. Measured "
                     "(profile-perf-h200.md, 0a16b66): within noise for Q8_0 at budget 0, 0.81-0.92x for bf16 at "
                     "budget 0 (the planner then sent 7 of 8 misses to the CPU)",
    "prefetch-with-cpu": "captured decode queues the next layer's prefetch right after a layer's expert replay, "
                         "while its CPU share runs, instead of after the next segment's launch. Measured slower "
                         "(evals/results/profile-perf-h200.md, fb990d8: auto 0.83-0.97x at budget 0, 0.80-0.88x at "
                         "16 GiB): the copies share host DRAM with the CPU share, which then runs longer",
    "cpu-tree-wake": "the CPU kernel's sleeping workers are woken as a binary tree (each woken worker wakes two "
                     "more) instead of all by the thread that posts the job (Linux; kernels/cpu_experts/pool.h). "
                     "Measured (wake-bench and profile-perf-h200.md, 0a16b66): the poster returns ~10 µs sooner "
                     "but the whole job ends 20-40 µs later (the tree's last workers start late); auto 0.91-0.98x "
                     "where the rounds' splits were alike",
    "split-bias": "the path guard searches a bias for the miss planner's split (whole experts a step moved to the "
                  "CPU, or to the copies, beyond the models' choice) by hill climbing on measured layer-steps. "
                  "Measured on three leases (d1-split-bias-h200.md): +7-9% in three of four configurations on one, "
                  "0.84-0.98x for bf16 on the next, and 0.85x for Q8_0 at budget 0, 1.06x for bf16 at budget 0, "
                  "~1.0x at 16 GiB on the third (e7f4a8b): the same arm's windows vary +-15% within a run, so a "
                  "1.5% hill climb wanders, and a bias it settled on wrongly can lose the way-level choice",
    "copy-batch-blocks": "GPU path copy-batch for block-format (Q8_0) experts too. Measured on two leases "
                         "(d1-copy-batch-h200.md): Q8_0 auto 0.98x and 1.17x at budget 0, 0.88x and 0.96x at 16 GiB; "
                         "a 500-token turn streamed over the block store 0.92-0.94x the time, its copies at 50 "
                         "against 46 GB/s (70ebb4b, H100; reuse-qwen3-30b-a3b-20k-h200.md)",
    "copy-batch-prefill": "GPU path copy-batch-blocks for the copies of offloaded prefill chunks only (decode's "
                          "block-format copies stay one runtime call each): copy-batch-blocks cut a 500-token turn "
                          "streamed over the block store to 0.92-0.94x the time but ran decode at 0.88-0.96x at 16 "
                          "GiB (70ebb4b, d1-copy-batch-h200.md). Unmeasured on its own",
    "cpu-caller-waits": "the thread that drives the GPU only waits for a layer's CPU share instead of running the "
                        "CPU kernel's tasks too, and the kernel's pool gets a worker more, so the weights it would "
                        "stream cannot push its own working set out of its caches before the next layer-step's "
                        "host work, decode's critical path (kernels/cpu_experts/pool.h). Measured on the H100 "
                        "machine (D1 Q8_0, budget 0, A/B/A/B): 30.10 against 30.03 tok/s, the CPU share starting "
                        "~8 us earlier: no gain (evals/results/cpu-kernel-q16-rows.md)",
    "short-chunks-cpu": "offloaded prefill chunks that stream ahead under stream-short-chunks (an agent's next "
                        "turn: tens of tokens an expert) stream only the share of each next layer's missing experts "
                        "that the prefill planner would copy; the layer's remaining misses are split when it routes, "
                        "so the CPU computes its share while the link streams the layer after. Slower on the device "
                        "in both measured forms (18ed6c9: turn 0.857 against 0.598 s, the CPU taking 1,298 experts; "
                        "reuse-qwen3-30b-a3b-20k-h200.md), where a layer with a CPU share left the one sorted pass "
                        "for per-expert groups, and over the block store the CPU's share was cut from experts the "
                        "store held (they came back as store reads, off the sorted pass too); both mended, and still "
                        "slower (e3f4eeb: 0.61-0.70 against 0.49-0.57 s): the CPU computes a layer's share once it "
                        "routes, on that layer's critical path, while the link streams a layer ahead, and at ~31 "
                        "tokens an expert it read 11-20 GB/s of weights; the planner weighs the two as side by side",
    "stream-early": "offloaded prefill queues the next layer's copies before waiting for a layer's routing (when the "
                    "layer has nothing left to copy and the staging ring holds both layers' misses): the host's "
                    "queueing of a short chunk's next layer (3.4-4.1 ms a layer under the block store, e3f4eeb) "
                    "overlaps the GPU's work up to the routing (2-3.4 ms) instead of following it; a chunk's first "
                    "MoE layer, which no layer streamed, streams itself in batches before its routing. Over the "
                    "block store (70ebb4b, H100) a 500-token turn 0.93-0.97x the time alone, with copy-batch-blocks "
                    "and ahead-wide 0.383 / 0.423 against 0.449 / 0.442 s (reuse-qwen3-30b-a3b-20k-h200.md); not "
                    "yet measured without the store or on a cold prefill",
    "prefill-spread": "offloaded prefill chunks (which evict nothing) fill free expert-cache slots and block-store "
                      "rows up to an even share per layer instead of in layer order. Filled in order (9cd463a, "
                      "H100, 16 GiB block store): a 500-token turn found layers 0-25 all in the store, the link "
                      "idle through them (host-bound, ~6.5 ms a layer), and layers 26-47 all missing, bound by the "
                      "link (640 MB, ~12 ms a layer). Unmeasured",
    "ahead-wide": "offloaded prefill streams the next layer's experts ahead up to 32 at a time (within 256 MiB of "
                  "block bytes) instead of ahead-batches' 8: a quarter of the batches, for a short chunk whose "
                  "streaming may be bound by the host's cost per batch (the block store's bookkeeping, index copies, "
                  "dequantizing launches). Within noise (e3f4eeb, H100: the turn 0.84-1.11x the time across six "
                  "pairs, cold 0.95x in two; evals/results/reuse-qwen3-30b-a3b-20k-h200.md)",
    "cpu-warm": "offloaded decode has the CPU kernel's workers read the next layer's predicted experts that the "
                "planner would give the CPU into their caches while the host waits for that layer's routing (the "
                "CPU otherwise idles through the layer's dense work; kernels/cpu_experts/memory.h ft_warm). "
                "Measured with cpu-warm-owned (evals/results/cpu-warm-h100-host.md)",
    "cpu-warm-owned": "cpu-warm with owned rows: each of the CPU kernel's workers reads ahead the rows of the "
                      "predicted experts that it will compute itself, and every CPU call gives each worker that "
                      "same share of every expert's rows first (pool.h's owned tasks; ft_warm_rows). Measured on "
                      "the device (D1 Q8_0, budget 0, A/B/A/B): the CPU share read 119-122 GB/s against 86-95, "
                      "the planner gave it nearly every miss, and decode ran 30.79 / 31.29 against 31.29 / 34.73 "
                      "tok/s: no gain (evals/results/cpu-warm-h100-host.md)",
    "cpu-prewake": "offloaded decode wakes the CPU kernel's sleeping workers before waiting for a layer's routing "
                   "(they spin for the job up to 1 ms). Measured (d1-qwen3-30b-a3b-bf16-1k-h200.md, 856f570): cpu "
                   "+7%, auto -3% at budget 0 and -15% at 16 GiB (spinning workers slow the other paths)",
}


@functools.cache
def enabled(path: str) -> bool:
    if path in MEASURED:
        return path not in _named("FREETOKEN_DISABLE")
    if path in EXPERIMENTAL:
        return path in _named("FREETOKEN_EXPERIMENTAL")
    raise ValueError(f"unknown GPU path {path!r}; known: {', '.join([*MEASURED, *EXPERIMENTAL])}")


@functools.cache
def _named(variable: str) -> frozenset[str]:
    known = MEASURED if variable == "FREETOKEN_DISABLE" else EXPERIMENTAL
    named = frozenset(n.strip() for n in os.environ.get(variable, "").split(",") if n.strip())
    if unknown := sorted(named - set(known)):
        log.warning("%s: ignoring unknown %s (known: %s)", variable, ", ".join(unknown), ", ".join(known) or "none")
    for path in sorted(named & set(known)):
        log.info("%s: %s (%s)", variable, path, known[path][0] if variable == "FREETOKEN_DISABLE" else known[path])
    return named
