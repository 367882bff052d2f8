"""``torch.save`` files as checkpoint storage: readers whose pieces are element ranges of
stored tensors, and the streaming writer of a target file (:func:`save_target`).

Megatron's rank files and DeepSpeed's model/optimizer states are such files. A piece's
location is ``Location(file, detail=(path, element offset))``: ``path`` leads through the
file's object tree to a stored tensor, and the piece's region starts at that element of
it (a flat ZeRO or distributed-optimizer partition, or a whole tensor at offset 0). Files
are opened once, by byte range (:class:`~ckptool.core.torchfile.TorchFile`), and only the
bytes a box needs are read.
"""

from __future__ import annotations

from typing import Any

from ckptool.core import torchfile
from ckptool.core.engine import Producer
from ckptool.core.errors import BadCheckpoint
from ckptool.core.index import Piece, Reader
from ckptool.core.lazy import lazy
from ckptool.core.manifest import HashingWriter
from ckptool.core.regions import byte_runs
from ckptool.core.safe_pickle import same_dtype
from ckptool.core.storage import Store
from ckptool.core.torchfile import TensorRef, TorchFile

torch = lazy("torch", globals())


class TorchFileReader(Reader):
    def __init__(self):
        self._files: dict[str, TorchFile] = {}

    def _load(self, store: Store, rel: str) -> TorchFile:
        """The file's archive index (cached); tensors stay on disk until a box is read."""
        if rel not in self._files:
            archive = self.open_archive(store, rel)
            if not isinstance(archive.obj, dict) and not self.accepts_non_dict(rel):
                raise BadCheckpoint("file does not hold a dict", path=store.display(rel))
            self._files[rel] = archive
        return self._files[rel]

    def accepts_non_dict(self, rel: str) -> bool:
        """Whether a file whose top object is not a dict is still one of this format's."""
        return False

    def resolve(self, obj: Any, path: tuple) -> Any:
        """The object at ``path`` in a file's tree."""
        for step in path:
            obj = obj[step]
        return obj

    def _ref(self, store: Store, piece: Piece) -> tuple[TorchFile, TensorRef, int]:
        path, offset = piece.location.detail
        archive = self._load(store, piece.location.file)
        return archive, self.resolve(archive.obj, path), offset

    def read_piece(self, store: Store, piece: Piece, dtype: torch.dtype) -> torch.Tensor:
        archive, ref, offset = self._ref(store, piece)
        return archive.read_elements(ref, offset, piece.region.numel).view(piece.region.local_shape)

    def read_box(self, store: Store, piece: Piece, dtype: torch.dtype, box) -> torch.Tensor:
        archive, ref, offset = self._ref(store, piece)
        runs = [(offset + start, n) for start, n in byte_runs(piece.region, box)]
        return archive.read_runs(ref, runs).view(box[1])

    def _plain(self) -> bool:
        """Reading is this class's plain byte copy: a subclass that reads otherwise (a
        conversion, a reorder) must not be bypassed."""
        return all(getattr(type(self), m) is getattr(TorchFileReader, m)
                   for m in ("read_box_into", "read_box", "read_piece"))

    def raw_span(self, store: Store, piece: Piece, dtype: torch.dtype) -> tuple[str, int] | None:
        if not self._plain():
            return None
        archive, ref, offset = self._ref(store, piece)
        if not same_dtype(ref.dtype, dtype):
            return None
        begin = archive.data_offset(ref, offset, piece.region.numel)
        return None if begin is None else (piece.location.file, begin)

    def file_span(self, store: Store, piece: Piece, dtype: torch.dtype, box) -> tuple[int, int] | None:
        if not self._plain():
            return None
        runs = byte_runs(piece.region, box)
        if len(runs) != 1:
            return None
        archive, ref, offset = self._ref(store, piece)
        if not same_dtype(ref.dtype, dtype):
            return None
        return archive.span(ref, offset + runs[0][0], runs[0][1])

    def read_box_into(self, store: Store, piece: Piece, dtype: torch.dtype, box, out) -> None:
        if not out.is_contiguous():
            return super().read_box_into(store, piece, dtype, box, out)
        archive, ref, offset = self._ref(store, piece)
        flat, pos = out.view(-1), 0
        for start, n in byte_runs(piece.region, box):  # straight from the file into place
            archive.read_into(ref, offset + start, flat[pos:pos + n])
            pos += n


def save_target(store: Store, target, tree: Any, produce) -> tuple[int, str]:
    """Stream ``tree`` to ``target.path`` as a torch.save archive, hashing and fsyncing; each
    ``Pending`` placeholder in it (named by a target tensor) is produced as it is written.
    Returns (size, xxh3-128)."""
    pending = {t.name: t for t in target.tensors}
    spans = produce.spans if isinstance(produce, Producer) else None  # stream runs of source files
    if "/" in target.path:
        store.fs.makedirs(store.path(target.path.rsplit("/", 1)[0]), exist_ok=True)
    with store.open_file(target.path, "wb") as raw:
        out = HashingWriter(raw, store.durable)
        torchfile.save(tree, out, lambda p: (spans and spans(pending[p.key])) or produce(pending[p.key]))
        out.fsync()
    return out.size, out.hexdigest()
