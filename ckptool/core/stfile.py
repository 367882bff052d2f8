"""The safetensors container, read through byte ranges (works on any fsspec store).

Layout: 8-byte little-endian header length N, N bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, then
the data; offsets are relative to the end of the header.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass

from ckptool.core.errors import BadCheckpoint
from ckptool.core.lazy import lazy

torch = lazy("torch", globals())

_CODES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
    "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}
"""safetensors dtype codes by torch dtype name (torch is imported when a header is read)."""
_BY_NAME = {v: k for k, v in _CODES.items()}


def dtype_of(code) -> torch.dtype | None:
    """The torch dtype of a safetensors dtype code; None for a code it does not know."""
    name = _CODES.get(code) if isinstance(code, str) else None
    return getattr(torch, name) if name else None


def code_of(dtype) -> str:
    """The safetensors dtype code of a torch dtype (KeyError for one it has none for)."""
    return _BY_NAME[str(dtype).removeprefix("torch.")]


_MAX_HEADER = 100 << 20


@dataclass(frozen=True, slots=True)
class Entry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    """Absolute byte offset in the file."""
    end: int


def parse_header(read, source: str, base: int = 0, size: int | None = None
                 ) -> tuple[dict[str, Entry], dict]:
    """Parse and check the header of a safetensors blob starting at ``base``.

    ``read(start, end)`` returns bytes of the file; ``size`` is the blob's length (default:
    ``read.size`` less ``base``, when the reader knows it). Returns (entries, __metadata__).
    The checks are the container's own rules, from the header alone: every entry has a
    known dtype, a shape of non-negative sizes and exactly its bytes; together the entries
    tile the data section, from its start to the end of the blob, without overlap or gap.
    A damaged or hostile header is BadCheckpoint, never an allocation of what it claims.
    """
    if size is None and getattr(read, "size", None) is not None:
        size = read.size - base
    raw = read(base, base + 8)
    if len(raw) < 8:
        raise BadCheckpoint("safetensors file is truncated (no header)", path=source)
    (n,) = struct.unpack("<Q", raw)
    if n > _MAX_HEADER or (size is not None and 8 + n > size):
        raise BadCheckpoint(f"safetensors header of {n} bytes does not fit the file", path=source)
    try:
        header = json.loads(read(base + 8, base + 8 + n))
    except (ValueError, RecursionError):
        raise BadCheckpoint("safetensors header is not valid JSON", path=source) from None
    if not isinstance(header, dict):
        raise BadCheckpoint("safetensors header is not a JSON object", path=source)
    data_start = base + 8 + n
    entries = {name: _entry(name, info, data_start, source)
               for name, info in header.items() if name != "__metadata__"}
    _check_tiling(entries, data_start, None if size is None else base + size, source)
    metadata = header.get("__metadata__") or {}
    if not isinstance(metadata, dict):
        raise BadCheckpoint("safetensors __metadata__ is not a JSON object", path=source)
    return entries, metadata


def _entry(name: str, info, data_start: int, source: str) -> Entry:
    try:
        dtype = dtype_of(info["dtype"])
        shape = tuple(info["shape"])
        begin, end = info["data_offsets"]
    except (TypeError, KeyError, ValueError):
        raise BadCheckpoint("malformed safetensors header entry", path=source, key=name) from None
    if dtype is None:
        raise BadCheckpoint(f"unsupported safetensors dtype {str(info['dtype'])[:20]}", path=source,
                            key=name)
    if not all(type(x) is int and x >= 0 for x in (*shape, begin, end)) or begin > end:
        raise BadCheckpoint(f"safetensors entry has a bad shape {list(shape)[:8]} or data offsets "
                            f"[{begin}, {end}]", path=source, key=name)
    if end - begin != math.prod(shape) * dtype.itemsize:
        raise BadCheckpoint(f"safetensors entry of shape {list(shape)[:8]} ({info['dtype']}) has "
                            f"{end - begin} bytes, not {math.prod(shape) * dtype.itemsize}",
                            path=source, key=name)
    return Entry(dtype, shape, data_start + begin, data_start + end)


def _check_tiling(entries: dict[str, Entry], data_start: int, end: int | None, source: str) -> None:
    """Entries lie one after another from the data section's start, without overlap or gap,
    and the last ends where the blob ends (as the safetensors library requires)."""
    at = data_start
    for name, e in sorted(entries.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if e.begin != at:
            what = "overlaps the one before it" if e.begin < at else f"leaves a gap of {e.begin - at} bytes"
            raise BadCheckpoint(f"safetensors data offsets: the entry {what}", path=source, key=name)
        at = e.end
    if end is not None and at != end:
        raise BadCheckpoint(f"safetensors data section runs to byte {at}, the file has {end}"
                            + (" (truncated)" if at > end else ""), path=source)
