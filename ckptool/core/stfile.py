"""The safetensors container, read through byte ranges (works on any fsspec store).

Layout: 8-byte little-endian header length N, N bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, then
the data; offsets are relative to the end of the header.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

import torch

from ckptool.core.errors import BadCheckpoint

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
NAMES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 << 20


@dataclass(frozen=True, slots=True)
class Entry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    """Absolute byte offset in the file."""
    end: int


def parse_header(read, source: str, base: int = 0) -> tuple[dict[str, Entry], dict]:
    """Parse the header of a safetensors blob starting at ``base``.

    ``read(start, end)`` returns bytes of the file. Returns (entries, __metadata__).
    """
    raw = read(base, base + 8)
    if len(raw) < 8:
        raise BadCheckpoint("safetensors file is truncated (no header)", path=source)
    (n,) = struct.unpack("<Q", raw)
    if n > _MAX_HEADER:
        raise BadCheckpoint(f"safetensors header of {n} bytes is too large", path=source)
    try:
        header = json.loads(read(base + 8, base + 8 + n))
    except ValueError:
        raise BadCheckpoint("safetensors header is not valid JSON", path=source) from None
    data_start = base + 8 + n
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in DTYPES:
            raise BadCheckpoint(f"unsupported safetensors dtype {info['dtype']}", path=source, key=name)
        b, e = info["data_offsets"]
        entries[name] = Entry(DTYPES[info["dtype"]], tuple(info["shape"]), data_start + b, data_start + e)
    return entries, header.get("__metadata__") or {}
