"""Our safetensors reader: tensors are read with plain file reads straight into their destination.

The format is an 8-byte little-endian header length, a JSON header (name → dtype, shape, byte offsets) and the
raw data. Reading with `readinto` instead of a memory map keeps the process's resident memory at the model's
bytes: mapped file pages would count a second time while weights stream into their place.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from freetoken.errors import ModelLoadError

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,  # power-of-two block scales (DeepSeek-V4's FP8 and FP4 weights)
}
_MAX_HEADER = 100 * 2**20


@dataclass(slots=True, frozen=True)
class TensorEntry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute file offsets
    end: int


class SafetensorsFile:
    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise self._error("truncated: no header")
                (n,) = struct.unpack("<Q", head)
                if n > min(size - 8, _MAX_HEADER):
                    raise self._error(f"truncated or not a safetensors file (header of {n} bytes, file {size})")
                header = json.loads(f.read(n))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise self._error(f"unreadable header ({e})") from None
        header.pop("__metadata__", None)
        self.entries = {name: self._entry(name, info, 8 + n, size) for name, info in header.items()}

    def _error(self, problem: str) -> ModelLoadError:
        return ModelLoadError(f"{self.path}: {problem}; re-download it")

    def _entry(self, name: str, info: dict, data_start: int, size: int) -> TensorEntry:
        try:
            dtype = DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise self._error(f"malformed entry for tensor {name}") from None
        nbytes = dtype.itemsize * int(torch.Size(shape).numel())
        if end - begin != nbytes or begin < 0:
            raise self._error(f"tensor {name}: offsets do not match its dtype and shape")
        if data_start + end > size:
            raise self._error(f"truncated: tensor {name} needs bytes up to {data_start + end}, file has {size}")
        return TensorEntry(dtype, shape, data_start + begin, data_start + end)

    def keys(self):
        return self.entries.keys()

    def read(self, name: str, into: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor, read into `into` when that is a contiguous CPU tensor of the same dtype and shape
        (no intermediate copy), else into a new CPU tensor."""
        e = self.entries[name]
        direct = (into is not None and into.device.type == "cpu" and into.dtype == e.dtype
                  and tuple(into.shape) == e.shape and into.is_contiguous())
        out = into if direct else torch.empty(e.shape, dtype=e.dtype)
        view = memoryview(out.view(-1).view(torch.uint8).numpy()) if out.numel() else memoryview(b"")
        with open(self.path, "rb", buffering=0) as f:
            f.seek(e.start)
            got = 0
            while got < len(view):
                n = f.readinto(view[got:])
                if not n:
                    raise self._error(f"truncated while reading tensor {name}")
                got += n
        return out
