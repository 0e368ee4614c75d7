"""The engine's CLI verbs: `ft generate`, `ft chat`, `ft info`.

stdout carries only what the user asked for (the completion, the chat reply, the model description); progress,
logs and statistics go to stderr.
"""

from __future__ import annotations

import argparse
import sys

import torch

from freetoken.engine.sampling import SamplingParams
from freetoken.engine.stats import snapshot
from freetoken.errors import FreeTokenError
from freetoken.units import parse_bytes

_DTYPES = {"auto": None, "float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=None,
                   help="HF model directory, .gguf file or cached HF repo id (default: embedded SmolLM2-135M)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: cuda if available)")
    p.add_argument("--dtype", default="auto", choices=sorted(_DTYPES),
                   help="activation/weight dtype (default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--expert-cache", default=None, metavar="SIZE",
                   help="keep routed experts in host memory with a device cache of SIZE (e.g. 8GiB, 64MiB, 0, "
                        "or auto: what the device has left after dense weights, KV and activations); "
                        "default: all experts on the device")
    p.add_argument("--expert-policy", default="freq", choices=["freq", "freq-admit", "lru"],
                   help="expert-cache eviction policy (default: freq)")
    p.add_argument("--block-cache", type=_share, default=None, metavar="SHARE",
                   help="share of --expert-cache (0 to 1) that keeps quantized experts (GGUF Q8_0, MXFP4, FP8) in "
                        "their block format on the device: about twice the experts per byte for Q8_0, dequantized "
                        "when a step needs them (default 0, or 1 with FREETOKEN_EXPERIMENTAL=block-store)")


def _share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} is no share: give a fraction from 0 to 1, e.g. 0.5")
    return value


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate (default 256)")
    p.add_argument("--temperature", "-t", type=float, default=0.0, help="0 = greedy (default 0)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p × the top probability")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--system", default=None, help="system message for the chat template")


def _sampling(a: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                          min_p=a.min_p, seed=a.seed, stop=tuple(a.stop))


def _device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise FreeTokenError(f"--device {name}: no CUDA GPU is visible to torch; use --device cpu")
    return name


def _speculative_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative", action="store_true",
                   help="decode with the model's multi-token-prediction layer drafting the next token (DeepSeek-V3/V4, "
                        "GLM-4.5/5, Qwen3-Next and Qwen3.5 checkpoints that carry one): up to two tokens a pass, the "
                        "same output")


def _load(a: argparse.Namespace, on_progress=None):
    from freetoken.engine.loader import load_model

    cache = a.expert_cache if a.expert_cache in (None, "auto") else parse_bytes(a.expert_cache)
    return load_model(a.model, device=_device(a.device), dtype=_DTYPES[a.dtype], expert_cache=cache,
                      expert_policy=a.expert_policy, on_progress=on_progress,
                      mtp=getattr(a, "speculative", False), block_share=a.block_cache)


def _messages(system: str | None, history: list[dict]) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + history


def generate(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="ft generate", description="Complete one prompt; prints only the completion.")
    p.add_argument("prompt", help="the prompt ('-' reads it from stdin)")
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    p.add_argument("--stats", action="store_true", help="print token counts and speeds to stderr")
    _model_args(p)
    _speculative_arg(p)
    _sampling_args(p)
    a = p.parse_args(argv)
    prompt = sys.stdin.read() if a.prompt == "-" else a.prompt
    params = _sampling(a)
    lm = _load(a)
    tok = lm.tokenizer
    if a.raw:
        ids = tok.encode(prompt, add_special_tokens=True)
    else:
        text = tok.apply_chat_template(_messages(a.system, [{"role": "user", "content": prompt}]))
        ids = tok.encode(text)
    from freetoken.engine.generator import Generator

    generator = Generator(lm, speculative=a.speculative)
    last = _stream_to_stdout(generator, ids, params)
    print()
    if a.stats and last.timings:
        _print_stats(last)
        if (drafts := generator.draft_stats) is not None:
            redone = f", {drafts.redone} passes redone (recurrent layers)" if drafts.redone else ""
            print(f"freetoken: {drafts.accepted} of {drafts.proposed} drafts accepted "
                  f"({drafts.acceptance:.0%}){redone}", file=sys.stderr)
        ex = snapshot(lm).experts
        if ex.mode == "offloaded":
            print(f"freetoken: expert cache {ex.cached}/{ex.slots} slots, hit rate {ex.hit_rate:.1%} ({ex.hits} hits, "
                  f"{ex.misses} misses, {ex.evictions} evictions, {ex.bytes_copied / 2**20:.1f} MiB copied, "
                  f"{ex.cpu_experts} experts computed on the CPU, {ex.prefetch_used}/{ex.prefetched} prefetches used)",
                  file=sys.stderr)
    return 0


def _stream_to_stdout(generator, ids: list[int], params: SamplingParams):
    last = None
    for ev in generator.stream(ids, params):
        if ev.text:
            sys.stdout.write(ev.text)
            sys.stdout.flush()
        last = ev
    return last


def _print_stats(ev) -> None:
    t = ev.timings
    decode_tokens = max(ev.completion_tokens - 1, 0)
    rate = decode_tokens / t.decode_s if t.decode_s > 0 else 0.0
    print(f"freetoken: prompt {ev.prompt_tokens} tokens, prefill {t.prefill_s:.3f}s, "
          f"completion {ev.completion_tokens} tokens, decode {rate:.1f} tok/s, finish={ev.finish_reason}",
          file=sys.stderr)


def chat(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="ft chat", description="Interactive chat. /reset clears the history, "
                                "/exit (or Ctrl-D) quits.")
    _model_args(p)
    _speculative_arg(p)
    _sampling_args(p)
    a = p.parse_args(argv)
    lm = _load(a)
    params = _sampling(a)
    history: list[dict] = []
    interactive = sys.stdin.isatty()
    from freetoken.engine.generator import Generator

    # one generator: its KV cache (and CUDA graphs) are reused turn after turn
    generator = Generator(lm, speculative=a.speculative)
    while True:
        try:
            line = input("you> " if interactive else "")
        except EOFError:
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            history.clear()
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        try:
            reply = _chat_turn(lm, generator, _messages(a.system, history), params, interactive)
        except FreeTokenError as e:  # e.g. the history outgrew the context: keep the session, say what to do
            history.pop()
            print(f"ft chat: {e}; /reset starts a fresh conversation", file=sys.stderr)
            continue
        history.append({"role": "assistant", "content": reply})


def _chat_turn(lm, generator, messages: list[dict], params: SamplingParams, interactive: bool) -> str:
    ids = lm.tokenizer.encode(lm.tokenizer.apply_chat_template(messages))
    if interactive:
        sys.stdout.write("assistant> ")
    reply: list[str] = []
    for ev in generator.stream(ids, params):
        reply.append(ev.text)
        sys.stdout.write(ev.text)
        sys.stdout.flush()
    print()
    return "".join(reply)


def info(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="ft info", description="Describe a model without loading its weights.")
    p.add_argument("model", nargs="?", default=None, help="HF model directory, .gguf file or cached repo id")
    a = p.parse_args(argv)
    from freetoken.engine.model_info import describe

    print(describe(a.model))
    return 0


def main(verb: str, argv: list[str]) -> int:
    return {"generate": generate, "chat": chat, "info": info}[verb](argv)
