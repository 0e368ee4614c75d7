"""`load_model`: from a model source (HF directory, .gguf file, cached HF repo id, or the embedded default) to a
ready `LoadedModel` on one device, with a progress bar on stderr while weights stream in."""

from __future__ import annotations

import logging
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from freetoken.engine import gpu_paths
from freetoken.engine.attention import BatchAttention, SequenceAttention, TrailingAttention
from freetoken.engine.checkpoints import open_checkpoint
from freetoken.engine.config import MoESpec
from freetoken.engine.experts import ExpertExecutor, ResidentExpertExecutor
from freetoken.engine.kv_cache import PagedKVCache, SequenceKV
from freetoken.engine.models import family_for
from freetoken.engine.models.decoder import DecoderModel
from freetoken.engine.offload.budget import resolve_auto, split_expert_budget, staging_slots_for
from freetoken.engine.offload.calibrate import load_profile
from freetoken.engine.offload.executor import OffloadedExpertExecutor
from freetoken.engine.offload.planner import MissPlanner
from freetoken.engine.offload.quantized import QuantizedExperts
from freetoken.engine.rope import RotaryEmbedding
from freetoken.engine.sources import resolve_model_source
from freetoken.engine.weights import STACKED_EXPERT, WeightPlacer
from freetoken.errors import ModelLoadError

log = logging.getLogger(__name__)


@dataclass(slots=True)
class LoadedModel:
    model: DecoderModel
    args: object  # the family's ModelArgs
    family: ModuleType
    tokenizer: object  # freetoken.engine.tokenizer.Tokenizer
    moe_spec: MoESpec | None
    experts: ExpertExecutor | None
    device: torch.device
    dtype: torch.dtype
    source: Path
    format: str  # "hf" or "gguf"
    config: dict

    @property
    def context_length(self) -> int:
        return self.model.args.max_position_embeddings

    @property
    def has_recurrent_state(self) -> bool:
        """Some layer keeps per-sequence recurrent state (it cannot be rolled back, only restored, and is not
        captured in CUDA graphs or batched yet)."""
        return any(getattr(m, "recurrent", False) for m in self.model.modules())

    @property
    def decodes_eagerly(self) -> bool:
        """Some layer cannot run in a captured decode step (DeepSeek-V4's compressed attention: its state changes
        shape as windows close), so decode never goes through CUDA graphs."""
        return any(getattr(m, "eager_only", False) for m in self.model.modules())

    @property
    def has_mtp(self) -> bool:
        """The multi-token-prediction layer is loaded (`load_model(mtp=True)`): speculative decoding can run."""
        return hasattr(self.model, "mtp")

    def new_cache(self, page_size: int = 16, initial_tokens: int = 1024,
                  max_tokens: int | None = None) -> PagedKVCache:
        a, n_layers = self.model.args.attention, self.model.args.n_layers
        pages = -(-initial_tokens // page_size)
        max_pages = None if max_tokens is None else -(-max_tokens // page_size)
        kv_layers = attention_layers(self.args)
        if self.has_mtp:  # the MTP layer's rows are layer n_layers (hybrid families list it already)
            kv_layers = None if kv_layers is None else tuple(sorted({*kv_layers, n_layers}))
            n_layers += 1
        return PagedKVCache(n_layers, a.n_kv_heads, a.head_dim, page_size=page_size,
                            dtype=self.dtype, device=self.device, initial_pages=pages, max_pages=max_pages,
                            kv_layers=kv_layers, values_are_keys=getattr(self.args, "values_are_keys", False))

    def forward(self, tokens: torch.Tensor, cache: PagedKVCache, seq: SequenceKV,
                logits_for: str = "all") -> torch.Tensor:
        """Appends `tokens` [T] to `seq` in `cache` and returns their logits ([T, V], or [1, V] for "last")."""
        ctx = SequenceAttention(cache, seq, tokens.shape[0], self.device)
        logits = self.model(tokens, ctx, logits_for)
        ctx.commit()
        return logits

    def forward_hidden(self, tokens: torch.Tensor, cache: PagedKVCache, seq: SequenceKV,
                       logits_for: str = "all") -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`, also returning every token's final hidden state (what the multi-token-prediction layer
        reads: after the final norm [T, Hd]; DeepSeek-V4's streams [T, N·Hd])."""
        rows = slice(-1, None) if logits_for == "last" else slice(None)
        return self._with_hidden(SequenceAttention(cache, seq, tokens.shape[0], self.device), tokens, rows)

    def forward_batch_hidden(self, tokens: torch.Tensor, cache: PagedKVCache, seqs: list[SequenceKV],
                             counts: list[int], rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward_batch` returning the logits of the given rows [R, V] and every row's final hidden state (as
        `forward_hidden`)."""
        ctx = BatchAttention(cache, seqs, counts, self.device)
        return self._with_hidden(ctx, tokens, torch.tensor(rows, device=self.device))

    def _with_hidden(self, ctx, tokens: torch.Tensor, rows: slice | torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        normed, hidden = self.model.final_states(tokens, ctx)
        logits = F.linear(normed[rows], self.model.output_weight())
        ctx.commit()
        return logits, hidden

    def draft(self, hidden: torch.Tensor, next_tokens: torch.Tensor, cache: PagedKVCache, seq: SequenceKV,
              start: int) -> torch.Tensor:
        """The multi-token-prediction layer at positions [start, start + T) that `seq` holds: hidden [T, Hd] from
        `forward_hidden` at those positions, next_tokens [T] the token after each → logits [T, V] of the token
        after that (the draft)."""
        ctx = TrailingAttention(cache, seq, start, next_tokens.shape[0], self.device)
        return self.model.mtp(self.model, hidden, next_tokens, ctx)

    def forward_batch(self, tokens: torch.Tensor, cache: PagedKVCache, seqs: list[SequenceKV],
                      counts: list[int]) -> torch.Tensor:
        """One forward over new tokens of several sequences: `tokens` [sum(counts)] holds counts[i] tokens of
        seqs[i] in order. Returns the logits of each sequence's last new token, [len(seqs), V]."""
        ctx = BatchAttention(cache, seqs, counts, self.device)
        rows = torch.tensor(ctx.last_rows(), device=self.device)
        logits = self.model(tokens, ctx, rows)
        ctx.commit()
        return logits

    @torch.inference_mode()
    def prefill_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits [T, V] (fp32) of a fresh sequence: a correctness probe, not the serving path."""
        cache = self.new_cache(initial_tokens=len(token_ids))
        tokens = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        return self.forward(tokens, cache, cache.new_sequence()).float()


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_model(source: str | os.PathLike | None = None, *, device: str | torch.device = "cpu",
               dtype: torch.dtype | None = None, progress: bool = True, expert_cache: int | str | None = None,
               expert_policy: str = "freq", prefill_ahead: bool | None = None, mtp: bool = False,
               on_progress=None, block_share: float | None = None) -> LoadedModel:
    """Loads a model onto `device`. `expert_cache` (bytes) keeps routed experts in host memory with a cache
    of that many bytes on the device; "auto" sizes it from free device memory (resident when all fit); None
    keeps every expert resident on the device. `prefill_ahead`: offloaded prefill chunks stream the next layer's
    experts while each layer computes (a staging ring of two layers' experts; see OffloadedExpertExecutor);
    None: on for CUDA devices (GPU path "prefill-ahead", see gpu_paths). `mtp`: also load the checkpoint's
    multi-token-prediction layer (models/mtp.py), for speculative decoding. `block_share`: the fraction of the
    expert cache that keeps quantized experts in their block format (see `build_executor`).
    `on_progress(done, total)` is called as tensors land (from the loading threads too)."""
    device = resolve_device(device)
    dtype = dtype or default_dtype(device)
    if prefill_ahead is None:
        prefill_ahead = device.type == "cuda" and gpu_paths.enabled("prefill-ahead")
    path = resolve_model_source(source)
    ckpt = open_checkpoint(path)
    family = family_for(ckpt.config.get("model_type"))
    args = family.ModelArgs.from_config(ckpt.config)
    if mtp:
        if not hasattr(family, "with_mtp"):
            raise ModelLoadError(f"{family.MODEL_TYPE} models have no multi-token-prediction support here; run "
                                 "without speculative decoding")
        args = family.with_mtp(args)
    spec = args.moe_spec()
    tokenizer = ckpt.tokenizer()

    start = time.perf_counter()
    model = empty_model(family, args, dtype, device)
    if expert_cache == "auto":  # dense models have nothing to offload
        dense_bytes = sum(p.numel() for p in model.parameters()) * dtype.itemsize
        expert_cache = resolve_auto(device, spec, args, dense_bytes, dtype, prefill_ahead) if spec is not None \
            else None
    offload = expert_cache is not None and spec is not None
    placer = WeightPlacer(model, getattr(family, "EXPERT_NAMING", None), spec, dtype, device,
                          expert_device=torch.device("cpu") if offload else None,
                          pin_experts=offload and device.type == "cuda")
    # Offloaded GGUF experts stay in their block format in host memory: fewer bytes per cache miss.
    # (and offloaded experts of a block-FP8 checkpoint stay FP8)
    raw_experts = offload and (ckpt.experts_quantized() if ckpt.format == "gguf" else True)
    items = list(ckpt.tensors(family.MODEL_TYPE, dtype, device, raw_experts=raw_experts))
    if (rename := getattr(family, "checkpoint_name", None)) is not None:  # the family's names; None: not loaded
        items = [(new, load) for name, load in items if (new := rename(name, args)) is not None]
    if mtp and not any(name.startswith("mtp.") for name, _ in items):  # (transformers drops it when re-saving)
        raise ModelLoadError(f"{path.name} has no multi-token-prediction layer's weights, though its config "
                             "names one; run it without speculative decoding")
    if (expand := getattr(family, "checkpoint_items", None)) is not None:  # tensors the family cuts or fuses
        items = expand(items, args, keep_packed=offload)  # offloaded quantized experts stay in their format
    # On a terminal the bar redraws often; in a log (no TTY) it writes a line every few seconds at most.
    interactive = sys.stderr.isatty()
    bar = tqdm(total=len(items), desc=f"loading {path.name}", unit="tensor", disable=not progress, leave=False,
               mininterval=0.2 if interactive else 5.0, ascii=not interactive)
    # Tensors read straight into their destination (safetensors; GGUF experts kept in block format) are read by
    # several threads at once: storage serves parallel reads faster, and no read makes a temporary copy, so
    # peak memory stays at the model's bytes. Dequantized GGUF tensors go one by one (each makes a temporary).
    parallel = (lambda name: True) if ckpt.format == "hf" else \
        (lambda name: raw_experts and bool(STACKED_EXPERT.fullmatch(name)))
    landed = [0]

    def done() -> None:
        bar.update()
        landed[0] += 1
        if on_progress is not None:
            on_progress(landed[0], len(items))

    place_all(placer, items, parallel, done)
    bar.close()
    layers = placer.finish()
    if layers is not None and hasattr(model, "expert_forms"):  # biases and activation beside the stacks
        for layer, form in model.expert_forms().items():
            layers[layer].form = form
    experts = build_executor(layers, spec, dtype, device, expert_cache if offload else None, expert_policy,
                             prefill_ahead=prefill_ahead, block_share=block_share)
    attach_experts(model, experts)
    model.eval()
    log.info("loaded %s (%s, %s) on %s in %.1fs", path.name, family.MODEL_TYPE, ckpt.format, device,
             time.perf_counter() - start)
    return LoadedModel(model, args, family, tokenizer, spec, experts, device, dtype, path, ckpt.format,
                       ckpt.config)


def attention_layers(args) -> tuple[int, ...] | None:
    """The layers that keep K/V: all (None) but in hybrid families, which list their full-attention layers."""
    return getattr(args, "full_attention_layers", None)


def resolve_device(device: str | torch.device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def empty_model(family: ModuleType, args, dtype: torch.dtype, device: torch.device) -> DecoderModel:
    """The family's model on `device` with uninitialised parameters (filled by the caller) and live buffers."""
    with torch.device("meta"), no_param_init():
        model = family.Model(args)
    model = model.to(dtype).to_empty(device=device)
    model.rotary = RotaryEmbedding(args.decoder.rope).to(device)  # buffers are not in checkpoints
    return model


READ_THREADS = min(8, os.cpu_count() or 1)


def place_all(placer: WeightPlacer, items: list, parallel, done) -> None:
    """Places every (name, load) item; those `parallel(name)` accepts on READ_THREADS threads."""
    for name, load in items:
        if not parallel(name):
            placer.place(name, load)
            done()
    concurrent = [(name, load) for name, load in items if parallel(name)]
    if not concurrent:
        return
    with ThreadPoolExecutor(READ_THREADS, thread_name_prefix="ft-load") as pool:
        futures = [pool.submit(placer.place, name, load) for name, load in concurrent]
        try:
            for future in as_completed(futures):
                future.result()  # re-raises the first failure (a clear ModelLoadError) here
                done()
        except BaseException:
            for future in futures:
                future.cancel()
            raise


def build_executor(layers, spec: MoESpec | None, dtype: torch.dtype, device: torch.device, cache_bytes: int | None,
                   policy: str = "freq", miss_path: str = "auto", prefill_ahead: bool = False,
                   block_share: float | None = None) -> ExpertExecutor | None:
    """`block_share`: the fraction of `cache_bytes` that keeps quantized experts in their block format on the
    device (a block store, block_store.py); None: `default_block_share()`. Dense experts ignore it."""
    if layers is None:
        return None
    if cache_bytes is None:
        return ResidentExpertExecutor(layers)
    per_expert = spec.bytes_per_expert(dtype)
    first = next(iter(layers.values()))
    row_bytes = first.expert_nbytes() if isinstance(first, QuantizedExperts) else None
    share = default_block_share() if block_share is None else block_share
    slots, rows = split_expert_budget(cache_bytes, share, per_expert, row_bytes, spec.total_routed_experts)
    log.info("expert cache: %d of %d experts on %s (%.1f MiB)%s, the rest in host memory (%.1f MiB)", slots,
             spec.total_routed_experts, device, slots * per_expert / 2**20,
             f" and {rows} in their block format ({rows * row_bytes / 2**20:.1f} MiB)" if rows else "",
             spec.total_routed_experts * (row_bytes or per_expert) / 2**20)
    executor = OffloadedExpertExecutor(layers, device, slots, policy, miss_path, dtype, planner_for(device),
                                       staging_slots_for(spec, per_expert, prefill_ahead), rows)
    executor.block_share = share if rows else 0.0
    executor.prefill_ahead = prefill_ahead
    return executor


def default_block_share() -> float:
    """How much of an expert cache keeps quantized experts in their block format: all of it with the GPU path
    "block-store", else none (every cached expert dequantized, as before the store existed)."""
    return 1.0 if gpu_paths.enabled("block-store") else 0.0


def planner_for(device: torch.device) -> MissPlanner | None:
    """A planner seeded from this machine's `ft calibrate` profile, or None (the executor's defaults)."""
    profile = load_profile(torch.device(device))
    if profile is None:
        # the defaults are a slow machine's (copies 20, CPU 10 GB/s): a server's CPU share then starts out far
        # too small and grows only as probes measure it, a prefill planner's too (it is seeded from decode's)
        log.info("no calibration profile for this machine: the miss planner starts from default bandwidths and "
                 "learns them; `ft calibrate` measures them once (about a minute)")
        return None
    if not profile.h2d_gb_s:  # calibrated without a GPU: nothing to seed a copy path with
        return None
    return MissPlanner(profile.h2d_gb_s, profile.cpu_expert_gb_s)


@contextmanager
def no_param_init():
    """Skips nn default initialisation: every parameter is overwritten from the checkpoint anyway, and random
    init (even on the meta device) costs seconds for a large vocabulary."""
    saved = {cls: cls.reset_parameters for cls in (nn.Linear, nn.Embedding)}
    try:
        for cls in saved:
            cls.reset_parameters = lambda self: None
        yield
    finally:
        for cls, fn in saved.items():
            cls.reset_parameters = fn


def attach_experts(model: DecoderModel, experts: ExpertExecutor | None) -> None:
    """Points every MoE block at `experts`; an executor that predicts routing (prefetch) also gets the routers."""
    routers = {}
    for module in model.modules():
        if hasattr(module, "experts") and hasattr(module, "top_k"):
            module.experts = experts
            routers[module.layer_idx] = (module.gate.weight, module.top_k)
    if hasattr(experts, "set_routers"):
        experts.set_routers(routers)
