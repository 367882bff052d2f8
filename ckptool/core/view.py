"""A checkpoint's tensors seen under another name schema, without copying anything.

Some formats store a model under its own names and shapes: a Hugging Face model trained
with DeepSpeed keeps ``model.layers.0.self_attn.q_proj.weight`` (row blocks of Megatron's
grouped QKV), GPT-2 keeps ``Conv1D`` weights transposed. A *schema* says, for each stored
tensor, which regions of the canonical global tensors its rows hold (``Entry``). Given a
schema, :func:`remap` turns an index keyed by stored names into one keyed by canonical
names: every stored piece (a box or a ZeRO flat range of the stored tensor) becomes
canonical boxes, each still reading its bytes from the stored piece (:class:`ViewReader`).
The schema is the one rule; readers and writers of every format share it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ckptool.core.errors import BadCheckpoint
from ckptool.core.index import (
    CheckpointIndex,
    Location,
    Piece,
    TensorInfo,
    WrappingReader,
)
from ckptool.core.lazy import lazy
from ckptool.core.regions import Region, Shard
from ckptool.core.storage import Store

torch = lazy("torch", globals())


@dataclass(frozen=True, slots=True)
class Entry:
    """One stored tensor and the canonical regions it holds, in its row order.

    ``shape`` is the row-order (Linear, ``[out, in]``) shape; with ``transposed`` the store
    holds its transpose (GPT-2 ``Conv1D``). Each part is ``(flat offset, region)``: the
    region's rows are ``offset // row`` onwards, and it spans every other dimension. A region
    of higher rank than the stored tensor (one expert of a stacked ``[E, ...]`` tensor) has
    leading dimensions of length 1: the stored tensor is its slice there."""

    name: str
    shape: tuple[int, ...]
    parts: tuple[tuple[int, Region], ...]
    transposed: bool = False

    @property
    def stored_shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.shape)) if self.transposed else self.shape

    @property
    def shard(self) -> Shard:
        return Shard(self.shape, self.parts)

    def row_blocks(self) -> list[tuple[int, int, Region]]:
        """``(first stored row, row count, canonical region)`` per part."""
        row = math.prod(self.shape[1:])
        return [(offset // row, region.lengths[_lead(self, region)], region) for offset, region in self.parts]


def _lead(e: "Entry", region: Region) -> int:
    """How many leading dimensions (each of length 1) ``region`` has beyond the stored tensor's."""
    return len(region.global_shape) - len(e.shape)


@dataclass(frozen=True, slots=True)
class Remapped:
    """Location detail of a canonical piece: a box of ``piece`` (a stored piece), with
    canonical row = stored row + ``shift``; ``transposed`` when the store holds the
    transpose."""

    piece: Piece
    shift: int
    transposed: bool
    lead: int = 0
    """Leading canonical dimensions (of length 1) the stored tensor does not have."""


@dataclass
class Remap:
    """The result of :func:`remap`: the canonical index and the stored tensors left over."""

    index: CheckpointIndex
    unused: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)


def remap(index: CheckpointIndex, entries: list[Entry], prefixes: tuple[str, ...] = ("",)) -> Remap:
    """The canonical view of ``index`` under ``entries``. Each prefix (e.g. an optimizer
    state's ``optimizer.state.exp_avg.``) maps ``prefix + stored name`` to ``prefix +
    canonical key`` by the same entries; a prefix other than ``""`` may be absent."""
    out = index.copy(tensors={})
    used, missing = set(), []
    for prefix in prefixes:
        for e in entries:
            info = index.tensors.get(prefix + e.name)
            if info is None:
                if not prefix:
                    missing.append(e.name)
                continue
            if tuple(info.shape) != e.stored_shape:
                raise BadCheckpoint(f"{e.name} has shape {list(info.shape)}, the model config implies "
                                    f"{list(e.stored_shape)}", path=index.url, key=prefix + e.name)
            used.add(prefix + e.name)
            for _, _, region in e.row_blocks():
                key = prefix + region.key
                if key not in out.tensors:
                    out.tensors[key] = TensorInfo(key, region.global_shape, info.dtype)
            for piece in info.pieces:
                for box in piece.region.boxes():
                    for region, shift, new in _canonical_boxes(e, box):
                        out.tensors[prefix + region.key].pieces.append(Piece(
                            Region(prefix + region.key, region.global_shape, *new),
                            Location(piece.location.file,
                                     detail=Remapped(piece, shift, e.transposed, _lead(e, region)))))
    unused = sorted(k for k in index.tensors if k not in used)
    return Remap(out, unused, missing)


def _canonical_boxes(e: Entry, box):
    """The canonical boxes holding stored ``box``: ``(region, row shift, (offsets, lengths))``."""
    offsets, lengths = box
    if e.transposed:
        offsets, lengths = tuple(reversed(offsets)), tuple(reversed(lengths))
    lo, hi = offsets[0], offsets[0] + lengths[0]
    for r0, n, region in e.row_blocks():
        a, b = max(lo, r0), min(hi, r0 + n)
        if a < b:
            k = _lead(e, region)
            shift = region.offsets[k] - r0
            yield region, shift, ((*region.offsets[:k], a + shift, *offsets[1:]),
                                  ((1,) * k + (b - a, *lengths[1:])))


def stored_box(piece: Piece, box, out: torch.Tensor):
    """What to read for canonical ``box`` of a remapped piece: ``(stored piece, stored box,
    view of out)``; other pieces pass through unchanged."""
    detail = piece.location.detail
    if not isinstance(detail, Remapped):
        return piece, box, out
    offsets, lengths = box
    for _ in range(detail.lead):  # the stored tensor is the canonical one's slice there
        offsets, lengths, out = offsets[1:], lengths[1:], out[0]
    offsets = (offsets[0] - detail.shift, *offsets[1:])
    if detail.transposed:
        offsets, lengths, out = tuple(reversed(offsets)), tuple(reversed(lengths)), out.t()
    return detail.piece, (offsets, lengths), out


class ViewReader(WrappingReader):
    """Reads a remapped index: each canonical box is a box of a stored piece."""

    def read_box_into(self, store: Store, piece: Piece, dtype: torch.dtype, box, out) -> None:
        piece, box, out = stored_box(piece, box, out)
        self.inner.read_box_into(store, piece, dtype, box, out)
