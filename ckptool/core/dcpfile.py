"""The PyTorch DCP container: ``.metadata`` plus ``__{rank}_{n}.distcp`` files, read safely.

``.metadata`` is a pickled ``torch.distributed.checkpoint.metadata.Metadata``. It is read
with a restricted unpickler into inert records. For every tensor it lists the global
shape and dtype and the chunks (offsets, sizes), and ``storage_data`` maps each chunk and
each non-tensor entry to ``(relative_path, offset, length)``. With the default
``torch_save`` serialization each chunk is a small ``torch.save`` archive; with the
``safetensors`` serialization each file is one safetensors container keyed by fqn.

Both the ``dcp`` format and Megatron-Core's ``torch_dist`` are this container; each
format subclasses :class:`DcpContainerReader`.
"""

from __future__ import annotations

import io
import posixpath
from typing import TYPE_CHECKING, Any

from ckptool.core import progress
from ckptool.core.errors import BadCheckpoint, CkptoolError, UnreadableInput, bounded
from ckptool.core.index import (
    CheckpointIndex,
    Location,
    ObjectInfo,
    Piece,
    Reader,
    TensorInfo,
)
from ckptool.core.lazy import lazy
from ckptool.core.regions import Region, byte_runs
from ckptool.core.safe_pickle import is_dtype, load_dcp_metadata, same_dtype, trusted
from ckptool.core.storage import METADATA_LIMIT, Store

if TYPE_CHECKING:
    from ckptool.core.torchfile import TorchFile

torch = lazy("torch", globals())
torchfile = lazy("ckptool.core.torchfile", globals())
stfile = lazy("ckptool.core.stfile", globals())

METADATA = ".metadata"
SAVE_ID_MARK = "ckptool-"
"""ckptool marks the DCP checkpoints it writes through ``storage_meta.save_id``."""
_ZIP_MAGIC = b"PK\x03\x04"


class DcpContainerReader(Reader):
    """Reads any DCP container; subclasses set ``name`` and ``detect``."""

    def read_index(self, store: Store) -> CheckpointIndex:
        meta = read_metadata(store)
        try:
            return self._read_index(store, meta)
        except (AttributeError, TypeError, KeyError, ValueError, IndexError) as exc:
            # the file parsed, into something other than DCP's records (a dict, an int where a
            # chunk list belongs...): the checkpoint is damaged, not unreadable
            raise BadCheckpoint(f"DCP metadata is malformed ({type(exc).__name__}: "
                                f"{bounded(exc, 120)})", path=store.display(METADATA)) from exc

    def _read_index(self, store: Store, meta) -> CheckpointIndex:
        index = CheckpointIndex(format=self.name, url=store.url,
                                format_version=getattr(meta, "version", None))
        storage = meta.storage_data or {}
        if not isinstance(storage, dict) or not isinstance(meta.state_dict_metadata, dict):
            raise BadCheckpoint("DCP metadata has no storage table", path=store.display(METADATA))
        by_fqn: dict[tuple[str, tuple | None], Any] = {}
        spans: dict[str, list[tuple[int, int, str]]] = {}
        contained: dict = {}  # paths checked once (256 files, not 874k chunks) -> plain form
        with progress.step("indexing .metadata", len(storage), "chunks") as step:
            self._index_storage(store, storage, by_fqn, spans, contained, index, step)
        _check_disjoint(store, spans)
        with progress.step("indexing tensors", len(storage), "chunks") as step:
            self._index_tensors(store, meta, by_fqn, index, step)
        index.files[METADATA] = 1  # read for everything else: a manifest must cover it too
        save_id = getattr(getattr(meta, "storage_meta", None), "save_id", None) or ""
        index.written_by_ckptool = save_id.startswith(SAVE_ID_MARK)
        return index

    @staticmethod
    def _index_storage(store, storage, by_fqn, spans, contained, index, step) -> None:
        # One pass per chunk, written out: at 2M chunks every call and attribute counts.
        # Anything but the records DCP writes fails an attribute read or a type test here.
        files = index.files
        n = 0
        try:
            for mindex, info in storage.items():
                n += 1
                if not n & 4095:
                    step.advance(4096)
                fqn, path, offset, length = mindex.fqn, info.relative_path, info.offset, info.length
                if (type(fqn) is not str or type(path) is not str or not path
                        or type(offset) is not int or type(length) is not int or offset < 0 or length < 0):
                    _bad_storage_info(store, fqn, info)
                path = contained.get(path) or _contain(store, path, fqn, contained)
                at = mindex.offset
                key = (fqn, tuple(at) if at is not None else None)
                if key in by_fqn:
                    raise BadCheckpoint(f"two storage entries for the chunk at {list(key[1] or ())}",
                                        path=store.display(METADATA), key=fqn)
                details = info.transform_descriptors
                by_fqn[key] = Location(path, offset, length, tuple(details) if details else None)
                end = offset + length
                if end > files.get(path, -1):
                    files[path] = end
                found = spans.get(path)
                if found is None:
                    found = spans[path] = []
                found.append((offset, end, fqn))
        except (AttributeError, TypeError) as exc:  # not DCP's records: a damaged or crafted file
            raise BadCheckpoint(f"malformed storage entry ({type(exc).__name__})",
                                path=store.display(METADATA)) from None

    @staticmethod
    def _index_tensors(store, meta, by_fqn, index, step) -> None:
        source = store.display(METADATA)
        for key, entry in meta.state_dict_metadata.items():
            if entry.chunks is None:  # BytesStorageMetadata
                location = by_fqn.get((key, None))
                index.objects[key] = ObjectInfo(key, location)
                continue
            dtype = getattr(entry.properties, "dtype", None)
            if not is_dtype(dtype):
                raise BadCheckpoint("tensor has no dtype", path=source, key=key)
            shape = _sizes(entry.size, store, key)
            tensor = TensorInfo(key, shape, dtype)
            itemsize = dtype.itemsize
            pieces = tensor.pieces
            try:
                chunks = list(entry.chunks)
            except TypeError:
                raise BadCheckpoint("tensor's chunk list is malformed", path=source, key=key) from None
            for chunk in chunks:
                offsets, sizes = _sizes(chunk.offsets, store, key), _sizes(chunk.sizes, store, key)
                location = by_fqn.get((key, offsets))
                if location is None:
                    raise BadCheckpoint(f"chunk at {list(offsets)} has no storage entry",
                                        path=source, key=key)
                try:
                    region = Region(key, shape, offsets, sizes)
                except ValueError as exc:
                    raise BadCheckpoint(str(exc), path=source, key=key) from None
                if not location.detail and region.numel * itemsize > location.length:
                    raise BadCheckpoint(f"chunk at {list(offsets)} of {list(sizes)} elements needs "
                                        f"{region.numel * itemsize} bytes, its storage "
                                        f"entry holds {location.length}", path=source, key=key)
                pieces.append(Piece(region, location))
            index.tensors[key] = tensor
            step.advance(len(pieces))

    def _archive(self, store: Store, piece: Piece) -> TorchFile | None:
        """The chunk's torch.save archive, read by byte range; None for other encodings."""
        loc = piece.location
        if loc.detail or loc.length is None:
            return None  # transformed (e.g. compressed) chunks are read whole
        cache = self.__dict__.setdefault("_archives", {})
        key = (store.url, loc.file, loc.offset)
        if key not in cache:
            readers = self.__dict__.setdefault("_readers", {})
            if (store.url, loc.file) not in readers:
                try:
                    readers[(store.url, loc.file)] = store.range_reader(loc.file)
                except UnreadableInput:
                    raise BadCheckpoint("data file is missing", path=store.display(loc.file)) from None
            reader = readers[(store.url, loc.file)]
            if loc.offset + loc.length > reader.size:
                raise BadCheckpoint(f"data file is truncated: wanted bytes {loc.offset}.."
                                    f"{loc.offset + loc.length}, the file has {reader.size}",
                                    path=store.display(loc.file))
            window = _Window(reader, loc.offset, loc.length)
            window.edges(True)
            if window(0, 4) != _ZIP_MAGIC:
                cache[key] = None
            else:
                layouts = self.__dict__.get("_layouts")
                if layouts is None:  # chunks of one shape share a layout: opened once
                    layouts = self.__dict__["_layouts"] = torchfile.ArchiveLayouts()
                cache[key] = layouts.open(window, loc.length, store.display(loc.file))
                self.note_unsafe(store.display(loc.file), cache[key].unsafe, piece.region.key)
            window.edges(False)
        return cache[key]

    def _ref(self, store: Store, piece: Piece, dtype: torch.dtype):
        archive = self._archive(store, piece)
        if archive is None:
            return None, None
        ref = archive.obj
        shape = tuple(piece.region.local_shape)
        if not isinstance(ref, torchfile.TensorRef) or ref.shape != shape or not same_dtype(ref.dtype, dtype):
            got = f"{ref.dtype} {list(ref.shape)}" if isinstance(ref, torchfile.TensorRef) else type(ref).__name__
            raise BadCheckpoint(f"stored chunk is {got}, metadata says {dtype} {list(shape)}",
                                path=store.display(piece.location.file), key=piece.region.key)
        return archive, ref

    def read_box_into(self, store: Store, piece: Piece, dtype: torch.dtype, box, out) -> None:
        archive, ref = self._ref(store, piece, dtype)
        if archive is None or not out.is_contiguous():
            return super().read_box_into(store, piece, dtype, box, out)
        flat, pos = out.view(-1), 0
        for start, n in byte_runs(piece.region, box):  # only the overlap, straight into place
            archive.read_into(ref, start, flat[pos:pos + n])
            pos += n

    def raw_span(self, store: Store, piece: Piece, dtype: torch.dtype) -> tuple[str, int] | None:
        archive, ref = self._ref(store, piece, dtype)  # checks the chunk's shape and dtype
        begin = archive.data_offset(ref, 0, piece.region.numel) if archive is not None else None
        return None if begin is None else (piece.location.file, piece.location.offset + begin)

    def read_piece(self, store: Store, piece: Piece, dtype: torch.dtype) -> torch.Tensor:
        archive, ref = self._ref(store, piece, dtype)
        if archive is not None:
            return archive.load(ref)
        loc = piece.location
        raw = read_location(store, loc)
        shape = piece.region.local_shape
        if raw[:4] == _ZIP_MAGIC:
            archive = torchfile.TorchFile(_bytes_reader(raw), len(raw), store.display(loc.file))
            if not isinstance(archive.obj, torchfile.TensorRef):
                raise BadCheckpoint("stored chunk is not a tensor", path=store.display(loc.file),
                                    key=piece.region.key)
            tensor = archive.load(archive.obj)
        elif loc.offset == 0 and _looks_like_safetensors(raw):
            tensor = _read_safetensors_chunk(store, loc.file, piece.region.key)
        else:
            expect = torch.Size(shape).numel() * dtype.itemsize
            if len(raw) != expect:
                raise BadCheckpoint(f"stored chunk has {len(raw)} bytes, expected {expect}",
                                    path=store.display(loc.file), key=piece.region.key)
            tensor = torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)
        if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
            raise BadCheckpoint(
                f"stored chunk is {tensor.dtype} {list(tensor.shape)}, metadata says "
                f"{dtype} {list(shape)}", path=store.display(loc.file), key=piece.region.key)
        return tensor.contiguous()

    def read_object(self, store: Store, obj: ObjectInfo) -> Any:
        """A non-tensor entry: its ``torch.save`` bytes read through the one unpickler
        (objects outside the allowlist stand as markers, noted by :meth:`note_unsafe`), or
        the raw bytes of a ``BytesIO`` entry."""
        if obj.location is None:
            return obj.value
        raw = read_location(store, obj.location)
        source = store.display(obj.location.file)
        if raw[:4] != _ZIP_MAGIC:
            if raw[:1] == b"\x80" and not trusted():  # a bare pickle stream (torch's legacy format)
                self.note_unsafe(source, [("", "a bare pickle stream (not a torch.save archive)")], obj.key)
            return io.BytesIO(raw)
        archive = torchfile.TorchFile(_bytes_reader(raw), len(raw), source)
        self.note_unsafe(source, archive.unsafe, obj.key)
        return archive.materialize(archive.obj)


def read_metadata(store: Store):
    if not store.exists(METADATA):
        raise BadCheckpoint("DCP metadata file is missing", path=store.display(METADATA),
                            hint="The checkpoint is incomplete; use an older one")
    size = store.size(METADATA)
    # up to METADATA_LIMIT it is read as it is; larger only when the files it describes hold
    # more bytes (a 405B model's, saved by 512 ranks, is 0.3 GB for 4 TB)
    if size > METADATA_LIMIT:
        data_bytes = sum(n for rel, n in store.files().items() if rel != METADATA)
        if size > data_bytes:
            raise BadCheckpoint(f"DCP metadata is {size} bytes, more than all the data it describes "
                                f"({data_bytes} bytes): damaged, or not DCP metadata",
                                path=store.display(METADATA))
    data = store.read_bytes(METADATA)
    try:
        return load_dcp_metadata(data, store.display(METADATA))
    except CkptoolError:
        raise
    except (EOFError, ValueError, AttributeError, ImportError, IndexError, TypeError) as exc:
        raise BadCheckpoint(f"DCP metadata cannot be parsed ({type(exc).__name__})",
                            path=store.display(METADATA)) from None
    except Exception as exc:  # pickle.UnpicklingError and friends from a damaged file
        if exc.__class__.__module__ == "_pickle" or "pickle" in type(exc).__name__.lower():
            raise BadCheckpoint(f"DCP metadata cannot be parsed ({exc})",
                                path=store.display(METADATA)) from None
        raise


def _sizes(values, store: Store, key: str) -> tuple[int, ...]:
    """A shape or offsets of the metadata as non-negative ints (a hostile file may hold
    anything there)."""
    try:
        out = tuple(values)
    except TypeError:
        out = None
    if out is not None:
        for n in out:  # a loop, not all(): this runs three times per chunk
            if type(n) is not int or n < 0:
                break
        else:
            return out
    raise BadCheckpoint(f"malformed sizes {str(values)[:60]}", path=store.display(METADATA), key=key)


def _contain(store: Store, path: str, fqn: str, contained: dict) -> str:
    """``path`` (named by the entry of ``fqn``) in its plain form (``./__0_0.distcp``, which
    torch opens, is ``__0_0.distcp``: the file verify finds), if it is inside the checkpoint,
    else PathEscape; each path is resolved once (256 files, not 874k chunks)."""
    store.contained(path, named_by=METADATA, key=fqn)
    plain = posixpath.normpath(path)
    contained[path] = plain = plain if plain not in (".", "") else path
    return plain


def _bad_storage_info(store: Store, fqn, info) -> None:
    """Raise for a storage entry that does not name a key, a file inside the checkpoint and a
    byte range of it."""
    if not isinstance(fqn, str):
        raise BadCheckpoint("a storage entry has no key", path=store.display(METADATA))
    path = getattr(info, "relative_path", None)
    store.contained(path, named_by=METADATA, key=fqn)
    raise BadCheckpoint(f"malformed storage entry ({str(path)[:60]}, offset "
                        f"{str(getattr(info, 'offset', None))[:20]}, length "
                        f"{str(getattr(info, 'length', None))[:20]})",
                        path=store.display(METADATA), key=fqn)


def _check_disjoint(store: Store, spans: dict[str, list[tuple[int, int, str]]]) -> None:
    """No two stored items share bytes of a file. (A file of DCP's safetensors serialization
    places its tensors by its own header, which is checked when it is read.)"""
    for path, items in spans.items():
        items.sort()
        for (_, end, key), (start, _, other) in zip(items, items[1:]):
            if start < end:
                if _looks_like_safetensors(store.read_bytes(path, 0, 16)):
                    break
                raise BadCheckpoint(f"the bytes of {key!r} and {other!r} overlap in {path}",
                                    path=store.display(METADATA))


class _Window:
    """Byte ranges of one item inside a ``.distcp`` file, as offsets from the item's start.

    Opening a chunk's archive reads ~20 small ranges (its zip records sit at the start and
    the end of the item, the tensor's bytes between): while :meth:`edges` is on, the first
    and last ``EDGE`` bytes are read once each and the small reads served from them."""

    EDGE = 8192

    def __init__(self, reader, base: int, length: int | None = None):
        self._reader, self._base, self._length = reader, base, length
        self._head = self._tail = None

    def edges(self, on: bool) -> None:
        """Serve small reads from the item's two edges (on), or drop them (off: an opened
        archive keeps its window for reading data, and 874k chunks must not keep 16 KiB each)."""
        self._head = self._tail = None
        self._edges = on

    _edges = False

    def __call__(self, start: int, end: int) -> bytes:
        if start < 0:  # a damaged archive's zip offsets point before the item
            raise BadCheckpoint(f"an item's archive points {-start} bytes before the item's start at "
                                f"byte {self._base} (a damaged or cut file)",
                                path=getattr(self._reader, "source", None))
        n = self._length
        if self._edges and n is not None and start <= end:
            edge = self.EDGE
            if end <= edge:
                if self._head is None:
                    self._head = self._reader(self._base, self._base + min(n, edge))
                return self._head[start:end]
            if start >= n - edge:
                at = max(0, n - edge)
                if self._tail is None:
                    self._tail = self._reader(self._base + at, self._base + n)
                return self._tail[start - at:end - at]
        return self._reader(self._base + start, self._base + end)

    def readinto(self, start: int, out) -> int:
        return self._reader.readinto(self._base + start, out)


def read_location(store: Store, loc: Location) -> bytes:
    """The raw bytes of one stored item (transforms undone); nothing is unpickled."""
    end = loc.offset + loc.length if loc.length is not None else None
    try:
        raw = store.read_bytes(loc.file, loc.offset, end)
    except UnreadableInput:
        raise BadCheckpoint("data file is missing", path=store.display(loc.file)) from None
    if loc.length is not None and len(raw) != loc.length:
        raise BadCheckpoint(f"data file is truncated: wanted bytes {loc.offset}..{end}, "
                            f"got {len(raw)}", path=store.display(loc.file))
    if loc.detail:
        raw = _untransform(raw, loc.detail, store.display(loc.file))
    return raw


def _untransform(raw: bytes, descriptors: tuple, source: str) -> bytes:
    """Undo DCP stream transforms (e.g. compression extensions) with DCP's own registry."""
    try:
        from torch.distributed.checkpoint.filesystem import (
            _StorageReaderTransforms,  # lazy: DCP costs a second to import; only transformed chunks need it
        )
    except ImportError:
        raise UnreadableInput(f"DCP transforms {list(descriptors)} need a newer torch",
                              path=source) from None
    stream = _StorageReaderTransforms().transform_load_stream(None, descriptors, io.BytesIO(raw))
    return stream.read()


def _bytes_reader(raw: bytes):
    view = memoryview(raw)
    return lambda start, end: bytes(view[start:min(end, len(view))])


def _looks_like_safetensors(raw: bytes) -> bool:
    return len(raw) > 9 and raw[8:9] == b"{"


def _read_safetensors_chunk(store: Store, file: str, key: str) -> torch.Tensor:
    source = store.display(file)
    reader = store.range_reader(file)
    try:
        entries, _ = stfile.parse_header(reader, source)
        if key not in entries:
            raise BadCheckpoint("tensor is missing from its safetensors file", path=source, key=key)
        e = entries[key]
        data = bytearray(reader(e.begin, e.end))
    finally:
        reader.close()
    return torch.frombuffer(data, dtype=e.dtype).reshape(e.shape) if data else \
        torch.empty(e.shape, dtype=e.dtype)
