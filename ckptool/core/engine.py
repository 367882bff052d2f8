"""The one reshard engine: fill target tensors from stored source pieces, by regions.

A format's writer says which target files exist and which shards each holds; a format's
reader says where each source piece is. The engine intersects them and copies only the
overlapping elements. It never imports a format.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from ckptool.core.errors import BadCheckpoint, UsageError
from ckptool.core.index import CheckpointIndex, Piece
from ckptool.core.lazy import lazy
from ckptool.core.regions import Shard, byte_runs, plan_copies
from ckptool.core.storage import pread_blocks

torch = lazy("torch", globals())


@dataclass(frozen=True, slots=True)
class TargetTensor:
    """One tensor of a target file: its name in the file and the regions it holds."""

    name: Any
    """Where the writer puts it (format-specific, e.g. ``("model", "decoder.layers.0...")``)."""
    shard: Shard
    dtype: torch.dtype


@dataclass(frozen=True, slots=True)
class TargetFile:
    """One file a writer will produce, with the tensors the engine must fill for it. The
    plan is frozen once made (its ``tensors`` list is filled while the writer plans)."""

    path: str
    tensors: list[TargetTensor] = field(default_factory=list)
    context: Any = None
    """The writer's own frozen description of the file (a dataclass per kind of file: its
    rank, what else it holds), made by its ``plan`` and read back by its ``write_file``."""

    @property
    def nbytes(self) -> int:
        return sum(math.prod(t.shard.shape) * t.dtype.itemsize for t in self.tensors)


ReadBox = Callable[[Piece, "torch.dtype", tuple, "torch.Tensor"], None]
"""Write global ``box`` (inside the piece's region) of a stored piece into a view."""


class ScratchPool:
    """Fill buffers shared by the workers of one rewrite, reused from tensor to tensor, with
    at most ``budget`` bytes in use at once (one tensor always fits, whatever its size).

    Filling memory that is already mapped saves the page faults and the kernel's zeroing of
    a fresh allocation per tensor (a third of a reshard's time into the page cache); the
    budget bounds the memory however many workers run: with ``2 x`` the largest tensor, at
    most two of the largest are in flight."""

    def __init__(self, budget: int):
        self._budget = budget
        self._free: list[torch.Tensor] = []
        self._in_use = 0
        self._cond = threading.Condition()

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of at least ``nbytes``; waits while the budget is spent."""
        with self._cond:
            while True:
                fits = sorted((b.numel(), i) for i, b in enumerate(self._free) if b.numel() >= nbytes)
                for size, i in fits:  # the smallest that fits and keeps to the budget
                    if self._in_use + size <= self._budget or self._in_use == 0:
                        self._in_use += size
                        return self._free.pop(i)
                if self._in_use + nbytes <= self._budget or self._in_use == 0:
                    held = self._in_use + sum(b.numel() for b in self._free)
                    while self._free and held + nbytes > self._budget:
                        held -= self._free.pop(0).numel()  # too small: make room
                    self._in_use += nbytes
                    break
                self._cond.wait()
        return torch.empty(nbytes, dtype=torch.uint8)

    def release(self, buf: torch.Tensor) -> None:
        with self._cond:
            self._in_use -= buf.numel()
            self._free.append(buf)
            self._cond.notify_all()


class Scratch:
    """One worker's view of a :class:`ScratchPool`: each tensor taken is valid until the next
    take (the writer has written it by then) or :meth:`done`."""

    def __init__(self, pool: ScratchPool):
        self._pool, self._buf = pool, None

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        self.done()
        self._buf = self._pool.acquire(nbytes)
        return self._buf[:nbytes].view(dtype).view(shape)

    def done(self) -> None:
        if self._buf is not None:
            self._pool.release(self._buf)
            self._buf = None


def fill_tensor(t: TargetTensor, index: CheckpointIndex, read_box: ReadBox,
                pad_value: float = 0.0, scratch: Scratch | None = None) -> torch.Tensor:
    """Materialize one target tensor from the source pieces, reading only the overlaps.

    Elements that belong to no region (padding) get ``pad_value``. Raises BadCheckpoint
    if a region is not fully covered by the source. With ``scratch`` the result lives in
    its buffer, valid until the next tensor is taken from it.
    """
    covered = sum(r.numel for r in t.shard.regions) == math.prod(t.shard.shape)
    buf = scratch.take(t.shard.shape, t.dtype) if scratch is not None else \
        torch.empty(t.shard.shape, dtype=t.dtype)
    if not covered:
        buf.fill_(pad_value)
    fill_into(t.shard, buf, index, read_box)
    if t.dtype == torch.float16 and buf.numel() and _narrowed(t, index) and \
            not bool(torch.isfinite(buf).all()):
        _refuse_overflow(t, buf, index, read_box, pad_value)
    return buf


def _narrowed(t: TargetTensor, index: CheckpointIndex) -> bool:
    """Whether a float16 target is filled from a source of another dtype (fp16 to fp16 cannot
    overflow: no scan)."""
    return any(index.tensors[r.key].dtype != torch.float16 for r in t.shard.regions if r.key in index.tensors)


def _refuse_overflow(t: TargetTensor, out: torch.Tensor, index: CheckpointIndex, read_box: ReadBox,
                     pad_value: float) -> None:
    """Refuse a float16 target that holds more Inf than its source (read again in fp32, only
    when the fp16 tensor holds an Inf or NaN at all): see :func:`cast`."""
    wide = fill_tensor(TargetTensor(t.name, t.shard, torch.float32), index, read_box, pad_value)
    _refuse_made_infinite(wide, out, t.shard.regions[0].key if t.shard.regions else str(t.name),
                          index.url, "float16 cannot hold the model: write it in bf16 or fp32")


def cast(data: torch.Tensor, dtype: torch.dtype, key: str, url: str, hint: str) -> torch.Tensor:
    """``data`` in ``dtype``, refused (UsageError) where a value beyond float16's range would
    become infinite: ``--dtype fp16`` of a bf16 or fp32 model, a change of the math rather than
    a rounding."""
    out = data.to(dtype)
    if dtype == torch.float16 and data.dtype != dtype and out.numel() and not bool(torch.isfinite(out).all()):
        _refuse_made_infinite(data, out, key, url, hint)
    return out


def _refuse_made_infinite(wide: torch.Tensor, out: torch.Tensor, key: str, url: str, hint: str) -> None:
    made = int(torch.isinf(out).sum()) - int(torch.isinf(wide).sum())
    if made > 0:
        largest = float(wide.float().abs().nan_to_num(0, 0, 0).max())
        raise UsageError(f"{made} values are beyond float16's range (65504): as fp16 they would be "
                         f"infinite (the largest is {largest:.4g})", path=url, key=key,
                         hint=f"{hint}; nothing was written")


def fill_into(shard: Shard, out: torch.Tensor, index: CheckpointIndex, read_box: ReadBox) -> None:
    """Fill the regions of ``shard`` in the existing tensor ``out`` (padding untouched)."""
    for region, view in shard.views(out):
        info, plan = _copies(region, index)
        for c in plan:
            read_box(info.pieces[c.src], info.dtype, c.box, region.view(view, c.box))


def check_fill(shard: Shard, index: CheckpointIndex) -> None:
    """Raise what :func:`fill_into` would for ``shard`` (a tensor missing, of another shape, or
    not covered), before anything is filled."""
    for region in shard.regions:
        _copies(region, index)


def _copies(region, index: CheckpointIndex):
    """The source tensor of a target region and the copies that fill it (all checked)."""
    info = index.tensors.get(region.key)
    if info is None:
        raise BadCheckpoint(f"source has no tensor {region.key!r}", path=index.url, key=region.key)
    if tuple(info.shape) != tuple(region.global_shape):
        raise BadCheckpoint(f"source tensor {region.key!r} has shape {tuple(info.shape)}, "
                            f"expected {tuple(region.global_shape)}", path=index.url, key=region.key)
    plan = plan_copies([p.region for p in info.pieces], [region], info.box_index())
    if sum(c.numel for c in plan) != region.numel:
        raise BadCheckpoint("source pieces do not cover the target region", path=index.url,
                            key=region.key)
    return info, plan


FileSpan = Callable[[Piece, "torch.dtype", tuple], "tuple[int, int] | None"]
"""``(fd, byte offset)`` of a stored box when its bytes are one run of a local file in the
target's dtype (``Reader.file_span``); None otherwise."""


@dataclass(slots=True)
class FileSpans:
    """A target tensor whose bytes are runs of local source files, in order: it is copied in
    the kernel where the output allows (else through a small buffer) instead of being
    filled in memory first, then hashed and written."""

    dtype: torch.dtype
    numel: int
    spans: list[tuple[int, int, int]]
    """``(fd, byte offset, byte count)``, in the tensor's order."""
    source: str

    CHUNK = 8 << 20
    _buffers = threading.local()

    def write_to(self, stream) -> None:
        """Append the bytes to ``stream``: by its ``copy_from`` (an in-kernel copy) where it
        has one and can, else read through a small buffer and ``write``."""
        copy = getattr(stream, "copy_from", None)
        for fd, offset, count in self.spans:
            done = copy(fd, offset, count) if copy is not None else 0
            if done < count:
                self._write_through_buffer(stream.write, fd, offset + done, count - done)

    def _write_through_buffer(self, write, fd: int, offset: int, count: int) -> None:
        buf = getattr(self._buffers, "buf", None)
        if buf is None:
            buf = self._buffers.buf = memoryview(bytearray(self.CHUNK))
        done = 0
        for block in pread_blocks(fd, offset, count, buf):
            write(block)
            done += len(block)
        if done < count:
            raise BadCheckpoint("file is truncated", path=self.source)


def file_spans(t: TargetTensor, index: CheckpointIndex, span_of: FileSpan) -> FileSpans | None:
    """The target tensor as runs of source files, when every copy that fills it is one
    contiguous run in the stored dtype and together they tile it with no padding; else None
    (the tensor is then filled in memory by :func:`fill_tensor`, which reports any error)."""
    if sum(r.numel for r in t.shard.regions) != math.prod(t.shard.shape):
        return None
    found = []
    for part, region in t.shard.parts:
        try:
            info, plan = _copies(region, index)
        except BadCheckpoint:
            return None
        if info.dtype != t.dtype:
            return None
        for c in plan:
            runs = byte_runs(region, c.box)
            span = span_of(info.pieces[c.src], info.dtype, c.box) if len(runs) == 1 else None
            if span is None:
                return None
            found.append((part + runs[0][0], runs[0][1], span))
    found.sort(key=lambda f: f[0])
    item, pos, spans = t.dtype.itemsize, 0, []
    for start, count, (fd, offset) in found:
        if start != pos:
            return None
        if spans and spans[-1][0] == fd and spans[-1][1] + spans[-1][2] == offset:
            spans[-1] = (fd, spans[-1][1], spans[-1][2] + count * item)  # adjacent: one run
        else:
            spans.append((fd, offset, count * item))
        pos += count
    return FileSpans(t.dtype, pos, spans, index.url) if pos == math.prod(t.shard.shape) else None


class Producer:
    """What the engine hands a writer: ``produce(target_tensor)`` fills one target tensor
    from the source (valid until the next is asked for, so a writer writes it first), and
    :meth:`spans` gives the tensor as runs of source files instead, where a streaming writer
    can copy them as they are (:func:`ckptool.core.torchreader.save_target`).

    Each worker thread fills from its own :class:`Scratch` of the one shared pool."""

    def __init__(self, index: CheckpointIndex, read_box: ReadBox, span_of: FileSpan,
                 pool: ScratchPool):
        self._index, self._read_box, self._span_of, self._pool = index, read_box, span_of, pool
        self._local = threading.local()

    def __call__(self, t: TargetTensor) -> torch.Tensor:
        scratch = getattr(self._local, "scratch", None)
        if scratch is None:
            scratch = self._local.scratch = Scratch(self._pool)
        return fill_tensor(t, self._index, self._read_box, scratch=scratch)

    def spans(self, t: TargetTensor) -> FileSpans | None:
        return file_spans(t, self._index, self._span_of)

    def file_done(self) -> None:
        """This thread's file is written: its last buffer is free."""
        scratch = getattr(self._local, "scratch", None)
        if scratch is not None:
            scratch.done()


def bytes_read(targets: list[TargetFile], index: CheckpointIndex) -> int:
    """How many source bytes the plan reads (the overlaps, not whole pieces; a piece that no
    file holds, such as a fresh optimizer state's zeros, reads nothing)."""
    total = 0
    whole: dict[str, bool] = {}  # key -> its pieces are all in files and hold each element once
    for target in targets:
        for t in target.tensors:
            for region in t.shard.regions:
                info = index.tensors.get(region.key)
                if info is None:
                    continue
                tiled = whole.get(region.key)
                if tiled is None:
                    # then a target region reads its own size: no intersection to plan (on a
                    # 1M-chunk checkpoint, planning them all again was a third of a dry run)
                    tiled = whole[region.key] = all(p.location.file for p in info.pieces) and \
                        sum(p.region.numel for p in info.pieces) == math.prod(info.shape)
                if tiled:
                    total += region.numel * info.dtype.itemsize
                    continue
                plan = plan_copies((), [region], info.box_index())
                total += sum(c.numel for c in plan if info.pieces[c.src].location.file) * info.dtype.itemsize
    return total
