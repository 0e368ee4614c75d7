"""Human byte sizes on the command line: "64MiB", "8GiB", "512M", "1.5G", "0", or plain bytes."""

from __future__ import annotations

import re

from freetoken.errors import FreeTokenError

_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1024, "kib": 1024, "m": 2**20, "mb": 2**20, "mib": 2**20,
          "g": 2**30, "gb": 2**30, "gib": 2**30, "t": 2**40, "tb": 2**40, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """Binary units throughout (1 GB = 1 GiB), as GPU memory is quoted."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if m is None or m.group(2).lower() not in _UNITS:
        raise FreeTokenError(f"cannot read {text!r} as a size; write it like 64MiB, 8GiB or 512M")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
