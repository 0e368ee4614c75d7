"""Writes the default model's tokenizer (vocabulary, merges, chat template) as a GGUF file without tensors.

    python evals/scripts/tokenizer_gguf.py OUT.gguf

`ft bench export` embeds that tokenizer in synthetic models and reads it from the default model; the device
machine has no network and the model file is too large to carry there, so this small file goes instead, named
by `FREETOKEN_DEFAULT_MODEL` (h200_issue3.sh, part serve-bench).
"""

from __future__ import annotations

import sys

import gguf

from freetoken.bench.export import _add_kv
from freetoken.engine.formats.gguf_file import GGUFFile
from freetoken.engine.sources import ensure_default_model


def main(out: str) -> None:
    writer = gguf.GGUFWriter(out, arch="llama")
    for key, value in GGUFFile(ensure_default_model()).metadata.items():
        if key.startswith("tokenizer."):
            _add_kv(writer, key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

if __name__ == "__main__":
    main(sys.argv[1])
