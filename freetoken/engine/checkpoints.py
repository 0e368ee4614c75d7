"""Checkpoint readers: an HF model directory (sharded safetensors) or a single GGUF file, both presented as an
HF-style config dict plus (HF name, lazy tensor) pairs. Tensors are read one at a time from mmapped files, so a
model never sits in RAM twice.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from freetoken.engine.formats import gguf_model
from freetoken.engine.formats.gguf_file import GGUFFile
from freetoken.engine.formats.safetensors_file import SafetensorsFile
from freetoken.engine.models import family_for
from freetoken.errors import ModelLoadError
from freetoken.kernels.fp8_block.reference import ROW_BLOCK, dequantize_fp8_blocks, to_row_blocks
from freetoken.kernels.mxfp4.reference import dequantize_mxfp4, to_gguf_blocks

# (HF name, load): `load(into)` returns the tensor, read straight into `into` where the format allows.
TensorItems = Iterator[tuple[str, Callable[..., "torch.Tensor | RawTensor"]]]
_DENSE_TYPES = ("F32", "F16", "BF16")


@dataclass(slots=True, frozen=True)
class RawTensor:
    """A tensor's bytes in its GGUF block format, not dequantized (kept so for offloaded experts)."""

    type_name: str
    shape: tuple[int, ...]
    n_bytes: int
    read_into: Callable[[np.ndarray], np.ndarray]  # fills a uint8 array of n_bytes from the file


class HFCheckpoint:
    format = "hf"

    def __init__(self, root: Path):
        self.root = root
        config_path = root / "config.json"
        if not config_path.is_file():
            raise ModelLoadError(
                f"{root}: no config.json; an HF model directory needs config.json, *.safetensors and tokenizer.json"
            )
        try:
            self.config = json.loads(config_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"{config_path}: not valid JSON ({e})") from None
        family_for(self.config.get("model_type"))  # an unsupported architecture fails before any weight I/O
        self.shards = self._shards()

    def _shards(self) -> dict[str, Path]:
        """Tensor name → shard file, from the index when there is one."""
        index = self.root / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, UnicodeDecodeError) as e:
                raise ModelLoadError(f"{index}: malformed safetensors index ({e})") from None
            for shard in sorted(set(weight_map.values())):
                if not (self.root / shard).is_file():
                    raise ModelLoadError(f"{self.root}: shard {shard} named in {index.name} is missing; "
                                         "re-download the checkpoint")
            return {name: self.root / shard for name, shard in weight_map.items()}
        files = sorted(self.root.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"{self.root}: no *.safetensors weights found")
        return {name: f for f in files for name in SafetensorsFile(f).keys()}

    def tensors(self, model_type: str, dtype: torch.dtype, device: torch.device,
                raw_experts: bool = False) -> TensorItems:
        """Tensors in the checkpoint's own dtype, but block-scaled ones, which come dequantized (the scales
        beside them are consumed): FP8 weights (DeepSeek-V3's `weight_scale_inv`, V4's `scale`) and FP4 ones
        (int8, two e2m1 values a byte with a power-of-two scale per 32: DeepSeek-V4's routed experts). With
        `raw_experts` routed experts come as `RawTensor`s instead, kept in host memory as they ship: FP8 in the
        FP8_B32 layout (half bf16's bytes), FP4 as MXFP4 blocks (a quarter and a bit)."""
        block = self._fp8_block()
        by_file: dict[Path, list[str]] = {}
        for name, f in self.shards.items():
            by_file.setdefault(f, []).append(name)
        readers: dict[Path, SafetensorsFile] = {}

        def reader_of(f: Path) -> SafetensorsFile:
            if f not in readers:
                readers[f] = SafetensorsFile(f)
            return readers[f]

        for f, names in by_file.items():
            reader = reader_of(f)
            for name in names:
                if block is not None and self._is_scale(name):
                    continue  # read with its weight
                scale = self._scale_of(name) if block is not None else None
                if scale is None:
                    yield name, lambda into=None, r=reader, n=name: r.read(n, into)
                    continue
                scales, routed = reader_of(self.shards[scale]), raw_experts and ROUTED_EXPERT.search(name)
                if reader.entries[name].dtype == torch.int8:  # FP4 pairs, a scale per 32 values of a row
                    yield name, _fp4_raw(reader, name, scales, scale) if routed else \
                        _fp4_load(reader, name, scales, scale, dtype)
                elif routed and block[1] % ROW_BLOCK == 0:
                    yield name, _fp8_raw(reader, name, scales, scale, block)
                else:
                    yield name, _fp8_load(reader, name, scales, scale, block, dtype)

    def _scale_of(self, name: str) -> str | None:
        """The block scales of weight `name`: DeepSeek-V3's `X.weight_scale_inv` or V4's `X.scale`."""
        for scale in (name + "_scale_inv", name.removesuffix(".weight") + ".scale"):
            if name.endswith(".weight") and scale in self.shards:
                return scale
        return None

    def _is_scale(self, name: str) -> bool:
        return name.endswith("_scale_inv") or (name.endswith(".scale")
                                               and name.removesuffix(".scale") + ".weight" in self.shards)

    def _fp8_block(self) -> tuple[int, int] | None:
        """The scale block of a block-wise FP8 checkpoint (`quantization_config.quant_method: fp8`), else None."""
        q = self.config.get("quantization_config") or {}
        if q.get("quant_method") != "fp8":
            return None
        block = q.get("weight_block_size")
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise ModelLoadError(f"{self.root}: an fp8 checkpoint without a usable weight_block_size ({block!r}); "
                                 "only block-wise FP8 (DeepSeek-V3 style, e.g. [128, 128]) is supported")
        return block[0], block[1]

    def tokenizer(self):
        from freetoken.engine.tokenizer import Tokenizer

        return Tokenizer.from_hf_dir(self.root)


# a routed expert's projection in an HF checkpoint (shared experts carry no index)
ROUTED_EXPERT = re.compile(r"\.experts\.\d+\.(?:gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")


def _fp8_raw(reader: SafetensorsFile, name: str, scales: SafetensorsFile, scale_name: str, block: tuple[int, int]):
    """A loader of one FP8 expert projection as a `RawTensor` in the FP8_B32 row-block layout. Marked `raw` so
    the weight placer keeps it in that format."""
    def load(into=None) -> RawTensor:
        weight = reader.read(name)
        packed = to_row_blocks(weight, scales.read(scale_name), block)

        def read_into(dest):
            dest.reshape(-1)[:] = packed.reshape(-1).numpy()
            return dest

        return RawTensor("FP8_B32", tuple(weight.shape), packed.numel(), read_into)

    load.raw = True
    return load


def _fp8_load(reader: SafetensorsFile, name: str, scales: SafetensorsFile, scale_name: str, block: tuple[int, int],
              dtype: torch.dtype) -> Callable[..., torch.Tensor]:
    def load(into=None) -> torch.Tensor:
        return dequantize_fp8_blocks(reader.read(name), scales.read(scale_name), block, dtype)

    return load


def _fp4_parts(reader: SafetensorsFile, name: str, scales: SafetensorsFile,
               scale_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP4 weight [N, K/2] (int8, value 2j in the low nibble of byte j) and its scales [N, K/32] (E8M0 bytes, or
    fp32 powers of two) as MXFP4 blocks [N, K/32, 16] and exponent bytes [N, K/32]: gpt-oss's layout."""
    packed = reader.read(name).view(torch.uint8)
    n, half = packed.shape
    s = scales.read(scale_name)
    if s.dtype == torch.float8_e8m0fnu:
        s = s.view(torch.uint8)
    elif s.dtype == torch.float32:  # a power of two is its exponent byte exactly; anything else has no E8M0 form
        mantissa, exponent = torch.frexp(s)
        if not bool((mantissa == 0.5).all()):
            raise ModelLoadError(f"{scale_name}: FP4 scales that are not powers of two are not supported")
        s = (exponent - 1 + 127).to(torch.uint8)
    if s.dtype != torch.uint8 or tuple(s.shape) != (n, half // 16) or half % 16:
        raise ModelLoadError(f"{scale_name}: {tuple(s.shape)} {s.dtype} scales do not fit the FP4 weight {name} "
                             f"[{n}, {2 * half}] (one per 32 values)")
    return packed.view(n, half // 16, 16), s


def _fp4_raw(reader: SafetensorsFile, name: str, scales: SafetensorsFile, scale_name: str):
    """A loader of one FP4 expert projection as a `RawTensor` of MXFP4 blocks (ggml's layout, as gpt-oss's experts
    are kept). Marked `raw` so the weight placer keeps it in that format."""
    def load(into=None) -> RawTensor:
        blocks, exponents = _fp4_parts(reader, name, scales, scale_name)
        packed = to_gguf_blocks(blocks, exponents)  # [N, K/32, 17]

        def read_into(dest):
            dest.reshape(-1)[:] = packed.reshape(-1).numpy()
            return dest

        return RawTensor("MXFP4", (blocks.shape[0], blocks.shape[1] * 32), packed.numel(), read_into)

    load.raw = True
    return load


def _fp4_load(reader: SafetensorsFile, name: str, scales: SafetensorsFile, scale_name: str,
              dtype: torch.dtype) -> Callable[..., torch.Tensor]:
    def load(into=None) -> torch.Tensor:
        return dequantize_mxfp4(*_fp4_parts(reader, name, scales, scale_name), dtype)

    return load


class GGUFCheckpoint:
    format = "gguf"

    def __init__(self, path: Path):
        self.path = path
        self.file = GGUFFile(path)
        self.config = gguf_model.hf_config(self.file)
        family_for(self.config["model_type"])
        self.arch = self.file.metadata["general.architecture"]

    def experts_quantized(self) -> bool:
        """Whether every stacked routed-expert tensor is in a block format (so it can stay quantized)."""
        infos = [i for n, i in self.file.tensors.items() if n.endswith("_exps.weight")]
        return bool(infos) and all(i.type_name not in _DENSE_TYPES for i in infos)

    def tensors(self, model_type: str, dtype: torch.dtype, device: torch.device,
                raw_experts: bool = False) -> TensorItems:
        """With `raw_experts`, stacked routed experts come as `RawTensor`s instead of dequantized tensors."""
        for gname in self.file.tensors:
            name = gguf_model.hf_name(gname, model_type)
            if name is None:
                continue
            if raw_experts and gname.endswith("_exps.weight"):
                info = self.file.tensors[gname]
                yield name, lambda into=None, g=gname, i=info: RawTensor(
                    i.type_name, i.shape, i.n_bytes, lambda out, g=g: self.file.read(g, out))
                continue

            def load(into=None, g=gname) -> torch.Tensor:  # GGUF data is dequantized: never read in place
                t = self.file.load(g, dtype=dtype, device=device)
                if (joined := gguf_model.joined_tensor(g, self.arch)) is not None:  # a parameter split in two
                    other, merge = joined
                    return merge(t, self.file.load(other, dtype=dtype, device=device), self.config)
                return gguf_model.to_hf_layout(g, t, self.config, self.arch)

            yield name, load

    def tokenizer(self):
        from freetoken.engine.tokenizer import Tokenizer

        return Tokenizer.from_gguf_metadata(self.file.metadata)


def open_checkpoint(path: Path) -> HFCheckpoint | GGUFCheckpoint:
    if path.is_file():
        if path.suffix == ".gguf" or _has_gguf_magic(path):
            return GGUFCheckpoint(path)
        raise ModelLoadError(f"{path}: not a model; pass an HF model directory or a .gguf file")
    if not path.is_dir():
        raise ModelLoadError(f"{path}: no such file or directory")
    if (path / "config.json").is_file():
        return HFCheckpoint(path)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return GGUFCheckpoint(ggufs[0])
    if ggufs:
        raise ModelLoadError(f"{path}: several .gguf files ({', '.join(g.name for g in ggufs)}); pass one of them")
    return HFCheckpoint(path)  # raises the missing-config.json error


def _has_gguf_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"
