"""Writes the default model's tokenizer (vocabulary, merges, chat template) as a GGUF file without tensors.

    python evals/scripts/tokenizer_gguf.py OUT.gguf

`ft bench export` embeds that tokenizer in synthetic models and reads it from the default model; the device
machine has no network and the model file is too large to carry there, so this small file goes instead, named
by `FREETOKEN_DEFAULT_MODEL` (h200_issue3.sh, part serve-bench).
"""

from __future__ import annotations

import sys

import gguf
import numpy as np

from freetoken.engine.formats.gguf_file import GGUFFile
from freetoken.engine.sources import ensure_default_model


def main(out: str) -> None:
    writer = gguf.GGUFWriter(out, arch="llama")
    for key, value in GGUFFile(ensure_default_model()).metadata.items():
        if not key.startswith("tokenizer."):
            continue
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            values = list(value) if isinstance(value, (list, tuple, np.ndarray)) else [value]
            writer.add_array(key, values if values and isinstance(values[0], str) else [int(v) for v in values])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    main(sys.argv[1])
