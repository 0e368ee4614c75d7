"""gpt-oss (gpt-oss-20b, gpt-oss-120b): attention with a learnt sink logit per head and biases on every
projection, sliding-window (128) and full attention alternating, YaRN RoPE; every layer routes through a biased
linear router (softmax over the top-k logits) to experts with biases and a clamped SwiGLU,
(clamp(up, ±limit) + 1) · gate · σ(α · gate) with gate clamped above at `limit`.

HF checkpoints store each layer's experts fused and transposed: `mlp.experts.gate_up_proj` [E, H, 2I] (gate and up
interleaved along the last dimension), `down_proj` [E, I, H], their biases [E, 2I] / [E, H]; OpenAI's releases
store them as MXFP4 (`*_blocks` [E, out, in/32, 16] + `*_scales` [E, out, in/32], out-by-in, gate and up rows
interleaved). `checkpoint_items` turns either into the engine's stacks [E, I, H] / [E, H, I]; MXFP4 experts stay
MXFP4 in host memory when offloaded (repacked into ggml's block layout, 17 bytes per 32 weights: what the copier
and the CPU kernel read), and are dequantized at load when resident.

Shapes: N tokens, Hd hidden, E experts, K experts per token, I expert intermediate.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.engine.config import MoESpec
from freetoken.engine.experts import ExpertExecutor, ExpertForm
from freetoken.engine.models.common_args import decoder_args, num_experts
from freetoken.engine.models.decoder import Attention, DecoderArgs, DecoderLayer, DecoderModel
from freetoken.errors import ModelLoadError
from freetoken.kernels.mxfp4.reference import dequantize_mxfp4, to_gguf_blocks

MODEL_TYPE = "gpt_oss"


@dataclass(slots=True)
class ModelArgs:
    decoder: DecoderArgs
    num_experts: int
    top_k: int
    intermediate_size: int  # per expert
    sliding_window: int
    sliding_layers: tuple[int, ...]
    swiglu_alpha: float
    swiglu_limit: float

    @classmethod
    def from_config(cls, cfg: dict) -> ModelArgs:
        dec = decoder_args(cfg, qkv_bias=bool(cfg.get("attention_bias", True)))
        dec.attention.o_bias = dec.attention.qkv_bias
        n = dec.n_layers
        types = cfg.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
        if len(types) != n or not set(types) <= {"sliding_attention", "full_attention"}:
            raise ModelLoadError(f"gpt-oss config: layer_types {types!r} do not name {n} sliding/full attention layers")
        return cls(dec, num_experts(cfg), int(cfg.get("num_experts_per_tok") or cfg.get("experts_per_token")),
                   int(cfg["intermediate_size"]), int(cfg.get("sliding_window") or 128),
                   tuple(i for i, t in enumerate(types) if t == "sliding_attention"),
                   float(cfg.get("swiglu_alpha", 1.702)), float(cfg.get("swiglu_limit", 7.0)))

    def moe_spec(self) -> MoESpec:
        return MoESpec(tuple(range(self.decoder.n_layers)), self.num_experts, self.top_k, self.decoder.hidden_size,
                       self.intermediate_size)


class SinkAttention(Attention):
    """Attention whose softmax also counts exp(sink) per head (HF name `sinks`), over a sliding window in the
    sliding layers."""

    def __init__(self, args: DecoderArgs, layer_idx: int, window: int | None):
        super().__init__(args.attention, layer_idx)
        self.sinks = nn.Parameter(torch.zeros(args.attention.n_heads))
        self.window = window

    def attend(self, ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return ctx.attend(self.layer_idx, q, k, v, sinks=self.sinks, window=self.window)


class GptOssMoeBlock(nn.Module):
    """Biased router (top-k of the logits, softmax over those), routed experts with biases and the clamped
    SwiGLU. The expert biases are parameters here (`expert_gate_bias` ...), read by the executors through the
    layer's `ExpertForm`."""

    def __init__(self, layer_idx: int, args: ModelArgs):
        super().__init__()
        h, e, i = args.decoder.hidden_size, args.num_experts, args.intermediate_size
        self.layer_idx, self.top_k = layer_idx, args.top_k
        self.gate = nn.Linear(h, e, bias=True)  # HF: mlp.router
        self.expert_gate_bias = nn.Parameter(torch.zeros(e, i))
        self.expert_up_bias = nn.Parameter(torch.zeros(e, i))
        self.expert_down_bias = nn.Parameter(torch.zeros(e, h))
        self.alpha, self.limit = args.swiglu_alpha, args.swiglu_limit
        self.experts: ExpertExecutor | None = None  # attached by the loader

    def expert_form(self) -> ExpertForm:
        return ExpertForm(self.expert_gate_bias.detach(), self.expert_up_bias.detach(), self.expert_down_bias.detach(),
                          clamped=True, alpha=self.alpha, limit=self.limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        top, ids = torch.topk(logits, self.top_k, dim=-1)
        weights = F.softmax(top, dim=-1, dtype=torch.float32)
        return self.experts.forward(self.layer_idx, x, ids, weights.to(x.dtype))


class Model(DecoderModel):
    def __init__(self, args: ModelArgs):
        dec = args.decoder

        def make_layer(i: int) -> DecoderLayer:
            layer = DecoderLayer(dec, i, GptOssMoeBlock(i, args))
            layer.self_attn = SinkAttention(dec, i, args.sliding_window if i in args.sliding_layers else None)
            return layer

        super().__init__(dec, make_layer)

    def expert_forms(self) -> dict[int, ExpertForm]:
        """Each MoE layer's biases and activation, for the expert store the loader builds."""
        return {layer.mlp.layer_idx: layer.mlp.expert_form() for layer in self.model.layers}


_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_blocks|_scales|_bias)?")


def checkpoint_items(items: list, args: ModelArgs, keep_packed: bool = False) -> list:
    """The checkpoint's (name, load) items under the engine's names: router → `mlp.gate`; fused experts split
    into the stacked `model.layers.N.experts.{gate,up,down}_proj` the loader keeps in its expert store (MXFP4
    pairs of blocks and scales dequantized, or with `keep_packed` kept as ggml MXFP4 blocks); the fused gate/up
    bias split in two."""
    out, packed = [], {}
    for name, load in items:
        m = _EXPERTS.fullmatch(name)
        if m is None:
            out.append((name.replace(".mlp.router.", ".mlp.gate."), load))
            continue
        layer, proj, kind = int(m.group(1)), m.group(2), m.group(3) or ""
        prefix = f"model.layers.{layer}"
        if kind == "_bias":
            if proj == "down_proj":
                out.append((f"{prefix}.mlp.expert_down_bias", load))
            else:
                fused = _Shared(load, 2)
                out.append((f"{prefix}.mlp.expert_gate_bias", lambda *_, f=fused: f()[:, 0::2]))
                out.append((f"{prefix}.mlp.expert_up_bias", lambda *_, f=fused: f()[:, 1::2]))
        elif kind:  # MXFP4: both parts of a projection before it can be read
            packed.setdefault((layer, proj), {})[kind] = load
        elif proj == "down_proj":  # [E, I, H] → [E, H, I]
            out.append((f"{prefix}.experts.down_proj", lambda *_, f=load: f().transpose(1, 2)))
        else:  # [E, H, 2I], gate and up interleaved → [E, I, H] each
            fused = _Shared(load, 2)
            out.append((f"{prefix}.experts.gate_proj", lambda *_, f=fused: f()[:, :, 0::2].transpose(1, 2)))
            out.append((f"{prefix}.experts.up_proj", lambda *_, f=fused: f()[:, :, 1::2].transpose(1, 2)))
    for (layer, proj), parts in packed.items():
        if set(parts) != {"_blocks", "_scales"}:
            lacking = "blocks" if "_scales" in parts else "scales"
            raise ModelLoadError(f"layer {layer} {proj}: an MXFP4 tensor without its {lacking}; the files are "
                                 "incomplete")
        prefix = f"model.layers.{layer}.experts"
        uses = 1 if proj == "down_proj" else 2
        # [E, out, in]; gate_up_proj's rows interleave gate and up
        pair = _Shared(lambda parts=parts: (parts["_blocks"](), parts["_scales"]()), uses)
        rows = {"down_proj": slice(None)} if proj == "down_proj" else {"gate_proj": slice(0, None, 2),
                                                                       "up_proj": slice(1, None, 2)}
        for name, picked in rows.items():
            load = _packed_rows(pair, picked) if keep_packed else \
                (lambda *_, p=pair, r=picked: dequantize_mxfp4(*(t[:, r] for t in p())))
            out.append((f"{prefix}.{name}", load))
    return out


def _packed_rows(pair, rows: slice):
    """A loader of rows `rows` of an MXFP4 projection as a `RawTensor` in ggml's MXFP4 layout ([E, out, in])."""
    from freetoken.engine.checkpoints import RawTensor  # (checkpoints imports the families)

    def load(*_):
        blocks, scales = (t[:, rows] for t in pair())
        e, out, groups, _ = blocks.shape
        packed = to_gguf_blocks(blocks, scales)  # [E, out, G, 17]

        def read_into(dest):
            dest.reshape(-1)[:] = packed.reshape(-1).numpy()
            return dest

        return RawTensor("MXFP4", (e, out, groups * 32), packed.numel(), read_into)

    return load


class _Shared:
    """A tensor read (or dequantized) once for the `uses` items cut from it, and let go after the last: the
    loader's threads may ask for those items at the same time."""

    def __init__(self, load, uses: int):
        self._load, self._left, self._value = load, uses, None
        self._lock = threading.Lock()

    def __call__(self) -> torch.Tensor:
        with self._lock:
            value = self._value if self._value is not None else self._load()
            self._left -= 1
            self._value = value if self._left > 0 else None
            return value
