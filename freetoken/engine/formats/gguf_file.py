"""Our own GGUF reader: header, metadata and tensor directory parsed from a read-only memory map.

Owns turning the bytes of a `.gguf` file (versions 2 and 3, little-endian) into a `GGUFFile`: its metadata,
its tensor directory, zero-copy access to each tensor's bytes (`raw`) and dequantised tensors (`load`).

Invariants:
- The file is mapped with `np.memmap(mode="r")`, never read whole into RAM; the header is parsed in place.
- Any malformed input raises `GGUFError` with a one-line message naming the file; every length or count read
  from the file is checked against the bytes left before anything is sliced or allocated, so no struct,
  index, Unicode, overflow or memory error escapes.
- Metadata values: integers -> int, floats -> float, bool -> bool, string -> str. Arrays of strings and arrays
  of arrays -> list; arrays of a fixed-width type (integers, floats, bools) -> a 1-D numpy array of the
  matching dtype (bool arrays as np.bool_), copied out of the mapping, whatever their length.
- `GGUFTensorInfo.shape` is in torch order (ggml's `ne` reversed); offsets are absolute file offsets, and
  every tensor's bytes lie inside the file, at an aligned offset, with whole blocks per row.
- `load` never returns a tensor that aliases the read-only mapping (writing to one would crash the process).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from freetoken.errors import GGUFError
from freetoken.kernels.gguf_dequant.reference import BLOCK_SIZES, dequantize

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_ARRAY_NESTING = 8  # real files nest at most once; the cap keeps hostile files from exhausting the stack
_HEADER = struct.Struct("<4sIQQ")  # magic, version, n_tensors, n_kv
_U64 = struct.Struct("<Q")

# GGUF metadata value type -> (struct format, numpy dtype for arrays); 8 = string and 9 = array are special.
_STRING, _ARRAY, _BOOL = 8, 9, 7
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"),
    1: ("<b", "<i1"),
    2: ("<H", "<u2"),
    3: ("<h", "<i2"),
    4: ("<I", "<u4"),
    5: ("<i", "<i4"),
    6: ("<f", "<f4"),
    _BOOL: ("<B", "<u1"),
    10: ("<Q", "<u8"),
    11: ("<q", "<i8"),
    12: ("<d", "<f8"),
}
# The fewest bytes one value of each type can take, to reject counts the file cannot hold before looping.
_MIN_VALUE_BYTES = {**{t: struct.calcsize(f) for t, (f, _) in _SCALARS.items()}, _STRING: 8, _ARRAY: 12}
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, smallest value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # name length, n_dims, type, offset


@dataclass(slots=True, frozen=True)
class GGUFTensorInfo:
    """One entry of the tensor directory. `shape` is torch order; `offset` is absolute in the file."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    type_name: str
    offset: int
    n_bytes: int

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class _Cursor:
    """Bounds-checked little-endian reads from the mapped header; every failure is a GGUFError."""

    __slots__ = ("buf", "pos", "size", "path")

    def __init__(self, buf: memoryview, path: str) -> None:
        self.buf, self.pos, self.size, self.path = buf, 0, len(buf), path

    def fail(self, problem: str) -> GGUFError:
        return GGUFError(f"{self.path}: {problem}")

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise self.fail(f"truncated: {what} at offset {self.pos} needs {n} bytes, file has {self.size}")

    def scalar(self, fmt: str, what: str) -> int | float:
        n = struct.calcsize(fmt)
        self.need(n, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return value

    def u32(self, what: str) -> int:
        return int(self.scalar("<I", what))

    def u64(self, what: str) -> int:
        return int(self.scalar("<Q", what))

    def string(self, what: str) -> str:
        n = self.u64(f"length of {what}")
        self.need(n, what)
        try:
            text = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} at offset {self.pos} is not valid UTF-8 ({e.reason})") from None
        self.pos += n
        return text

    def strings(self, count: int, what: str) -> list[str]:
        """`count` strings in a row; a tight loop because vocabularies hold 100k+ of them."""
        buf, pos, size, unpack = self.buf, self.pos, self.size, _U64.unpack_from
        out: list[str] = []
        for i in range(count):
            if pos + 8 > size or (n := unpack(buf, pos)[0]) > size - pos - 8:
                raise self.fail(f"truncated: {what}[{i}] at offset {pos} runs past the end of the file")
            pos += 8
            try:
                out.append(buf[pos : pos + n].tobytes().decode("utf-8"))
            except UnicodeDecodeError as e:
                raise self.fail(f"{what}[{i}] at offset {pos} is not valid UTF-8 ({e.reason})") from None
            pos += n
        self.pos = pos
        return out

    def value(self, vtype: int, what: str, depth: int = 0) -> object:
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            return self.array(what, depth)
        if vtype not in _SCALARS:
            raise self.fail(f"{what} has unknown metadata value type {vtype}")
        value = self.scalar(_SCALARS[vtype][0], what)
        return bool(value) if vtype == _BOOL else value

    def array(self, what: str, depth: int) -> object:
        if depth >= _MAX_ARRAY_NESTING:
            raise self.fail(f"{what} nests arrays more than {_MAX_ARRAY_NESTING} deep")
        item_type = self.u32(f"item type of {what}")
        count = self.u64(f"length of {what}")
        if item_type not in _MIN_VALUE_BYTES:
            raise self.fail(f"{what} has unknown metadata value type {item_type} for its items")
        if count > (self.size - self.pos) // _MIN_VALUE_BYTES[item_type]:
            raise self.fail(f"truncated: {what} claims {count} items, more than the rest of the file holds")
        if item_type == _STRING:
            return self.strings(count, what)
        if item_type == _ARRAY:
            return [self.array(f"{what}[{i}]", depth + 1) for i in range(count)]
        dtype = np.dtype(_SCALARS[item_type][1])
        items = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).copy()
        self.pos += count * dtype.itemsize
        return items != 0 if item_type == _BOOL else items


class GGUFFile:
    """A parsed GGUF file: `metadata`, `tensors` (file order), and tensor access through `raw` and `load`."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._mm: np.memmap | None = _map(self.path)
        cur = _Cursor(memoryview(self._mm), str(self.path))
        self.version, n_tensors, n_kv = _read_header(cur)
        self.metadata: dict[str, object] = _read_metadata(cur, n_kv)
        self.alignment: int = _alignment(cur, self.metadata)
        infos = [_read_tensor_info(cur, i) for i in range(n_tensors)]
        self.data_offset: int = -(-cur.pos // self.alignment) * self.alignment
        self.tensors: dict[str, GGUFTensorInfo] = {}
        for name, dims, ggml_type, rel_offset in infos:
            if name in self.tensors:
                raise cur.fail(f"duplicate tensor name {name!r}")
            offset = _tensor_offset(cur, name, rel_offset, self.alignment, self.data_offset)
            self.tensors[name] = _tensor_info(cur, name, dims, ggml_type, offset)

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> GGUFFile:
        return cls(path)

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Drop this object's reference to the mapping; arrays and tensors handed out keep it alive."""
        self._mm = None

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r}, version={self.version}, tensors={len(self.tensors)})"

    def _info(self, name: str) -> GGUFTensorInfo:
        if self._mm is None:
            raise GGUFError(f"{self.path}: file is closed")
        info = self.tensors.get(name)
        if info is None:
            raise GGUFError(f"{self.path}: no tensor named {name!r}")
        return info

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view of the mapping (zero-copy)."""
        info = self._info(name)
        return self._mm[info.offset : info.offset + info.n_bytes]

    def read(self, name: str, out: np.ndarray | None = None) -> np.ndarray:
        """The tensor's bytes read with plain file reads into `out` (uint8, n_bytes long) or a new array.

        Loading goes through here rather than the mapping: mapped pages would count in the process's resident
        memory a second time while the weights are copied to their place."""
        info = self._info(name)
        if out is None:
            out = np.empty(info.n_bytes, dtype=np.uint8)
        view = memoryview(out.reshape(-1))
        with open(self.path, "rb", buffering=0) as f:
            f.seek(info.offset)
            got = 0
            while got < info.n_bytes:
                n = f.readinto(view[got:])
                if not n:
                    raise GGUFError(f"{self.path}: truncated while reading tensor {name!r}")
                got += n
        return out

    def load(
        self, name: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
    ) -> torch.Tensor:
        """The tensor dequantised to `dtype` on `device`, in torch shape order.

        Raw bytes move to `device` first so a GPU does the dequantisation; float types are converted with a
        single copy out of the file.
        """
        info = self._info(name)
        if info.type_name not in BLOCK_SIZES:
            supported = ", ".join(BLOCK_SIZES)
            raise GGUFError(
                f"{self.path}: tensor {name!r} has type {info.type_name}, which freetoken cannot load "
                f"(supported: {supported})"
            )
        raw = torch.from_numpy(self.read(name))  # our own buffer: safe for dequantize to return a view of it
        out = dequantize(raw.to(device), info.type_name, info.n_elements, dtype)
        return out.view(info.shape)


def _map(path: Path) -> np.memmap:
    try:
        size = path.stat().st_size
        if size < _HEADER.size:
            raise GGUFError(f"{path}: not a GGUF file (only {size} bytes, a header needs {_HEADER.size})")
        return np.memmap(path, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as e:
        raise GGUFError(f"{path}: cannot map file ({e})") from None


def _read_header(cur: _Cursor) -> tuple[int, int, int]:
    magic, version, n_tensors, n_kv = _HEADER.unpack_from(cur.buf, 0)
    if magic != GGUF_MAGIC:
        raise cur.fail(f"not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
    if version not in SUPPORTED_VERSIONS:
        if struct.unpack("<I", struct.pack(">I", version))[0] in SUPPORTED_VERSIONS:
            raise cur.fail("big-endian GGUF files are not supported; convert the model to little-endian")
        raise cur.fail(f"unsupported GGUF version {version} (supported: 2, 3)")
    cur.pos = _HEADER.size
    room = cur.size - cur.pos
    if n_kv * _MIN_KV_BYTES + n_tensors * _MIN_TENSOR_INFO_BYTES > room:
        raise cur.fail(
            f"truncated or corrupt header: it claims {n_tensors} tensors and {n_kv} metadata entries, "
            f"more than a {cur.size}-byte file holds"
        )
    return version, n_tensors, n_kv


def _read_metadata(cur: _Cursor, n_kv: int) -> dict[str, object]:
    metadata: dict[str, object] = {}
    for i in range(n_kv):
        key = cur.string(f"metadata key #{i}")
        if key in metadata:
            raise cur.fail(f"duplicate metadata key {key!r}")
        vtype = cur.u32(f"value type of {key!r}")
        metadata[key] = cur.value(vtype, f"metadata {key!r}")
    return metadata


def _alignment(cur: _Cursor, metadata: dict[str, object]) -> int:
    value = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0 or value & (value - 1):
        raise cur.fail(f"general.alignment must be a positive power of two, got {value!r}")
    return value


def _read_tensor_info(cur: _Cursor, index: int) -> tuple[str, list[int], int, int]:
    name = cur.string(f"name of tensor #{index}")
    n_dims = cur.u32(f"dimension count of tensor {name!r}")
    if n_dims > MAX_DIMS:
        raise cur.fail(f"tensor {name!r} has {n_dims} dimensions, at most {MAX_DIMS} are allowed")
    dims = [cur.u64(f"dimension {d} of tensor {name!r}") for d in range(n_dims)]
    ggml_type = cur.u32(f"type of tensor {name!r}")
    rel_offset = cur.u64(f"offset of tensor {name!r}")
    return name, dims, ggml_type, rel_offset


def _tensor_offset(cur: _Cursor, name: str, rel_offset: int, alignment: int, data_offset: int) -> int:
    if rel_offset % alignment:
        raise cur.fail(f"tensor {name!r} offset {rel_offset} is not a multiple of the alignment {alignment}")
    return data_offset + rel_offset


def _tensor_info(cur: _Cursor, name: str, dims: list[int], ggml_type: int, offset: int) -> GGUFTensorInfo:
    # ggml stores dims as int64: a value with the top bit set is negative there.
    if any(d == 0 or d >= 1 << 63 for d in dims):
        raise cur.fail(f"tensor {name!r} has a zero or negative dimension in {dims}")
    type_name = _type_name(ggml_type)
    if type_name is None:
        raise cur.fail(f"tensor {name!r} has unknown ggml type {ggml_type}")
    per_block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    row = dims[0] if dims else 1
    if row % per_block:
        raise cur.fail(
            f"tensor {name!r}: row length {row} is not a multiple of the {type_name} block size {per_block}"
        )
    n_elements = 1
    for d in dims:
        n_elements *= d
    n_bytes = n_elements // per_block * block_bytes
    if offset + n_bytes > cur.size:
        raise cur.fail(f"truncated: tensor {name!r} needs bytes up to {offset + n_bytes}, file has {cur.size}")
    return GGUFTensorInfo(name, tuple(reversed(dims)), ggml_type, type_name, offset, n_bytes)


def _type_name(ggml_type: int) -> str | None:
    try:
        qtype = GGMLQuantizationType(ggml_type)
    except ValueError:
        return None
    return qtype.name if qtype in GGML_QUANT_SIZES else None
