"""The index of a checkpoint: its global tensors, where their pieces are stored, its
named objects and what is known of the job that wrote it; and the protocol every format
reader implements to produce one.

This protocol is the whole surface a format must give: ``detect``, ``read_index`` and
``read_piece``/``read_object``. ``inspect``, ``verify``, ``reshard`` and ``convert`` are
written once on top of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

from ckptool.core.errors import BadCheckpoint, UnreadableInput, UsageError
from ckptool.core.lazy import lazy
from ckptool.core.regions import BoxIndex, Region
from ckptool.core.safe_pickle import UnsafeFinding
from ckptool.core.storage import Store
from ckptool.core.topology import Topology

if TYPE_CHECKING:
    from ckptool.core.torchfile import TorchFile

torch = lazy("torch", globals())
torchfile = lazy("ckptool.core.torchfile", globals())


@dataclass(frozen=True, slots=True)
class Location:
    """Where the bytes of one stored piece or object are."""

    file: str
    """Path relative to the checkpoint directory."""
    offset: int = 0
    length: int | None = None
    """Byte length, or None for 'to the end of the file'."""
    detail: Any = None
    """Format-specific: e.g. DCP transform descriptors, a key inside a container file."""


@dataclass(frozen=True, slots=True)
class Piece:
    """One stored piece of a global tensor: a region and where its bytes are."""

    region: Region
    location: Location


@dataclass(slots=True)
class TensorInfo:
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: list[Piece] = field(default_factory=list)
    replicas: list[Piece] = field(default_factory=list)
    """Further stored copies of regions the pieces already cover (TP-replicated norms, the
    last stage's tied embedding). Never read for data; ``verify --deep`` checks they are equal."""
    _boxes: Any = field(default=None, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def box_index(self) -> BoxIndex:
        """The :class:`~ckptool.core.regions.BoxIndex` of the pieces' regions, built once (again
        when pieces were added): planning a target region costs O(log pieces), not a scan."""
        if self._boxes is None or self._boxes[0] != len(self.pieces):
            self._boxes = (len(self.pieces), BoxIndex([p.region for p in self.pieces]))
        return self._boxes[1]


@dataclass(slots=True)
class ObjectInfo:
    """A named non-tensor entry (iteration, args, scheduler, RNG state...)."""

    key: str
    location: Location | None = None
    value: Any = None
    """Set when the value is already known from the metadata itself."""


L = TypeVar("L")


@dataclass(slots=True)
class CheckpointIndex:
    format: str
    url: str
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    objects: dict[str, ObjectInfo] = field(default_factory=dict)
    files: dict[str, int] = field(default_factory=dict)
    """Every file the format's own metadata names -> the least size it must have."""
    topology: Topology | None = None
    model_config: dict | None = None
    true_vocab_size: int | None = None
    iteration: int | None = None
    format_version: str | None = None
    written_by_ckptool: bool = False
    """The format's own metadata carries ckptool's mark: without a manifest it is uncommitted."""
    model_dtype: torch.dtype | None = None
    """The dtype of the model's weights in training, where the only stored copy has another
    (a bf16 ZeRO-3 run stores fp32 partitions): what weights-only output defaults to."""
    unmapped: str | None = None
    """Why state the source holds could not be mapped to global tensors (e.g. an optimizer
    layout ckptool cannot derive): every writer refuses it unless it is dropped on request."""
    contradicts: str | None = None
    """Where the source's own metadata says another model than its code computed (Megatron-LM
    args its legacy model never applied): read, inspected and resharded as it is, never
    converted (the output would compute what the metadata says)."""
    layouts: dict[type, Any] = field(default_factory=dict)
    """What the reader knows of the source beyond its tensors and stored objects, one typed
    record per kind, keyed by its class: a DeepSpeed source's file structure, a Megatron
    optimizer's non-tensor state, the Hugging Face config of a model... A writer (or the
    core) asks for the record it understands with :meth:`layout`; no string keys."""

    def layout(self, kind: type[L]) -> L | None:
        """The source's record of class ``kind``, or None when the source has none."""
        return self.layouts.get(kind)

    def set_layout(self, record: Any) -> None:
        """Record ``record`` under its class (replacing one of the same class)."""
        self.layouts[type(record)] = record

    def drop_layout(self, kind: type) -> None:
        self.layouts.pop(kind, None)

    def copy(self, **changes) -> "CheckpointIndex":
        """A copy whose tensor, object, file and layout tables can change without touching
        this index's (their entries are shared)."""
        return replace(self, **{"tensors": dict(self.tensors), "objects": dict(self.objects),
                                "files": dict(self.files), "layouts": dict(self.layouts), **changes})


class Reader:
    """A format's reader. Subclasses set ``name`` and implement the four methods."""

    name: str = ""

    def configure(self, **options) -> None:
        """Reader options (e.g. hf's ``model_family``); a reader takes only its own."""
        if options:
            flags = ", ".join("--" + k.replace("_", "-") for k in options)
            raise UsageError(f"{flags} does not apply to {self.name} input")

    @classmethod
    def detect(cls, store: Store) -> bool:
        """True when ``store`` is a checkpoint directory of this format."""
        raise NotImplementedError

    def read_index(self, store: Store) -> CheckpointIndex:
        raise NotImplementedError

    def canonical(self, store: Store, index: CheckpointIndex) -> CheckpointIndex | None:
        """The index under canonical (Megatron-Core) names, for writing another format, when
        ``read_index`` gives the format's own names (a DeepSpeed module's); None when the
        names are canonical already or nothing says how to map them. Its pieces are read
        through :class:`ckptool.core.view.ViewReader`."""
        return None

    def native(self, store: Store, index: CheckpointIndex) -> CheckpointIndex | None:
        """The index under the names the format stores (a Hugging Face model's), for writing
        a format that keeps them (a DeepSpeed engine's module), when ``read_index`` gives
        canonical names; None when its names are the stored ones already."""
        return None

    def read_piece(self, store: Store, piece: Piece, dtype: torch.dtype) -> torch.Tensor:
        """The piece's local tensor, of shape ``piece.region.local_shape``."""
        raise NotImplementedError

    def read_box(self, store: Store, piece: Piece, dtype: torch.dtype, box) -> torch.Tensor:
        """Global ``box`` of a piece (contiguous, box-shaped). Formats that can fetch byte
        ranges override this to read only the box; the default reads the whole piece."""
        return piece.region.view(self.read_piece(store, piece, dtype), box).contiguous()

    def read_box_into(self, store: Store, piece: Piece, dtype: torch.dtype, box,
                      out: torch.Tensor) -> None:
        """Write global ``box`` of a piece into ``out`` (a box-shaped, possibly strided view)."""
        out.copy_(self.read_box(store, piece, dtype, box).view(out.shape))

    def file_span(self, store: Store, piece: Piece, dtype: torch.dtype, box) -> tuple[int, int] | None:
        """``(fd, byte offset)`` where global ``box`` of a piece is stored as one contiguous run
        of a local file, in ``dtype``: exactly the bytes :meth:`read_box_into` would copy, so
        the engine may stream them to the output without filling a tensor. None (the default)
        when that is not so or the format transforms what it reads."""
        return None

    def raw_span(self, store: Store, piece: Piece, dtype: torch.dtype) -> tuple[str, int] | None:
        """``(file, byte offset)`` where the whole piece is stored as its plain C-order bytes in
        ``dtype`` (``piece.region.numel`` elements, little-endian, nothing to undo), checked
        against what the format declares for it: exactly the bytes :meth:`read_piece` would
        return, so that ``verify --deep`` may scan the file as it hashes it. None (the
        default) when that is not so; raises as :meth:`read_piece` would for a bad piece."""
        return None

    def read_object(self, store: Store, obj: ObjectInfo) -> Any:
        """The value of a named object. Where its pickle names a global outside the
        allowlist, an inert marker stands in the tree, and :meth:`note_unsafe` lists it."""
        if obj.location is None:
            return obj.value
        raise NotImplementedError

    def open_archive(self, store: Store, rel: str) -> TorchFile:
        """One ``torch.save`` file of the checkpoint, opened through the one unpickler (its
        container checked, tensors left on disk); what its pickle refuses is noted."""
        try:
            read = store.range_reader(rel)
        except UnreadableInput:
            raise BadCheckpoint("file is missing", path=store.display(rel)) from None
        archive = torchfile.TorchFile(read, read.size, store.display(rel))
        self.note_unsafe(store.display(rel), archive.unsafe)
        return archive

    def note_unsafe(self, source: str, found, key: str | None = None) -> None:
        """Record ``(entry, global)`` pairs of a pickle this reader loaded (``key`` prefixes
        the entry: the object or tensor it belongs to)."""
        if not found:
            return
        notes = self.__dict__.setdefault("_unsafe", {})
        for entry, name in found:
            where = ".".join(x for x in (key, entry) if x) or None
            notes.setdefault(UnsafeFinding(source, where, name), None)

    def unsafe_pickles(self) -> list[UnsafeFinding]:
        """Every pickled entry this reader has loaded so far that names a global outside the
        allowlist (none is imported). Commands refuse them unless pickles are trusted."""
        return list(self.__dict__.get("_unsafe", {}))


class WrappingReader(Reader):
    """A reader over another (``inner``): a remapped view of its index, or a source with
    pieces no file holds. Reading goes through :meth:`read_box_into`, which a subclass
    defines; objects and the pickle findings are the inner reader's."""

    def __init__(self, inner: Reader):
        self.inner, self.name = inner, inner.name

    def read_box(self, store: Store, piece: Piece, dtype: torch.dtype, box) -> torch.Tensor:
        out = torch.empty(box[1], dtype=dtype)
        self.read_box_into(store, piece, dtype, box, out)
        return out

    def read_piece(self, store: Store, piece: Piece, dtype: torch.dtype) -> torch.Tensor:
        return self.read_box(store, piece, dtype, piece.region.box).view(piece.region.local_shape)

    def read_object(self, store: Store, obj: ObjectInfo) -> Any:
        return self.inner.read_object(store, obj)

    def note_unsafe(self, source: str, found, key: str | None = None) -> None:
        self.inner.note_unsafe(source, found, key)

    def unsafe_pickles(self) -> list[UnsafeFinding]:
        return self.inner.unsafe_pickles()


class Writer:
    """A format's writer, driven by the one rewrite path (``ckptool.ops.reshard.rewrite``).

    ``plan`` lists the target files and the shards each holds; ``write_file`` writes one
    (``produce(target_tensor)`` fills each tensor from the source, one at a time: a tensor
    is valid until the next ``produce``, so it must be written before the next is asked for) and
    returns ``(size, xxh3-128)``; ``finalize`` runs once after every file is written and
    returns the further files it wrote. A writer says what it cannot carry
    (``unsupported_state``), so nothing is dropped silently, and what a user resuming
    from its output must know (``notes``).
    """

    name: str = ""
    holds_optimizer: bool = True
    """False for weights-only formats (hf): optimizer state is then left out, and said so."""
    reshards: bool = True
    """It rewrites its own format at another layout (``ckptool reshard``); False for formats
    without a parallel layout (hf) or with only one (deepspeed-universal)."""
    canonical_source: bool = True
    """The source is read under canonical names (``Reader.canonical``) when it is another
    format; False for a writer of the source's own names (DeepSpeed: the module's), which
    reads another format under its stored names (``Reader.native``)."""
    fresh_optimizer: bool = False
    """It can write a fresh optimizer state for a weights-only source (``--init-optimizer``)."""

    @classmethod
    def serves(cls, index: CheckpointIndex) -> bool:
        """Whether this writer writes its format from source ``index``: a format with
        writers for particular sources (DeepSpeed's for a pipeline, for a Hugging Face
        model) registers them as variants, each saying which sources it serves."""
        return True

    def configure(self, **options) -> None:
        """Format options (e.g. hf's ``max_shard_size``); a writer takes only its own."""
        if options:
            flags = ", ".join("--" + k.replace("_", "-") for k in options)
            raise UsageError(f"{flags} does not apply to {self.name} output")

    def target_topology(self, source: Topology, changes: dict) -> Topology:
        """The output's topology: the source's, with the requested changes."""

        return replace(source, **changes)

    def bind(self, opened) -> None:
        """Called once with the opened source, for writers that copy raw source bytes."""

    def target_spec(self, index: CheckpointIndex, source: Topology, target: Topology,
                    true_vocab_size: int | None):
        raise NotImplementedError

    def source_schema(self, opened) -> str:
        raise NotImplementedError

    def plan(self, index: CheckpointIndex, topo: Topology, spec, schema: str,
             with_optimizer: bool = True) -> list:
        raise NotImplementedError

    def write_file(self, store: Store, target, produce, index: CheckpointIndex,
                   true_vocab_size: int | None) -> tuple[int, str]:
        raise NotImplementedError

    def records(self) -> dict[str, Any]:
        """Per-file facts ``finalize`` needs (e.g. where each chunk went), by file path.
        Under torchrun each rank writes some files; rank 0 ``absorb``s everyone's records
        before it finalizes."""
        return {}

    def absorb(self, records: dict[str, Any]) -> None:
        """Take the records of files other ranks wrote."""

    def finalize(self, store: Store, index: CheckpointIndex) -> list[str]:
        return []

    def unsupported_state(self, index: CheckpointIndex) -> str | None:
        """State of the source this writer cannot carry; by default what the reader could
        not map (the caller refuses rather than drop it silently)."""
        return index.unmapped

    def notes(self, index: CheckpointIndex) -> list[str]:
        return []
