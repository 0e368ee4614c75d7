"""The Hugging Face `transformers` + `accelerate` offload baseline for `ft bench decode`, on the very same weights.

The synthetic model is written as an HF directory (`ft bench export`'s writer), loaded by `transformers` with
`device_map="auto"` and a `max_memory` cap of the dense weights plus the expert budget on the GPU, so
`accelerate` places what does not fit on the CPU and moves it layer by layer at run time (its offload). Decode
is timed exactly as `run_decode` times freetoken: the same context, the same teacher-forced tokens, greedy
argmax recorded. Needs `transformers` and `accelerate` (the dev extra) and disk room for the model.
"""

from __future__ import annotations

import inspect
import tempfile
import time
from pathlib import Path

import torch

from freetoken.bench.export import write_safetensors_dir


def hf_decode(lm, host_experts: dict, context: int, tokens: int, expert_budget: int,
              workdir: Path | None = None) -> tuple[float, list[int]]:
    """(decode tok/s, greedy argmax per step) of transformers + accelerate offload with `expert_budget` bytes of
    experts allowed on the device beside the dense weights."""
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        path = write_safetensors_dir(lm, Path(tmp) / "model", host_experts, tokenizer=False)
        kwargs: dict = {"dtype": lm.dtype}
        if lm.device.type == "cuda":
            dense = sum(p.numel() * p.element_size() for p in lm.model.parameters())
            gpu = lm.device.index or 0
            kwargs.update(device_map="auto", max_memory={gpu: dense + expert_budget + (2 << 30), "cpu": "1000GiB"})
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        model.eval()
        first = next(model.parameters()).device
        gen = torch.Generator().manual_seed(0)  # the ids run_decode draws
        ids = torch.randint(0, lm.args.decoder.vocab_size, (context + tokens,), generator=gen)
        prompt, feed = ids[:context].to(first), ids[context:].tolist()
        # transformers renamed `past_key_values` to `cache` (5.2x); accept either
        key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        with torch.inference_mode():
            out = model(prompt[None], use_cache=True)
            if lm.device.type == "cuda":
                torch.cuda.synchronize(lm.device)
            produced = []
            t0 = time.perf_counter()
            for token in feed:
                out = model(torch.tensor([[token]], device=first), use_cache=True, **{key: getattr(out, key)})
                produced.append(int(out.logits[0, -1].argmax()))
            elapsed = time.perf_counter() - t0
        del model, out
        if lm.device.type == "cuda":
            torch.cuda.empty_cache()
    return tokens / elapsed, produced
