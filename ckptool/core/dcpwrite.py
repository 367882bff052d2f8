"""Writing the PyTorch DCP container as a stream: one ``.distcp`` file per writer rank,
then ``.metadata``.

Each tensor chunk is a ``torch.save`` archive appended to its rank's file (what DCP's
default ``torch_save`` serialization writes) at a 64-byte boundary, each non-tensor entry
its ``torch.save`` bytes. The bytes are hashed while they are written. ``.metadata`` is built from DCP's own
metadata classes, so ``torch.distributed.checkpoint.load`` reads the result; its
``storage_meta.save_id`` carries ckptool's mark.
"""

from __future__ import annotations

import io
import pickle
import sys
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

import xxhash

from ckptool.core.dcpfile import METADATA, SAVE_ID_MARK
from ckptool.core.lazy import lazy
from ckptool.core.manifest import HashingWriter
from ckptool.core.storage import Store

torch = lazy("torch", globals())
torchfile = lazy("ckptool.core.torchfile", globals())


_ALIGN = 64


@dataclass
class ChunkRecord:
    key: str
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    file: str
    offset: int
    length: int


@dataclass
class DcpFileWriter:
    """Appends chunks and objects to one ``.distcp`` file, recording where each went."""

    store: Store
    path: str
    chunks: list[ChunkRecord] = field(default_factory=list)
    objects: list[tuple[str, str, int, int]] = field(default_factory=list)

    def __enter__(self):
        self._raw = self.store.open_file(self.path, "wb")
        self._out = HashingWriter(self._raw, self.store.durable)
        return self

    def add_chunk(self, key: str, offsets, lengths, tensor: torch.Tensor) -> None:
        # Each archive starts 64-byte aligned, so its data (aligned inside it) is aligned in
        # the file: `verify --deep` then scans it in place. DCP reads items by their recorded
        # offsets, so the zero bytes between them are read by nobody.
        if pad := -self._out.size % _ALIGN:
            self._out.write(bytes(pad))
        start = self._out.size
        torchfile.save(tensor.contiguous(), self._out)
        self.chunks.append(ChunkRecord(key, tuple(offsets), tuple(lengths), self.path, start,
                                       self._out.size - start))

    def add_bytes(self, key: str, data: bytes) -> None:
        start = self._out.size
        self._out.write(data)
        self.objects.append((key, self.path, start, len(data)))

    def add_object(self, key: str, value: Any) -> None:
        """A non-tensor entry, pickled by :func:`torchfile.save` (records under their own
        names; a global outside the allowlist is refused, never written)."""
        if isinstance(value, io.BytesIO):  # DCP keeps BytesIO entries as their raw bytes
            self.add_bytes(key, value.getvalue())
            return
        buf = io.BytesIO()
        torchfile.save(value, buf)
        self.add_bytes(key, buf.getvalue())

    def __exit__(self, *exc):
        self._out.fsync()
        self._raw.close()
        self.digest = (self._out.size, self._out.hexdigest())

    def record(self) -> "FileRecord":
        """What ``.metadata`` needs of this file (picklable: gathered across ranks)."""
        return FileRecord(self.path, list(self.chunks), list(self.objects))


@dataclass
class FileRecord:
    path: str
    chunks: list[ChunkRecord]
    objects: list[tuple[str, str, int, int]]

    def to_json(self) -> dict:
        return {"path": self.path, "objects": [list(o) for o in self.objects],
                "chunks": [[c.key, list(c.offsets), list(c.lengths), c.file, c.offset, c.length]
                           for c in self.chunks]}

    @classmethod
    def from_json(cls, data: dict) -> "FileRecord":
        return cls(data["path"], [ChunkRecord(k, tuple(o), tuple(n), f, off, ln)
                                  for k, o, n, f, off, ln in data["chunks"]],
                   [tuple(o) for o in data["objects"]])


class RecordedFiles:
    """For writers of DCP containers: the ``FileRecord`` of every file written, by target
    path, gathered across torchrun ranks and kept in resume journals (``Writer.records`` /
    ``absorb``), so ``.metadata`` is written once, from all of them."""

    def _remember(self, path: str, writer: DcpFileWriter) -> None:
        with self.__dict__.setdefault("_records_lock", threading.Lock()):
            self.__dict__.setdefault("_records", {})[path] = writer.record()

    def records(self) -> dict:
        return dict(self.__dict__.get("_records", {}))

    def absorb(self, records: dict) -> None:
        self.__dict__.setdefault("_records", {}).update(
            {path: FileRecord.from_json(r) if isinstance(r, dict) else r for path, r in records.items()})

    def recorded(self) -> list["FileRecord"]:
        return list(self.__dict__.get("_records", {}).values())


def write_metadata(store: Store, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]],
                   writers: list) -> tuple[int, str]:
    """Write ``.metadata`` for the chunks and objects the writers (or their ``FileRecord``s)
    recorded. The result depends only on what was written, not on the order files finished
    (files are taken by path), so equal checkpoints get equal bytes."""
    writers = sorted(writers, key=lambda w: w.path)
    from torch.distributed.checkpoint.filesystem import (
        _StorageInfo,  # lazy: DCP costs a second to import
    )
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    # Strings are interned: pickle shares repeated objects by identity, so records that
    # travelled between ranks must pickle exactly like local ones.
    state: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    for key, (shape, dtype) in shapes.items():
        state[sys.intern(key)] = TensorStorageMetadata(TensorProperties(dtype=dtype),
                                                       torch.Size(shape), [])
    for w in writers:
        for c in w.chunks:
            entry = state[c.key]
            entry.chunks.append(ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.lengths)))
            storage[MetadataIndex(sys.intern(c.key), tuple(c.offsets), len(entry.chunks) - 1)] = \
                _StorageInfo(sys.intern(c.file), c.offset, c.length)
        for key, file, offset, length in w.objects:
            state[sys.intern(key)] = BytesStorageMetadata()
            storage[MetadataIndex(sys.intern(key))] = _StorageInfo(sys.intern(file), offset, length)
    meta = Metadata(state_dict_metadata=state, storage_data=storage,
                    storage_meta=StorageMeta(save_id=f"{SAVE_ID_MARK}{_content_id(writers)}"),
                    version="1.0.0")

    with store.open_file(METADATA, "wb") as raw:
        out = HashingWriter(raw, store.durable)
        pickle.dump(meta, out)
        out.fsync()
    return out.size, out.hexdigest()


def _content_id(writers) -> str:
    """A uuid-shaped id derived from the recorded chunks: deterministic for equal output."""

    h = xxhash.xxh3_128()
    for w in writers:
        h.update(repr((w.path, [tuple(vars(c).values()) for c in w.chunks], w.objects)).encode())
    return str(uuid.UUID(h.hexdigest()))
