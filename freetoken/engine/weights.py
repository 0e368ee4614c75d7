"""Placing checkpoint tensors into a freshly built model and its expert store.

Dense parameters are copied into the model by HF name. Routed experts arrive either one expert at a time (HF
checkpoints) or stacked per layer (GGUF); both are written into one preallocated [E, out, in] tensor per layer
and projection, so stacking never holds a second copy. `finish()` checks that nothing is missing.
"""

from __future__ import annotations

import logging
import re
import threading

import torch
from torch import nn

from freetoken.engine.checkpoints import RawTensor
from freetoken.engine.config import MoESpec
from freetoken.engine.experts import LayerExperts
from freetoken.engine.models.moe import ExpertNaming
from freetoken.engine.offload.quantized import QuantizedExperts
from freetoken.errors import ModelLoadError

log = logging.getLogger(__name__)
STACKED_EXPERT = re.compile(r"model\.layers\.(\d+)\.experts\.(gate_proj|up_proj|down_proj)")
_IGNORED = re.compile(r".*rotary_emb\.inv_freq|lm_head\.weight")  # recomputed / tied: safe to skip


class WeightPlacer:
    def __init__(self, model: nn.Module, naming: ExpertNaming | None, spec: MoESpec | None,
                 dtype: torch.dtype, device: torch.device, expert_device: torch.device | None = None,
                 pin_experts: bool = False):
        self.params = dict(model.named_parameters())
        self.naming, self.spec, self.dtype, self.device = naming, spec, dtype, device
        self.expert_device = expert_device or device
        self.pin_experts = pin_experts
        self.filled: set[str] = set()
        self.experts: dict[int, dict[str, torch.Tensor]] = {}
        self.expert_parts: dict[tuple[int, str], set[int]] = {}
        self.unexpected: list[str] = []
        self.quantized: dict[int, dict[str, tuple[torch.Tensor, str, tuple[int, int]]]] = {}
        self._lock = threading.Lock()  # place() runs on several threads: stacks are created once

    def place(self, name: str, load) -> None:
        """`load` is called only for tensors we keep."""
        if name in self.params:
            self._fill(name, self.params[name], load)
            self.filled.add(name)
        elif (m := STACKED_EXPERT.fullmatch(name)) and self.spec is not None:
            layer, proj = int(m.group(1)), m.group(2)
            value = load()
            if isinstance(value, RawTensor):
                self._keep_quantized(name, layer, proj, value)
            else:
                self._copy(name, self._expert_slot(layer, proj), value)
            self.expert_parts[(layer, proj)] = set(range(self.spec.num_experts))
        elif self.naming is not None and (hit := self.naming.match(name)) and self.spec is not None:
            layer, expert, proj = hit
            if getattr(load, "raw", False):  # one expert's bytes in a block format (block-FP8 checkpoints)
                self._keep_quantized_expert(name, layer, expert, proj, load())
            else:
                self._fill(name, self._expert_slot(layer, proj)[expert], load)
            with self._lock:
                self.expert_parts.setdefault((layer, proj), set()).add(expert)
        elif not _IGNORED.fullmatch(name):
            self.unexpected.append(name)

    def _expert_slot(self, layer: int, proj: str) -> torch.Tensor:
        spec = self.spec
        if layer not in spec.moe_layers:
            raise ModelLoadError(f"checkpoint has routed experts for layer {layer}, which the config makes dense")
        with self._lock:
            slots = self.experts.setdefault(layer, {})
            if proj not in slots:
                h, i = spec.hidden_size, spec.expert_intermediate_size
                shape = (spec.num_experts, h, i) if proj == "down_proj" else (spec.num_experts, i, h)
                slots[proj] = self._expert_tensor(shape)
            return slots[proj]

    def _keep_quantized(self, name: str, layer: int, proj: str, raw: RawTensor) -> None:
        spec = self.spec
        h, i = spec.hidden_size, spec.expert_intermediate_size
        shape = (h, i) if proj == "down_proj" else (i, h)
        if tuple(raw.shape) != (spec.num_experts, *shape):
            raise ModelLoadError(f"tensor {name} has shape {tuple(raw.shape)}, the config implies "
                                 f"{(spec.num_experts, *shape)}; the checkpoint and its metadata disagree")
        per_expert = raw.n_bytes // spec.num_experts
        dest = self._expert_tensor((spec.num_experts, per_expert), torch.uint8)
        raw.read_into(dest.numpy())  # read from the file straight into (pinned) host memory
        self.quantized.setdefault(layer, {})[proj] = (dest, raw.type_name, shape)

    def _keep_quantized_expert(self, name: str, layer: int, expert: int, proj: str, raw: RawTensor) -> None:
        """Expert `expert`'s row of the layer's [E, bytes] stack of `proj` in raw's format (allocated by the
        first expert to arrive)."""
        spec = self.spec
        h, i = spec.hidden_size, spec.expert_intermediate_size
        shape = (h, i) if proj == "down_proj" else (i, h)
        if tuple(raw.shape) != shape:
            raise ModelLoadError(f"tensor {name} has shape {tuple(raw.shape)}, the config implies {shape}; the "
                                 "checkpoint and its config.json disagree")
        with self._lock:
            parts = self.quantized.setdefault(layer, {})
            if proj not in parts:
                parts[proj] = (self._expert_tensor((spec.num_experts, raw.n_bytes), torch.uint8), raw.type_name, shape)
            dest, type_name, _ = parts[proj]
        if type_name != raw.type_name or dest.shape[1] != raw.n_bytes:
            raise ModelLoadError(f"tensor {name} is {raw.type_name}, its layer's other experts {type_name}")
        raw.read_into(dest[expert].numpy())

    def _expert_tensor(self, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or self.dtype
        if self.pin_experts:
            try:
                return torch.empty(shape, dtype=dtype, pin_memory=True)
            except RuntimeError as e:  # e.g. the locked-memory limit: still correct, only copies get slower
                log.warning("cannot pin host memory for experts (%s); using pageable memory", e)
                self.pin_experts = False
        return torch.empty(shape, dtype=dtype, device=self.expert_device)

    def _fill(self, name: str, dest: torch.Tensor, load) -> None:
        """Host destinations are read into directly (no intermediate copy); others go through a CPU tensor."""
        value = load(dest) if dest.device.type == "cpu" else load()
        if value is not dest:
            self._copy(name, dest, value)

    @staticmethod
    def _copy(name: str, dest: torch.Tensor, src: torch.Tensor) -> None:
        if tuple(src.shape) != tuple(dest.shape):
            raise ModelLoadError(f"tensor {name} has shape {tuple(src.shape)}, the config implies "
                                 f"{tuple(dest.shape)}; the checkpoint and its config.json disagree")
        with torch.no_grad():
            dest.copy_(src)

    def finish(self) -> dict[int, LayerExperts | QuantizedExperts] | None:
        """Checks completeness; returns each MoE layer's stacked experts (None for a dense model)."""
        missing = sorted(set(self.params) - self.filled)
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise ModelLoadError(f"checkpoint lacks {', '.join(missing[:5])}{more}; the files are incomplete")
        if self.unexpected:
            log.warning("ignored %d unexpected tensors, e.g. %s", len(self.unexpected), self.unexpected[0])
        if self.spec is None:
            return None
        for layer in self.spec.moe_layers:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                got = self.expert_parts.get((layer, proj), set())
                if len(got) != self.spec.num_experts:
                    raise ModelLoadError(f"checkpoint lacks routed experts of layer {layer} ({proj}: "
                                         f"{len(got)} of {self.spec.num_experts}); the files are incomplete")
        layers: dict[int, LayerExperts | QuantizedExperts] = {
            layer: LayerExperts(**parts) for layer, parts in self.experts.items()}
        for layer, parts in self.quantized.items():
            if len(parts) != 3 or layer in layers:
                raise ModelLoadError(f"layer {layer} mixes quantized and dense routed experts; not supported")
            layers[layer] = QuantizedExperts({p: v[0] for p, v in parts.items()},
                                             {p: v[1] for p, v in parts.items()}, {p: v[2] for p, v in parts.items()})
        return layers
