"""NaN/Inf scans of stored bytes at memory speed, without torch and without temporaries.

A float is NaN or Inf exactly when its bits, sign cleared, are at least the exponent
mask (``0x7F800000`` for fp32, ``0x7F80`` for bf16, ``0x7C00`` for fp16, ...). Those
values sit at the top of both integer readings of the same bytes: a positive NaN/Inf is
a signed integer ``>= mask``, a negative one an unsigned integer ``>= sign | mask``, and no
finite value reaches either. So two integer maxima of a block (SIMD reductions that make
no copy) tell whether it holds any; only a block that does is counted exactly. bf16 and
fp16 are scanned so, as 16-bit integers, never upcast. fp32 and fp64 take one BLAS dot
product of the block with itself instead (faster still): it is finite unless an element
is not, or the sum of squares overflows, which the exact count then sorts out.

:class:`FileScan` applies this to byte ranges of one file as its blocks stream past:
:func:`ckptool.core.manifest.hash_file` reads the file into one cache-sized buffer, block
after block, and hashes and scans each block there, so ``verify --deep`` reads every byte
once, from the page cache. The blocks keep the phase (offset mod 8) of most of the file's
elements, which then lie aligned in the buffer; a range out of that phase (a DCP chunk that
torch's writer appended anywhere; ckptool's writers align every chunk) is scanned through a
block-sized aligned scratch copy.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any

from ckptool.core.lazy import lazy

np = lazy("numpy", globals(), "np")

SCAN_BLOCK = 1 << 20
"""Bytes hashed then scanned at a time, and per reduction: small enough to stay in the
core's cache between the two."""

# dtype name -> (bytes per element, mask of the "not finite" values, whether Inf exists)
_FLOATS: dict[str, tuple[int, int, bool]] = {
    "float64": (8, 0x7FF0_0000_0000_0000, True),
    "float32": (4, 0x7F80_0000, True),
    "bfloat16": (2, 0x7F80, True),
    "float16": (2, 0x7C00, True),
    "float8_e5m2": (1, 0x7C, True),
    "float8_e4m3fn": (1, 0x7F, False),  # no Inf; NaN is S.1111.111
}
_ALIASES = {"float": "float32", "double": "float64", "half": "float16"}


def float_kind(dtype: Any) -> str | None:
    """The name under which :func:`nonfinite` scans ``dtype`` (a ``torch.dtype`` or a name read
    without torch); None for dtypes that hold no NaN (integers) or that it cannot scan (complex,
    the ``fnuz`` fp8 kinds, whose NaN is the negative-zero pattern)."""
    name = str(dtype).removeprefix("torch.")
    name = _ALIASES.get(name, name)
    return name if name in _FLOATS else None


_SCRATCH = threading.local()
_NP: dict[str, tuple] = {}


def _np_kind(kind: str) -> tuple:
    """(size, mask, sign, has_inf, unsigned, signed, float-or-None) numpy dtypes of ``kind``,
    made once: the per-block path does no string work."""
    found = _NP.get(kind)
    if found is None:
        size, mask, has_inf = _FLOATS[kind]
        floats = np.dtype(f"<f{size}") if size >= 4 else None
        found = _NP[kind] = (size, mask, 1 << (8 * size - 1), has_inf, np.dtype(f"<u{size}"),
                             np.dtype(f"<i{size}"), floats)
    return found


def nonfinite(data, kind: str) -> tuple[int, int]:
    """(NaN count, Inf count) of the little-endian elements of ``kind`` in buffer ``data``
    (whole elements). Costs one or two reductions per MiB unless the block holds some."""
    data = memoryview(data).cast("B")
    span = Span(0, len(data) - len(data) % _FLOATS[kind][0], kind, None)
    FileScan([span]).feed(0, data)
    return span.nan, span.inf


@dataclass
class Span:
    """Bytes ``[offset, offset + nbytes)`` of a file holding elements of ``kind``; ``tag``
    names what they belong to (a tensor key)."""

    offset: int
    nbytes: int
    kind: str
    tag: Any
    nan: int = 0
    inf: int = 0
    seen: int = 0
    _carry: bytes = field(default=b"", repr=False)

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


class FileScan:
    """Scans the spans of one file as its bytes arrive in order (``feed(position, block)``);
    an element split between two blocks is carried over.

    While :meth:`bind` holds the one buffer every block is read into, an aligned span is
    scanned through typed views of that buffer made once: a block then costs two slices and
    the reductions, not a view per block (at 1 MiB blocks that glue, not the reductions,
    was most of the scan)."""

    def __init__(self, spans: list[Span]):
        self.spans = sorted(spans, key=lambda s: s.offset)
        self._first = 0  # spans before it are finished
        self._views: list[tuple] | None = None  # per span, while bound
        self.copied = 0
        """Bytes scanned through a block-sized aligned copy rather than in place."""

    def bind(self, buffer) -> int:
        """Until :meth:`release`, every block fed is the start of ``buffer`` (a writable
        buffer the caller reads the file into, block after block). Returns the phase the
        blocks should keep: every block but the last should end at a file offset that is the
        phase modulo 8. Spans whose elements start there (most of the file's bytes) are then
        aligned in the buffer and read in place; the others are copied per block. Call
        :meth:`release` from the same thread (the bound scan keeps numpy's overflow warnings
        off there: what a dot product gives is looked at)."""
        base = np.frombuffer(buffer, dtype=np.uint8)
        if base.ctypes.data % 8:
            return 0  # elements would not be aligned in it: blocks go the copying way
        typed: dict[str, tuple] = {}
        for span in self.spans:
            if span.kind not in typed:
                spec = _np_kind(span.kind)
                typed[span.kind] = (spec, _typed(base[:base.size - base.size % spec[0]], spec))
        self._views = [typed[span.kind] for span in self.spans]
        self._quiet = np.errstate(over="ignore", invalid="ignore")
        self._quiet.__enter__()
        # ckptool's writers align every chunk (phase 0); torch's appends each anywhere
        weight: dict[tuple[int, int], int] = {}
        for span, (spec, _) in zip(self.spans, self._views):
            key = (spec[0], span.offset % 8)
            weight[key] = weight.get(key, 0) + span.nbytes
        return max(range(8), key=lambda r: sum(n for (size, at), n in weight.items()
                                               if (at - r) % size == 0))

    def release(self) -> None:
        """Drop the views of :meth:`bind`."""
        if self._views is not None:
            self._views = None
            self._quiet.__exit__(None, None, None)

    def feed(self, pos: int, block) -> None:
        if self._views is None and self.spans:  # unbound (an object store's blocks)
            with np.errstate(over="ignore", invalid="ignore"):  # what a dot gives is looked at
                self._feed(pos, block)
        else:
            self._feed(pos, block)

    def _feed(self, pos: int, block) -> None:
        end = pos + len(block)
        spans, views = self.spans, self._views
        while self._first < len(spans) and spans[self._first].end <= pos:
            self._first += 1
        for i in range(self._first, len(spans)):
            span = spans[i]
            if span.offset >= end:
                break
            lo, hi = max(span.offset, pos), min(span.end, end)
            if hi <= lo:
                continue
            view = views[i] if views is not None else None
            # in place where the span's elements start at element boundaries of the buffer
            # (ckptool's writers align them); else through the copying way, which carries an
            # element a block cuts over to the next
            if view is None or span._carry or (span.offset - pos) % view[0][0]:
                _scan_shifted(span, block[lo - pos:hi - pos], _np_kind(span.kind))
                self.copied += hi - lo
                continue
            spec, typed = view
            size = spec[0]
            # elements [a, b) of the buffer: whole ones; one the block cuts is carried (one cut
            # by the end of the file leaves the span unfinished)
            a, b = (lo - pos) // size, (hi - pos) // size
            if b > a:
                _add(span, _typed_nonfinite(typed, a, b, spec))
                span.seen += (b - a) * size
            if (hi - pos) % size:  # the first block, out of phase with this span, cut an element
                span._carry = bytes(block[b * size:hi - pos])

    def unfinished(self) -> list[Span]:
        """Spans the file did not hold to their end (a file shorter than its metadata)."""
        return [s for s in self.spans if s.seen < s.nbytes]


def _scan_shifted(span: Span, data, spec: tuple) -> None:
    """Scan ``data``, the next bytes of a span whose elements are not aligned in the block:
    the element the last block cut is completed and tested alone, the whole ones through one
    copy into the thread's aligned scratch block, and a cut one carried to the next block."""
    size = spec[0]
    if span._carry:
        need = size - len(span._carry)
        span._carry += bytes(data[:need])
        data = data[need:]
        if len(span._carry) < size:
            return
        _add(span, _one_nonfinite(span._carry, spec))
        span.seen += size
        span._carry = b""
    whole = len(data) - len(data) % size
    done = 0
    while done < whole:  # a block at a time (an object store's blocks are larger)
        scratch, typed = _scratch(spec)
        n = min(whole - done, len(scratch))
        scratch[:n] = data[done:done + n]
        _add(span, _typed_nonfinite(typed, 0, n // size, spec))
        span.seen += n
        done += n
    if whole < len(data):
        span._carry = bytes(data[whole:])


def _one_nonfinite(element: bytes, spec: tuple) -> tuple[int, int]:
    """(NaN, Inf) count of one little-endian element, in plain ints."""
    mask, sign, has_inf = spec[1], spec[2], spec[3]
    bits = int.from_bytes(element, "little") & (sign - 1)
    if bits < mask:
        return 0, 0
    return (0, 1) if has_inf and bits == mask else (1, 0)


def _scratch(spec: tuple) -> tuple:
    """This thread's aligned scratch block (a writable memoryview) and its typed views for
    ``spec``, made once."""
    found = getattr(_SCRATCH, "typed", None)
    if found is None:
        block = np.empty(SCAN_BLOCK, dtype=np.uint8)
        found = _SCRATCH.typed = (memoryview(block), block, {})
    view, block, typed = found
    key = spec[4:]  # the views' dtypes (one pair for bf16 and fp16 alike)
    if key not in typed:
        typed[key] = _typed(block, spec)
    return view, typed[key]


def _typed(raw, spec: tuple) -> tuple:
    """The views :func:`_typed_nonfinite` reduces, of aligned bytes ``raw``."""
    unsigned_t, signed_t, float_t = spec[4:]
    return (raw.view(float_t), raw.view(unsigned_t)) if float_t is not None else \
        (raw.view(unsigned_t), raw.view(signed_t))


def _typed_nonfinite(typed: tuple, a: int, b: int, spec: tuple) -> tuple[int, int]:
    """(NaN, Inf) counts of elements ``[a, b)`` of :func:`_typed` views: one reduction or two
    per block (fp32/fp64: one BLAS pass, x.x is finite unless some x is not, or it overflows),
    an exact count only where they find some."""
    mask, sign, has_inf, float_t = spec[1], spec[2], spec[3], spec[6]
    if float_t is not None:
        floats = typed[0][a:b]
        if math.isfinite(floats.dot(floats)):
            return 0, 0
        bits = typed[1][a:b]
    else:
        bits = typed[0][a:b]
        if int(bits.max()) < sign | mask and int(typed[1][a:b].max()) < mask:
            return 0, 0
    bits = bits & (sign - 1)  # a temporary of one block, only on a hit
    beyond = int(np.count_nonzero(bits >= mask))
    inf = int(np.count_nonzero(bits == mask)) if has_inf else 0
    return beyond - inf, inf


def _add(span: Span, counts: tuple[int, int]) -> None:
    span.nan += counts[0]
    span.inf += counts[1]
