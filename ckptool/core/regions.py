"""Regions of global tensors, and the plan of copies between two sets of them.

Everything a framework stores is a piece of a *global*, topology-independent tensor. A
:class:`Region` is a box ``offsets``/``lengths`` inside ``global_shape``, optionally
narrowed to a flat range ``[start, stop)`` of that box's row-major order. Flat ranges are
how ZeRO and Megatron's distributed optimizer cut tensors: as 1-D buffers that may start
and stop in the middle of a row.

A :class:`Shard` is what a rank stores under one local name: regions laid one after the
other in the shard's flat storage, with optional padding between or after them. Fused QKV,
SwiGLU ``[gate_r; up_r]`` and ZeRO flat groups are all shards of several regions.

Resharding is then one operation: :func:`plan_copies` intersects target regions with
source regions, and :func:`execute` (or a reader that fetches only the overlapping byte
runs, see :func:`byte_runs`) moves the elements. No format has reshard code of its own.

Internally a flat range is decomposed into at most ``2*ndim - 1`` boxes, so every
intersection is a box, and every box inside a region is a strided view of the region's
local buffer (``as_strided`` with the region box's contiguous strides).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Iterator, Sequence

if TYPE_CHECKING:  # the region arithmetic needs no torch: `ckptool verify` runs without it
    import torch

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""(offsets, lengths) in global coordinates."""


def _strides(lengths: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(lengths):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


def flat_to_boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """Decompose the row-major flat range ``[start, stop)`` of ``shape`` into boxes.

    The boxes are in row-major order, disjoint, and their union is exactly the range.
    """
    shape = tuple(shape)
    if start >= stop:
        return []
    if not shape:
        return [((), ())]
    if len(shape) == 1:
        return [((start,), (stop - start,))]
    inner_shape = shape[1:]
    inner = math.prod(inner_shape)
    r0, c0 = divmod(start, inner)
    r1, c1 = divmod(stop, inner)
    if r0 == r1:
        return [((r0, *o), (1, *n)) for o, n in flat_to_boxes(inner_shape, c0, c1)]
    boxes: list[Box] = []
    if c0:
        boxes += [((r0, *o), (1, *n)) for o, n in flat_to_boxes(inner_shape, c0, inner)]
        r0 += 1
    if r1 > r0:
        boxes.append(((r0, *(0,) * len(inner_shape)), (r1 - r0, *inner_shape)))
    if c1:
        boxes += [((r1, *o), (1, *n)) for o, n in flat_to_boxes(inner_shape, 0, c1)]
    return boxes


def intersect_boxes(a: Box, b: Box) -> Box | None:
    """The common box of ``a`` and ``b``, or None when they do not overlap."""
    offsets, lengths = [], []
    for ao, al, bo, bl in zip(a[0], a[1], b[0], b[1]):
        lo, hi = max(ao, bo), min(ao + al, bo + bl)
        if hi <= lo:
            return None
        offsets.append(lo)
        lengths.append(hi - lo)
    return tuple(offsets), tuple(lengths)


@dataclass(frozen=True, slots=True)
class Region:
    """A box of a global tensor, optionally narrowed to a flat range of the box.

    The local data of a region is the box's elements in row-major order, restricted to
    ``flat`` when it is set: shape ``lengths`` without ``flat``, 1-D ``(stop - start,)``
    with it.
    """

    key: str
    """Canonical key of the global tensor."""
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    flat: tuple[int, int] | None = None
    """``[start, stop)`` in the row-major order of the box, or None for the whole box."""

    def __post_init__(self):
        if not (len(self.global_shape) == len(self.offsets) == len(self.lengths)):
            raise ValueError(f"region {self.key!r}: shape, offsets and lengths differ in rank")
        for o, n, g in zip(self.offsets, self.lengths, self.global_shape):
            if o < 0 or n < 0 or o + n > g:
                raise ValueError(f"region {self.key!r}: box {self.offsets}+{self.lengths} "
                                 f"is outside {self.global_shape}")
        if self.flat is not None:
            start, stop = self.flat
            if not 0 <= start <= stop <= math.prod(self.lengths):
                raise ValueError(f"region {self.key!r}: flat range {self.flat} is outside the box")

    @classmethod
    def whole(cls, key: str, shape: Sequence[int], flat: tuple[int, int] | None = None) -> "Region":
        shape = tuple(int(n) for n in shape)
        return cls(key, shape, (0,) * len(shape), shape, flat)

    @property
    def box(self) -> Box:
        return self.offsets, self.lengths

    @property
    def numel(self) -> int:
        if self.flat is not None:
            return self.flat[1] - self.flat[0]
        return math.prod(self.lengths)

    @property
    def local_shape(self) -> tuple[int, ...]:
        return (self.numel,) if self.flat is not None else self.lengths

    def boxes(self) -> list[Box]:
        """Disjoint global boxes whose union is exactly this region's elements."""
        if self.flat is None:
            return [self.box] if self.numel else []
        return [
            (tuple(o + d for o, d in zip(self.offsets, off)), n)
            for off, n in flat_to_boxes(self.lengths, *self.flat)
        ]

    def local_offset(self, index: Sequence[int]) -> int:
        """Element offset, in this region's local buffer, of global ``index``."""
        pos = sum((i - o) * s for i, o, s in zip(index, self.offsets, _strides(self.lengths)))
        return pos - (self.flat[0] if self.flat else 0)

    def view(self, buffer: torch.Tensor, box: Box) -> torch.Tensor:
        """A strided view of global ``box`` (inside this region) in the region's buffer."""
        if buffer.numel() != self.numel:
            raise ValueError(f"region {self.key!r}: buffer has {buffer.numel()} elements, "
                             f"expected {self.numel}")
        if not buffer.is_contiguous():
            raise ValueError(f"region {self.key!r}: buffer must be contiguous")
        offsets, lengths = box
        if not lengths:
            return buffer.reshape(())
        return buffer.as_strided(lengths, _strides(self.lengths),
                                 buffer.storage_offset() + self.local_offset(offsets))


@dataclass(frozen=True, slots=True)
class Shard:
    """One local tensor: regions laid one after another in its flat storage.

    ``parts`` are ``(element offset, region)``; elements not covered are padding.
    """

    shape: tuple[int, ...]
    parts: tuple[tuple[int, Region], ...]
    dtype: torch.dtype | None = None

    def __post_init__(self):
        end = 0
        for offset, region in self.parts:
            if offset < end:
                raise ValueError(f"shard parts overlap or are out of order at {region.key!r}")
            end = offset + region.numel
        if end > math.prod(self.shape):
            raise ValueError(f"shard of shape {self.shape} is too small for its regions")

    @classmethod
    def of(cls, region: Region, dtype: torch.dtype | None = None) -> "Shard":
        return cls(region.local_shape, ((0, region),), dtype)

    @property
    def regions(self) -> tuple[Region, ...]:
        return tuple(r for _, r in self.parts)

    def views(self, tensor: torch.Tensor) -> Iterator[tuple[Region, torch.Tensor]]:
        """Each region with the slice of ``tensor`` that holds it."""
        if tuple(tensor.shape) != self.shape:
            raise ValueError(f"local tensor has shape {tuple(tensor.shape)}, expected {self.shape}")
        flat = tensor.reshape(-1)
        for offset, region in self.parts:
            yield region, flat[offset:offset + region.numel]


@dataclass(frozen=True, slots=True)
class Copy:
    """Copy global ``box`` from source region ``src`` to target region ``dst``."""

    src: int
    dst: int
    box: Box

    @property
    def numel(self) -> int:
        return math.prod(self.box[1])


class BoxIndex:
    """The boxes of many source regions (of one global tensor), found by overlap with a
    target box in O(log n + candidates) instead of a scan of all of them.

    The boxes are sorted by their start on the axis whose starts tell them apart best (dim 0
    for FSDP and pipeline stacks, the TP axis for column splits), with the running maximum
    of their ends: scanning back from the last box that starts before the target ends stops
    at the first whose running maximum ends before the target starts. Hits come back in the
    sources' order (region by region, box by box), as a scan would give them."""

    __slots__ = ("_axis", "_entries", "_starts", "_reach")

    def __init__(self, sources: Sequence[Region]):
        entries = [(n, i, b) for n, (i, b) in
                   enumerate((i, b) for i, r in enumerate(sources) for b in r.boxes())]
        ndim = len(entries[0][2][0]) if entries else 0
        self._axis = max(range(ndim), key=lambda a: len({e[2][0][a] for e in entries})) if ndim else None
        if self._axis is not None:
            a = self._axis
            entries.sort(key=lambda e: e[2][0][a])
            self._starts = [e[2][0][a] for e in entries]
            reach, top = [], -1
            for e in entries:
                top = max(top, e[2][0][a] + e[2][1][a])
                reach.append(top)
            self._reach = reach
        self._entries = entries

    def __len__(self) -> int:
        return len(self._entries)

    def overlaps(self, box: Box) -> list[tuple[int, Box]]:
        """``(source index, common box)`` of every source box that overlaps ``box``."""
        if self._axis is None:
            hits = [(n, i, intersect_boxes(b, box)) for n, i, b in self._entries]
        else:
            a = self._axis
            lo, hi = box[0][a], box[0][a] + box[1][a]
            hits = []
            k = bisect.bisect_left(self._starts, hi) - 1
            while k >= 0 and self._reach[k] > lo:
                n, i, b = self._entries[k]
                hits.append((n, i, intersect_boxes(b, box)))
                k -= 1
        return [(i, c) for _, i, c in sorted(h for h in hits if h[2] is not None)]


def plan_copies(sources: Sequence[Region], targets: Sequence[Region],
                index: BoxIndex | None = None) -> list[Copy]:
    """Every (source, target, box) such that the box is in both regions; ``index``: the
    :class:`BoxIndex` of ``sources`` (all of one key), when the caller keeps one.

    Each target element appears in exactly one copy when the sources cover every global
    element exactly once (see :func:`coverage_problems`).
    """
    if index is not None:
        return [Copy(i, j, common) for j, region in enumerate(targets)
                for tbox in region.boxes() for i, common in index.overlaps(tbox)]
    by_key: dict[str, list[int]] = {}
    for i, region in enumerate(sources):
        by_key.setdefault(region.key, []).append(i)
    indexes = {key: BoxIndex([sources[i] for i in members]) for key, members in by_key.items()}
    plan = []
    for j, region in enumerate(targets):
        found = indexes.get(region.key)
        if found is None:
            continue
        members = by_key[region.key]
        for tbox in region.boxes():
            plan += [Copy(members[i], j, common) for i, common in found.overlaps(tbox)]
    return plan


def execute(plan: Iterable[Copy], sources: Sequence[Region], source_buffers: Sequence[torch.Tensor],
            targets: Sequence[Region], target_buffers: Sequence[torch.Tensor]) -> None:
    """Carry out ``plan`` between in-memory buffers (one per region)."""
    for c in plan:
        dst = targets[c.dst].view(target_buffers[c.dst], c.box)
        dst.copy_(sources[c.src].view(source_buffers[c.src], c.box))


def byte_runs(region: Region, box: Box) -> list[tuple[int, int]]:
    """Contiguous ``(start, count)`` element runs of ``box`` in ``region``'s local buffer.

    Lets a reader fetch only the overlapping bytes of a stored region.
    """
    offsets, lengths = box
    if not lengths:
        return [(region.local_offset(()), 1)]
    # Merge trailing dims that the box spans fully within the region.
    ndim = len(lengths)
    k = ndim - 1
    while k > 0 and offsets[k] == region.offsets[k] and lengths[k] == region.lengths[k]:
        k -= 1
    run = math.prod(lengths[k:])
    runs = []
    for head in _index_product(offsets[:k], lengths[:k]):
        start = region.local_offset((*head, *offsets[k:]))
        if runs and runs[-1][0] + runs[-1][1] == start:
            runs[-1] = (runs[-1][0], runs[-1][1] + run)
        else:
            runs.append((start, run))
    return runs


def _index_product(offsets: Sequence[int], lengths: Sequence[int]) -> Iterator[tuple[int, ...]]:
    if not offsets:
        yield ()
        return
    for i in range(offsets[0], offsets[0] + lengths[0]):
        for rest in _index_product(offsets[1:], lengths[1:]):
            yield (i, *rest)


@dataclass(slots=True)
class Coverage:
    """Result of :func:`coverage_problems`: element counts that are missing or doubled."""

    missing: int = 0
    overlapping: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


_PAIRS = 2_000_000
"""Pairs of pieces :func:`coverage_problems` compares per tensor (a few seconds): a real
layout shares rows among a few thousand pieces at most (TP x column splits)."""


def coverage_problems(shape: Sequence[int], regions: Sequence[Region]) -> Coverage:
    """Check that ``regions`` cover every element of a tensor of ``shape`` exactly once."""
    shape = tuple(shape)
    total = math.prod(shape)
    boxes = sorted((b for r in regions for b in r.boxes()), key=lambda b: b[0])
    result = Coverage()
    covered = 0
    for b in boxes:
        covered += math.prod(b[1])
    # Pairwise overlap, pruned on the leading dimension (boxes are sorted by offsets); by
    # index, not by slicing the list after each box (quadratic copying at 1M chunks).
    # Pieces that share leading rows are compared pairwise, at most _PAIRS times (metadata is
    # untrusted: 200,000 copies of one chunk, or as many one-column pieces, are 2e10 pairs).
    n, pairs, cut = len(boxes), 0, False
    for i, a in enumerate(boxes):
        a_end = a[0][0] + a[1][0] if a[0] else None
        for j in range(i + 1, n):
            b = boxes[j]
            if a_end is not None and b[0][0] >= a_end:
                break
            pairs += 1
            if pairs > _PAIRS:
                cut = True
                break
            common = intersect_boxes(a, b)
            if common is not None:
                result.overlapping += math.prod(common[1])
        if cut:
            break
    if result.overlapping:
        result.problems.append(f"{'at least ' if cut else ''}{result.overlapping} elements are "
                               "stored more than once")
        return result
    if cut:
        result.problems.append(f"its {n} pieces share rows more than ckptool compares ({_PAIRS} "
                               "pairs): a malformed layout")
        return result
    result.missing = total - covered
    if result.missing > 0:
        result.problems.append(f"{result.missing} of {total} elements are not stored in any piece")
    return result


def flat_regions(parts, start: int, stop: int, key: str) -> list[tuple[int, Region]]:
    """Elements ``[start, stop)`` of a TP shard whose ``parts`` are ``(local offset, box
    region)`` (:func:`~ckptool.core.layout.split`), as canonical regions of ``key`` with a
    flat range, each with its offset from ``start``: how a ZeRO partition's slice of a
    parameter maps to the global tensor, read and written by the same rule."""
    out = []
    for local_offset, box in parts:
        lo, hi = max(start, local_offset), min(stop, local_offset + box.numel)
        if lo < hi:
            out.append((lo - start, Region(key, box.global_shape, box.offsets, box.lengths,
                                           (lo - local_offset, hi - local_offset))))
    return out
