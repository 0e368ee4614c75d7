"""Corrupted GGUF bytes may only ever raise GGUFError: never struct/index/Unicode/overflow/memory errors."""

from __future__ import annotations

import itertools
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from freetoken.engine.formats.gguf_file import GGUFFile
from freetoken.errors import GGUFError

# Values that break naive length/count handling: negative as int64, past 2^32, past any file, zero.
HUGE = [0, 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**62, 2**63 - 1, 2**63, 2**64 - 1]


def _valid_file(path: Path) -> bytes:
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, arch="llama")
    w.add_uint32("llama.block_count", 2)
    w.add_float32("llama.rope.freq_base", 1e4)
    w.add_bool("llama.flag", True)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_array("tokenizer.ggml.tokens", ["<s>", "a", "é"])
    w.add_array("tokenizer.ggml.token_type", [1, 1, 3])
    w.add_array("tokenizer.ggml.scores", [0.0, -1.5, 2.0])
    w.add_tensor("tok", rng.standard_normal((3, 8)).astype(np.float32))
    w.add_tensor("norm", rng.standard_normal(32).astype(np.float16))
    q8 = gguf.quants.quantize(rng.standard_normal((1, 32)).astype(np.float32), Q.Q8_0)
    w.add_tensor("q8", q8, raw_dtype=Q.Q8_0)
    k_block = rng.integers(0, 256, (1, 144), dtype=np.uint8)
    w.add_tensor("q4k", k_block, raw_dtype=Q.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, int]:
    path = tmp_path_factory.mktemp("fuzz") / "base.gguf"
    blob = _valid_file(path)
    return blob, GGUFFile(path).data_offset


def _mutate(blob: bytes, header_end: int, ops: list[tuple]) -> bytes:
    data = bytearray(blob)
    for op, where, arg in ops:
        pos = where % (min(header_end, len(data)) + 1)
        if op == "set":
            data[pos : pos + 1] = bytes([arg % 256])
        elif op == "u64":
            data[pos : pos + 8] = struct.pack("<Q", HUGE[arg % len(HUGE)])
        elif op == "u32":
            data[pos : pos + 4] = struct.pack("<I", HUGE[arg % len(HUGE)] & 0xFFFFFFFF)
        elif op == "insert":
            data[pos:pos] = arg.to_bytes(4, "little") if arg < 2**32 else b"\xff" * 9
        elif op == "cut":
            del data[where % (len(data) + 1) :]
    return bytes(data)


_OPS = st.lists(
    st.tuples(
        st.sampled_from(["set", "u64", "u32", "insert", "cut"]),
        st.integers(0, 2**16),
        st.integers(0, 2**33),
    ),
    min_size=1,
    max_size=4,
)
_names = itertools.count()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_OPS)
def test_corrupt_files_raise_only_gguf_error(base: tuple[bytes, int], tmp_path: Path, ops: list[tuple]) -> None:
    blob, header_end = base
    # a fresh file per example: rewriting one in place under a live mapping would SIGBUS
    path = tmp_path / f"{next(_names)}.gguf"
    path.write_bytes(_mutate(blob, header_end, ops))
    try:
        f = GGUFFile(path)
        for name, info in f.tensors.items():
            assert len(f.raw(name)) == info.n_bytes
            try:
                f.load(name)
            except GGUFError as e:
                assert "cannot load" in str(e)
    except GGUFError as e:
        assert str(e).startswith(str(path)) and "\n" not in str(e)


def test_unmutated_base_parses(base: tuple[bytes, int], tmp_path: Path) -> None:
    path = tmp_path / "ok.gguf"
    path.write_bytes(base[0])
    f = GGUFFile(path)
    assert list(f.tensors) == ["tok", "norm", "q8", "q4k"]
    assert f.metadata["tokenizer.ggml.tokens"] == ["<s>", "a", "é"]
    for name in f.tensors:
        f.load(name)
