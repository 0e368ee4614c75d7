"""What the offloaded-executor tests share: the MoE families they run, greedy sampling, a fixed even split."""

from __future__ import annotations

from freetoken.engine.generator import Generator
from freetoken.engine.loader import load_model
from freetoken.engine.offload.planner import MissPlanner
from freetoken.engine.sampling import SamplingParams
from support.checkpoints import PARITY_CASES, prompt_ids, write_hf_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
MOE_FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral"]


def EVEN_SPLIT() -> MissPlanner:  # noqa: N802 - a planner factory that reads like a constant
    """Equal, fixed costs: `auto` splits each step's misses evenly, the same on every machine (the learnt split
    depends on this machine's timings, which a test must not)."""
    return MissPlanner(20, 20, copy_fixed_s=0, cpu_fixed_s=0, learn=False)


def family_checkpoint(family: str, path):
    """(checkpoint path, its resident model, the resident greedy tokens of `prompt_ids()`) of a tiny `family`
    checkpoint written to `path`."""
    write_hf_checkpoint(path=path, **PARITY_CASES[family])
    resident = load_model(path, progress=False)
    return path, resident, Generator(resident).generate_ids(prompt_ids(), GREEDY)
