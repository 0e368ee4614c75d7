"""GGUFFile against gguf's own GGUFReader on files written by gguf.GGUFWriter, plus targeted malformed files."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

from freetoken.engine.formats.gguf_file import GGUFFile, GGUFTensorInfo
from freetoken.errors import GGUFError

RNG = np.random.default_rng(1234)
# byte offsets of the fp16 scale fields in each block: random bytes elsewhere, sane finite scales here
_SCALE_FIELDS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,)}


def _random_blocks(qtype: Q, rows: int, cols: int) -> np.ndarray:
    per_block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    n = rows * cols // per_block
    blocks = RNG.integers(0, 256, (n, block_bytes), dtype=np.uint8)
    for at in _SCALE_FIELDS[qtype.name]:
        blocks[:, at : at + 2] = RNG.uniform(-0.5, 0.5, (n, 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, cols // per_block * block_bytes)


def _write_reference_file(path: Path) -> None:
    w = gguf.GGUFWriter(path, arch="llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**64 - 1)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 1e300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ✓")
    w.add_array("t.arr_str", ["a", "", "ü", "<|im_end|>"])
    w.add_array("t.arr_i32", [1, -2, 3])
    w.add_array("t.arr_f32", [0.5, -1.25])
    w.add_array("t.arr_bool", [True, False, True])
    w.add_key_value("t.arr_u64", [1, 2**63], V.ARRAY, sub_type=V.UINT64)
    w.add_key_value("t.arr_u8", [0, 255], V.ARRAY, sub_type=V.UINT8)
    w.add_array("t.arr_nested", [[1, 2], [3]])
    w.add_tensor("f32", RNG.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f32_3d", RNG.standard_normal((2, 3, 4)).astype(np.float32))
    w.add_tensor("f16", RNG.standard_normal((4, 8)).astype(np.float16))
    bf16 = gguf.quants.quantize(RNG.standard_normal((2, 6)).astype(np.float32), Q.BF16)
    w.add_tensor("bf16", bf16, raw_dtype=Q.BF16)
    for qtype in (Q.Q8_0, Q.Q4_0, Q.Q4_1):
        x = RNG.standard_normal((3, 64)).astype(np.float32)
        w.add_tensor(qtype.name.lower(), gguf.quants.quantize(x, qtype), raw_dtype=qtype)
    for qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        w.add_tensor(qtype.name.lower(), _random_blocks(qtype, 2, 512), raw_dtype=qtype)
    w.add_tensor("iq4_nl", _random_blocks(Q.IQ4_NL, 1, 32), raw_dtype=Q.IQ4_NL)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def ref_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "ref.gguf"
    _write_reference_file(path)
    return path


def _plain(value: object) -> object:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def test_metadata_matches_reader(ref_path: Path) -> None:
    f = GGUFFile.open(ref_path)
    reader = gguf.GGUFReader(ref_path)
    assert f.version == 3 and f.alignment == 32
    expected = {k: fld.contents() for k, fld in reader.fields.items() if not k.startswith("GGUF.")}
    del expected["t.arr_nested"]  # GGUFReader cannot read nested arrays; see test_metadata_representation
    assert {k: _plain(v) for k, v in f.metadata.items() if k != "t.arr_nested"} == expected


def test_metadata_representation(ref_path: Path) -> None:
    md = GGUFFile(ref_path).metadata
    assert md["general.architecture"] == "llama" and md["t.str"] == "héllo ✓"
    assert type(md["t.u8"]) is int and type(md["t.f32"]) is float and md["t.bool"] is True
    assert md["t.u64"] == 2**64 - 1 and md["t.f32"] == pytest.approx(0.1)
    assert md["t.arr_str"] == ["a", "", "ü", "<|im_end|>"]
    assert isinstance(md["t.arr_i32"], np.ndarray) and md["t.arr_i32"].dtype == np.int32
    assert md["t.arr_u64"].dtype == np.uint64 and md["t.arr_u64"].tolist() == [1, 2**63]
    assert md["t.arr_bool"].dtype == np.bool_ and md["t.arr_bool"].tolist() == [True, False, True]
    assert md["t.arr_f32"].dtype == np.float32
    assert [a.tolist() for a in md["t.arr_nested"]] == [[1, 2], [3]]


def test_tensor_directory_and_load_match_reader(ref_path: Path) -> None:
    f = GGUFFile(ref_path)
    reader = gguf.GGUFReader(ref_path)
    assert list(f.tensors) == [t.name for t in reader.tensors]
    for rt in reader.tensors:
        info = f.tensors[rt.name]
        assert isinstance(info, GGUFTensorInfo)
        assert info.shape == tuple(int(d) for d in reversed(rt.shape))
        assert (info.ggml_type, info.type_name) == (int(rt.tensor_type), rt.tensor_type.name)
        assert (info.offset, info.n_bytes) == (rt.data_offset, rt.n_bytes)
        assert np.array_equal(f.raw(rt.name), np.asarray(rt.data).reshape(-1).view(np.uint8))
        if rt.name == "iq4_nl":
            continue
        expected = gguf.quants.dequantize(rt.data, rt.tensor_type).astype(np.float32).reshape(info.shape)
        got = f.load(rt.name)
        assert got.dtype == torch.float32 and tuple(got.shape) == info.shape
        assert np.array_equal(got.numpy(), expected), rt.name


def test_shape_is_torch_order(ref_path: Path) -> None:
    f = GGUFFile(ref_path)
    assert f.tensors["f32_3d"].shape == (2, 3, 4)
    assert f.tensors["q4_k"].shape == (2, 512) and f.tensors["q4_k"].n_bytes == 2 * 2 * 144


def test_load_dtype_and_no_alias(ref_path: Path) -> None:
    f = GGUFFile(ref_path)
    half = f.load("q6_k", dtype=torch.float16)
    assert half.dtype == torch.float16
    assert torch.equal(half, f.load("q6_k").to(torch.float16))
    t = f.load("f32")
    t.add_(1.0)  # must not touch the read-only mapping (that would crash)
    assert not torch.equal(t, f.load("f32"))
    assert f.load("bf16", dtype=torch.bfloat16).dtype == torch.bfloat16


def test_unsupported_type_opens_but_does_not_load(ref_path: Path) -> None:
    f = GGUFFile(ref_path)
    assert f.tensors["iq4_nl"].type_name == "IQ4_NL"
    with pytest.raises(GGUFError, match=r"iq4_nl.*IQ4_NL.*supported: .*Q4_K"):
        f.load("iq4_nl")
    with pytest.raises(GGUFError, match="no tensor named"):
        f.load("missing")


# --- malformed files, built byte by byte so each defect is exact -------------------------------------------


def _string(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def _build(
    kv: bytes = b"",
    n_kv: int = 0,
    tensors: list[tuple[bytes, list[int], int, int]] | None = None,
    data: bytes = b"",
    version: int = 3,
    magic: bytes = b"GGUF",
    align: int = 32,
) -> bytes:
    tensors = tensors if tensors is not None else [(b"w", [32], 0, 0)]
    head = magic + struct.pack("<IQQ", version, len(tensors), n_kv) + kv
    for name, dims, ggml_type, offset in tensors:
        head += _string(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
        head += struct.pack("<IQ", ggml_type, offset)
    head += b"\0" * (-len(head) % align)
    return head + (data if data else b"\0" * 128)


def _open_bytes(tmp_path: Path, blob: bytes) -> GGUFFile:
    path = tmp_path / "x.gguf"
    path.write_bytes(blob)
    return GGUFFile(path)


@pytest.mark.parametrize("version", [2, 3])
def test_builder_produces_valid_file(tmp_path: Path, version: int) -> None:
    f = _open_bytes(tmp_path, _build(kv=_string("a") + struct.pack("<Ii", 5, -7), n_kv=1, version=version))
    assert f.version == version and f.metadata == {"a": -7} and f.data_offset == 96
    assert f.tensors["w"].shape == (32,) and f.load("w").shape == (32,)
    with f:
        assert f.raw("w").nbytes == 128
    with pytest.raises(GGUFError, match="closed"):
        f.raw("w")


MALFORMED = [
    (b"", "only 0 bytes"),
    (b"GGUF\x03\0\0\0", "only 8 bytes"),
    (_build(magic=b"GGML"), "not a GGUF file (magic b'GGML'"),
    (_build(version=1), "unsupported GGUF version 1"),
    (_build(version=3 << 24), "big-endian"),
    (_build()[:30], "truncated"),
    (b"GGUF" + struct.pack("<IQQ", 3, 2**40, 0) + b"\0" * 64, "claims 1099511627776 tensors"),
    (_build(kv=_string("a") + struct.pack("<IIQ", 9, 8, 2**60), n_kv=1), "truncated: metadata 'a' claims"),
    (_build(kv=struct.pack("<Q", 2**62) + b"x" * 40, n_kv=1), "truncated"),
    (_build(kv=_string("a") + struct.pack("<IIQQ", 9, 8, 1, 10**6), n_kv=1), "'a'[0] at offset 49 runs past"),
    (_build(kv=_string("a") + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 9, n_kv=1), "nests arrays"),
    (_build(kv=_string(b"\xff\xfe") + struct.pack("<IB", 0, 1), n_kv=1), "UTF-8"),
    (_build(kv=_string("a") + struct.pack("<II", 13, 0), n_kv=1), "unknown metadata value type 13"),
    (
        _build(kv=_string("a") + struct.pack("<IB", 0, 1) + _string("a") + struct.pack("<IB", 0, 2), n_kv=2),
        "duplicate metadata key",
    ),
    (_build(kv=_string("general.alignment") + struct.pack("<II", 4, 24), n_kv=1), "power of two"),
    (_build(tensors=[(b"w", [32, 1, 1, 1, 1], 0, 0)]), "5 dimensions"),
    (_build(tensors=[(b"w", [32, 0], 0, 0)]), "zero or negative"),
    (_build(tensors=[(b"w", [32, 2**63 + 1], 0, 0)]), "zero or negative"),
    (_build(tensors=[(b"w", [33], 12, 0)]), "not a multiple of the Q4_K block size 256"),
    (_build(tensors=[(b"w", [32], 0, 4)]), "not a multiple of the alignment"),
    (_build(tensors=[(b"w", [32], 0, 0), (b"w", [8], 0, 128)], data=b"\0" * 160), "duplicate tensor name"),
    (_build(tensors=[(b"w", [32], 999, 0)]), "unknown ggml type 999"),
    (_build(tensors=[(b"w", [64], 0, 0)]), "truncated: tensor 'w' needs bytes up to"),
]


@pytest.mark.parametrize(("blob", "words"), MALFORMED, ids=[w for _, w in MALFORMED])
def test_malformed_files_raise_gguf_error(tmp_path: Path, blob: bytes, words: str) -> None:
    with pytest.raises(GGUFError) as err:
        _open_bytes(tmp_path, blob)
    message = str(err.value)
    assert "\n" not in message and "x.gguf" in message
    assert any(w in message for w in words.split("|")), message


def test_truncated_real_file(ref_path: Path, tmp_path: Path) -> None:
    blob = ref_path.read_bytes()
    info = GGUFFile(ref_path).tensors["q6_k"]
    for cut, words in ((100, "truncated"), (info.offset + 10, "truncated: tensor 'q6_k' needs bytes up to")):
        with pytest.raises(GGUFError, match=words):
            _open_bytes(tmp_path, blob[:cut])


def test_big_endian_writer_file_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "be.gguf"
    w = gguf.GGUFWriter(path, arch="llama", endianess=gguf.GGUFEndian.BIG)
    w.add_tensor("x", np.ones(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match="big-endian"):
        GGUFFile(path)


def test_missing_file_and_directory(tmp_path: Path) -> None:
    with pytest.raises(GGUFError, match="nope.gguf"):
        GGUFFile(tmp_path / "nope.gguf")
    with pytest.raises(GGUFError):
        GGUFFile(tmp_path)
