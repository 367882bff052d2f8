"""``torch.save`` archives, read by byte ranges and written as a stream.

A ``torch.save`` file is an uncompressed zip: ``archive/data.pkl`` (the pickled object,
whose tensors refer to storages by key) and ``archive/data/<key>`` (each storage's raw
bytes). ckptool reads it without ``torch.load``:

* the pickle goes through ckptool's one unpickler (:mod:`ckptool.core.safe_pickle`), in
  which tensors become :class:`TensorRef` (storage key, offset, shape, dtype: no bytes are
  read) and allowlisted classes inert records (nothing is imported or run);
* bytes are fetched by range (``pread`` locally, range requests on object stores), so a
  reshard reads only the regions it needs and holds none of the file in memory.

:func:`save` writes the same format as a stream: the pickle first, then each tensor's
bytes as it is produced, so a writer holds one tensor at a time. Records are written
back under their original names, so what ckptool carries survives unchanged; a global
outside the allowlist is never written.
"""

from __future__ import annotations

import collections
import functools
import io
import math
import pickle
import struct
import sys
import zipfile
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable

import xxhash

from ckptool.core.errors import BadCheckpoint, UnsupportedFormat
from ckptool.core.lazy import lazy
from ckptool.core.safe_pickle import (
    Record,
    Unpickler,
    as_torch,
    dtype_named,
    is_dtype,
    parsing,
    record_class,
    refuse_unsafe,
    unsafe_in,
)

torch = lazy("torch", globals())

_STORAGE_DTYPES = {
    "DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32",
    "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8",
    "BoolStorage": "bool",
}
"""torch's legacy storage types by the dtype they hold (names: torch is imported on first use)."""


def _storage_names() -> dict:
    names = _STORAGE_NAMES_CACHE
    if not names:
        names.update({getattr(torch, v): k for k, v in _STORAGE_DTYPES.items()})
    return names


_STORAGE_NAMES_CACHE: dict = {}


def writable_dtypes() -> frozenset:
    """The tensor dtypes ckptool writes (torch's legacy storage types; fp8, complex and the
    unsigned 16-64 bit kinds not yet)."""
    return frozenset(_storage_names())


@dataclass(frozen=True, slots=True)
class StorageRef:
    key: str
    dtype: torch.dtype
    numel: int


@dataclass(frozen=True, slots=True)
class TensorRef:
    """A tensor inside a torch.save archive, not yet read."""

    storage: StorageRef
    offset: int
    """Element offset into the storage."""
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def dtype(self) -> torch.dtype:
        return as_torch(self.storage.dtype)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def contiguous(self) -> bool:
        return _contiguous(self.shape, self.stride)


@functools.lru_cache(maxsize=4096)
def _contiguous(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Row-major strides (sizes-1 dims aside): asked once per chunk of 874k, of few shapes."""
    expect, acc = [], 1
    for n in reversed(shape):
        expect.append(acc)
        acc *= n
    return all(n == 1 or s == e for n, s, e in zip(shape, stride, reversed(expect)))


def _check_extent(ref: "TensorRef", source: str) -> None:
    """A tensor's elements lie inside its storage (shape and strides from the pickle)."""
    if any(n < 0 for n in ref.shape) or any(st < 0 for st in ref.stride) or ref.offset < 0 \
            or len(ref.stride) != len(ref.shape):
        raise BadCheckpoint(f"tensor of shape {list(ref.shape)[:8]} has a negative size, stride or "
                            "offset", path=source)
    if ref.numel and ref.offset + sum((n - 1) * st for n, st in zip(ref.shape, ref.stride)) \
            >= ref.storage.numel:
        raise BadCheckpoint(f"tensor of shape {list(ref.shape)[:8]} reaches past its storage "
                            f"{ref.storage.key} ({ref.storage.numel} elements)", path=source)


_TENSOR_TYPES = {("torch._tensor", "Tensor"), ("torch", "Tensor"), ("torch.nn.parameter", "Parameter")}
"""Tensor types whose ``_rebuild_from_type_v2`` is read as the plain tensor."""


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None, *state):
    """``torch._utils._rebuild_parameter[_with_state]``: a Parameter is read as its tensor."""
    return data


def _rebuild_from_type(func, new_type, args, state):
    """``torch._tensor._rebuild_from_type_v2``: a plain tensor or Parameter that carries Python
    attributes (e.g. DeepSpeed's ``ds_id`` on ZeRO-3 partitions). It is read as the plain
    tensor, without those attributes; any other type is refused."""
    result = func(*args)
    if isinstance(result, TensorRef) and isinstance(new_type, type) and issubclass(new_type, Record) \
            and not new_type.unsafe and (new_type._module, new_type._name) in _TENSOR_TYPES:
        return result
    if isinstance(result, TensorRef) and new_type in (torch.Tensor, torch.nn.Parameter):
        return result  # trusted pickles import the real classes
    return record_class("torch._tensor", "_rebuild_from_type_v2", unsafe=True)(func, new_type, args, state)




class _Unpickler(Unpickler):
    """The allowlisted unpickler, with tensors as :class:`TensorRef` (no bytes read)."""

    def __init__(self, file):
        super().__init__(file)
        self.storages: list[StorageRef] = []
        self.tensors: list[TensorRef] = []

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name in ("_rebuild_tensor_v2", "_rebuild_tensor"):
            return self._rebuild_tensor
        if module == "torch._utils" and name in ("_rebuild_parameter", "_rebuild_parameter_with_state"):
            return _rebuild_parameter
        if module == "torch._tensor" and name == "_rebuild_from_type_v2":
            return _rebuild_from_type
        if (module, name) in _TENSOR_TYPES:
            return record_class(module, name)  # only as _rebuild_from_type_v2's new_type
        if module == "torch" and name in _STORAGE_DTYPES:
            return dtype_named(_STORAGE_DTYPES[name])
        return super().find_class(module, name)

    def _rebuild_tensor(self, storage, offset, size, stride, *rest):
        if not isinstance(storage, StorageRef):
            raise pickle.UnpicklingError("a tensor without a storage")
        try:
            ref = TensorRef(storage, int(offset), tuple(int(n) for n in size),
                            tuple(int(n) for n in stride))
        except (TypeError, ValueError):
            raise pickle.UnpicklingError("a tensor with a malformed shape") from None
        self.tensors.append(ref)
        return ref

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unknown persistent id {str(pid)[:80]}")
        _, dtype, key, _location, numel = pid
        if not is_dtype(dtype):
            dtype = dtype_named("uint8")  # an untyped storage
        if not isinstance(numel, int) or numel < 0:
            raise pickle.UnpicklingError(f"storage {str(key)[:40]} has {str(numel)[:40]} elements")
        storage = StorageRef(str(key), dtype, numel)
        self.storages.append(storage)
        return storage


class TorchFile:
    """The index of one torch.save archive: the object tree and where each storage is.

    Opening checks the container from its metadata alone (no tensor bytes are read): every
    record of the zip's central directory has its local header, under the same name,
    inside the file, without overlap; every storage the pickle names is a record holding
    its bytes; every tensor lies inside its storage. A damaged or hostile archive is
    :class:`BadCheckpoint` here, never an allocation of what it claims. Globals outside
    the allowlist are listed in ``unsafe`` (``(entry, global)``), never imported.
    """

    def __init__(self, read: Callable[[int, int], bytes], size: int, source: str):
        self.source = source
        self._read = read
        self._size = size
        self._offsets: dict[str, int] = {}
        sizes: dict[str, int] = {}
        try:
            zf = zipfile.ZipFile(_RangeFile(read, size))
            infos = zf.infolist()
        except (zipfile.BadZipFile, OSError, ValueError, struct.error, EOFError,
                NotImplementedError) as exc:  # a zip "version needed" it does not read
            raise BadCheckpoint(f"not a readable torch.save archive ({exc})", path=source) from None
        pkl = order = None
        ends = []
        # where the CRC-32 fields are (each record's local header, each central directory
        # entry): the only bytes the parse reads but never uses (see ArchiveLayouts)
        self._crc_fields = [info.header_offset + 14 for info in infos]
        entry = zf.start_dir
        for info in infos:
            self._crc_fields.append(entry + 16)
            entry += 46 + len(info.orig_filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437")) \
                + len(info.extra) + len(info.comment)
        for info in infos:
            if info.compress_type != zipfile.ZIP_STORED:
                raise BadCheckpoint("compressed torch.save archive", path=source)
            start = self._record_start(info)
            ends.append((info.header_offset, start + info.file_size, info.filename))
            _, _, rest = info.filename.partition("/")
            if rest == "data.pkl":
                pkl = read(start, start + info.file_size)
            elif rest == "byteorder":
                order = read(start, start + min(info.file_size, 16))
            elif rest.startswith("data/"):
                self._offsets[rest[len("data/"):]] = start
                sizes[rest[len("data/"):]] = info.file_size
        ends.sort()
        for (_, end, name), (next_header, _, next_name) in zip(ends, ends[1:]):
            if end > next_header:
                raise BadCheckpoint(f"records {name} and {next_name} overlap", path=source)
        if pkl is None:
            raise BadCheckpoint("torch.save archive without data.pkl", path=source)
        if order not in (None, b"little"):  # absent: torch too reads it as little-endian
            if order == b"big":
                raise UnsupportedFormat(
                    "big-endian torch.save archive: ckptool reads little-endian tensors only",
                    path=source, hint="load it with torch.load and save it again with torch.save on "
                                      "a little-endian machine")
            raise BadCheckpoint(f"torch.save archive with byteorder {order[:16]!r}", path=source)
        unpickler = _Unpickler(io.BytesIO(pkl))
        try:
            with parsing(pkl, source):
                self.obj = unpickler.load()
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError,
                KeyError, RecursionError, MemoryError, OverflowError) as exc:
            raise BadCheckpoint(f"damaged pickle in torch.save archive ({type(exc).__name__}: "
                                f"{str(exc)[:120]})", path=source) from None
        for storage in unpickler.storages:
            have = sizes.get(storage.key)
            need = storage.numel * storage.dtype.itemsize
            if have is None:
                raise BadCheckpoint(f"storage {storage.key} is missing from the archive", path=source)
            if have < need:
                raise BadCheckpoint(f"storage {storage.key} holds {have} bytes, its tensors need "
                                    f"{need}", path=source)
        for ref in unpickler.tensors:
            _check_extent(ref, source)
        self.unsafe = list(unsafe_in(self.obj)) if unpickler.refused else []
        """``(entry, global)`` of each object whose pickle names a global outside the allowlist."""

    def _like(self, read: Callable[[int, int], bytes], source: str) -> "TorchFile":
        """This archive's index for another archive of the same layout (:class:`ArchiveLayouts`)
        read through ``read``: what the parse found is shared, nothing is re-read."""
        other = object.__new__(TorchFile)
        other.__dict__.update(self.__dict__)
        other._read, other.source = read, source
        return other

    def _record_start(self, info: zipfile.ZipInfo) -> int:
        """Where a record's bytes start, after checking its local header against the
        central directory (a renamed or moved record is a damaged archive)."""
        header = self._read(info.header_offset, info.header_offset + 30)
        if len(header) < 30 or header[:4] != b"PK\x03\x04":
            raise BadCheckpoint(f"record {info.filename} has no local header at byte "
                                f"{info.header_offset}", path=self.source)
        flags, name_len, extra_len = struct.unpack("<H", header[6:8])[0], *struct.unpack("<HH", header[26:30])
        name = self._read(info.header_offset + 30, info.header_offset + 30 + name_len)
        if name != info.orig_filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437"):
            raise BadCheckpoint(f"record {info.filename} is named "
                                f"{name.decode(errors='replace')!r} in its local header", path=self.source)
        local = struct.unpack("<II", header[18:26])
        if not flags & 0x08 and 0xFFFFFFFF not in local and local != (info.compress_size, info.file_size):
            raise BadCheckpoint(f"record {info.filename}: its local header says {local[1]} bytes, "
                                f"the central directory {info.file_size}", path=self.source)
        start = info.header_offset + 30 + name_len + extra_len
        if start + info.file_size > self._size:
            raise BadCheckpoint(f"record {info.filename} runs past the end of the file "
                                f"({start + info.file_size} > {self._size} bytes)", path=self.source)
        return start

    def read_into(self, ref: TensorRef, start: int, out: torch.Tensor) -> None:
        """Fill the contiguous 1-D ``out`` with elements from flat element ``start``,
        converted to ``out``'s dtype when it is not the stored one (a bf16 parameter loaded
        from fp32 masters)."""
        if out.dtype != ref.dtype:
            staged = torch.empty(out.shape, dtype=ref.dtype)
            self.read_into(ref, start, staged)
            out.copy_(staged)
            return
        if not ref.contiguous:
            raise BadCheckpoint("non-contiguous stored tensor", path=self.source)
        base = self._offsets.get(ref.storage.key)
        if base is None:
            raise BadCheckpoint(f"storage {ref.storage.key} is missing from the archive", path=self.source)
        if out.numel() == 0:
            return
        item = ref.dtype.itemsize
        view = memoryview(out.view(torch.uint8).numpy()).cast("B") if out.dtype != torch.uint8 \
            else memoryview(out.numpy()).cast("B")
        begin = base + (ref.offset + start) * item
        if hasattr(self._read, "readinto"):
            got = self._read.readinto(begin, view)
        else:
            data = self._read(begin, begin + view.nbytes)
            got = len(data)
            view[:got] = data
        if got != view.nbytes:
            raise BadCheckpoint("archive is truncated", path=self.source)

    def span(self, ref: TensorRef, start: int, count: int) -> tuple[int, int] | None:
        """``(fd, byte offset)`` of ``count`` elements from flat element ``start`` of a
        contiguous tensor in a local file; None when the archive is not one (or the run
        would pass its end: reading reports that)."""
        fd = getattr(self._read, "fd", None)
        begin = self.data_offset(ref, start, count)
        return None if fd is None or begin is None else (fd, begin)

    def data_offset(self, ref: TensorRef, start: int, count: int) -> int | None:
        """Byte offset in the archive of ``count`` elements from flat element ``start`` of a
        contiguous tensor, stored uncompressed; None when not so (or the run would pass the
        archive's end)."""
        base = self._offsets.get(ref.storage.key)
        if base is None or not ref.contiguous:
            return None
        begin = base + (ref.offset + start) * ref.dtype.itemsize
        return begin if begin + count * ref.dtype.itemsize <= self._size else None

    def read_elements(self, ref: TensorRef, start: int, count: int) -> torch.Tensor:
        """``count`` elements from flat element ``start`` of a contiguous tensor."""
        out = torch.empty(count, dtype=ref.dtype)
        self.read_into(ref, start, out)
        return out

    def read_runs(self, ref: TensorRef, runs: list[tuple[int, int]]) -> torch.Tensor:
        """Concatenated element runs ``(start, count)`` of a contiguous tensor."""
        out = torch.empty(sum(n for _, n in runs), dtype=ref.dtype)
        pos = 0
        for start, n in runs:
            self.read_into(ref, start, out[pos:pos + n])
            pos += n
        return out

    def load(self, ref: TensorRef) -> torch.Tensor:
        return self.read_elements(ref, 0, ref.numel).view(ref.shape) if ref.numel else \
            torch.empty(ref.shape, dtype=ref.dtype)

    def materialize(self, tree: Any) -> Any:
        """The object tree with every TensorRef read into a real tensor."""
        try:
            return self._materialize(tree)
        except RecursionError:
            raise BadCheckpoint("the pickled object tree is nested too deeply", path=self.source) from None

    def _materialize(self, tree: Any) -> Any:
        if isinstance(tree, TensorRef):
            return self.load(tree)
        if isinstance(tree, dict):
            return type(tree)((k, self._materialize(v)) for k, v in tree.items()) \
                if not isinstance(tree, collections.OrderedDict) else \
                collections.OrderedDict((k, self._materialize(v)) for k, v in tree.items())
        if isinstance(tree, list):
            return [self._materialize(v) for v in tree]
        if isinstance(tree, tuple):
            return tuple(self._materialize(v) for v in tree)
        return tree


class _Recording:
    """A range-read function that notes every range it serves."""

    def __init__(self, read: Callable[[int, int], bytes]):
        self._read, self.ranges = read, []

    def __call__(self, start: int, end: int) -> bytes:
        self.ranges.append((start, end))
        return self._read(start, end)


class _Layout:
    """What one opened archive's parse read, and what it found. The ranges it read are kept
    as few reads: ranges less than ``GAP`` apart are read as one, the bytes between them and
    the CRC fields zeroed on both sides of the comparison."""

    __slots__ = ("archive", "ranges")

    GAP = 512

    def __init__(self, archive: TorchFile, ranges: list[tuple[int, int]], read):
        merged: list[list] = []  # [start, end, [(offset, length) to zero]]
        for start, end in sorted(r for r in ranges if r[1] > r[0]):
            if merged and start <= merged[-1][1] + self.GAP:
                last = merged[-1]
                if start > last[1]:
                    last[2].append((last[1] - last[0], start - last[1]))
                last[1] = max(last[1], end)
            else:
                merged.append([start, end, []])
        self.archive = archive
        self.ranges = []
        for start, end, masks in merged:
            masks += [(c - start, 4) for c in archive._crc_fields if start <= c and c + 4 <= end]
            masks = tuple((at, bytes(n)) for at, n in masks)
            self.ranges.append((start, end, masks, _zeroed(read(start, end), masks)))

    def matches(self, read) -> bool:
        for start, end, masks, expect in self.ranges:
            data = read(start, end)
            if len(data) != end - start or _zeroed(data, masks) != expect:
                return False
        return True


def _zeroed(data: bytes, masks: tuple[tuple[int, bytes], ...]) -> bytes:
    """``data`` with each ``(offset, zeros)`` of ``masks`` written over it."""
    if not masks:
        return data
    out = bytearray(data)
    for at, zeros in masks:
        out[at:at + len(zeros)] = zeros
    return out


class ArchiveLayouts:
    """Opens many small ``torch.save`` archives that share a layout, as DCP writes one per
    chunk (874k in a 405B checkpoint), at the cost of a byte comparison each.

    Opening an archive (:class:`TorchFile`) is a deterministic function of its size and of
    the bytes it reads: the zip's end records, its central directory, each record's local
    header, the pickle and the byteorder; never a tensor's bytes. The CRC-32 fields it reads
    along with the headers it never uses (as torch, with its CRC check off; the manifest's
    xxh3 covers integrity). So an archive of the same size whose bytes equal an opened one's
    on every range that parse read, CRC fields set aside, opens exactly as that one did: the
    same checks pass, the same object, storages and offsets, the same unsafe globals. Such an
    archive is then not parsed again; any other is opened in full (and becomes a layout).
    """

    PER_SIZE = 8
    """Layouts kept per archive size: a file of all-different archives costs at most this
    many failed comparisons (each usually decided by its first bytes) per archive."""
    SIZES = 512
    """Archive sizes kept (the least recently opened go first): a checkpoint whose every chunk
    has a size of its own keeps a few MB of layouts, not one per chunk."""
    MOST = 64 << 10
    """Bytes a layout may keep (what its parse read): a tensor's archive reads ~1 KiB; one
    with a large pickle is opened in full each time rather than kept."""

    def __init__(self):
        self._by_size: collections.OrderedDict[int, list[_Layout]] = collections.OrderedDict()

    def open(self, read: Callable[[int, int], bytes], size: int, source: str) -> TorchFile:
        known = self._by_size.get(size)
        if known is not None:
            try:
                self._by_size.move_to_end(size)
            except KeyError:  # another worker's open dropped it meanwhile
                pass
        for layout in tuple(known or ()):
            if layout.matches(read):
                return layout.archive._like(read, source)
        recording = _Recording(read)
        archive = TorchFile(recording, size, source)
        archive._read = read
        if sum(max(0, end - start) for start, end in recording.ranges) > self.MOST:
            return archive
        if known is None:
            known = self._by_size[size] = []
            while len(self._by_size) > self.SIZES:
                self._by_size.popitem(last=False)
        if len(known) >= self.PER_SIZE:
            known.pop(0)
        known.append(_Layout(archive, recording.ranges, read))
        return archive


class _RangeFile(io.RawIOBase):
    """A seekable read-only file over a range-read function (for zipfile's directory scan)."""

    def __init__(self, read, size):
        self._read, self._size, self._pos = read, size, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def seek(self, pos, whence=0):
        self._pos = pos if whence == 0 else self._pos + pos if whence == 1 else self._size + pos
        return self._pos

    def tell(self):
        return self._pos

    def read(self, n=-1):
        end = self._size if n is None or n < 0 else min(self._size, self._pos + n)
        data = self._read(self._pos, end) if end > self._pos else b""
        self._pos += len(data)
        return data

    def readinto(self, b):
        data = self.read(len(b))
        b[:len(data)] = data
        return len(data)


# ------------------------------------------------------------------------------ writing


@dataclass(frozen=True, slots=True)
class Pending:
    """A tensor to be produced while the archive is written (shape and dtype known now)."""

    key: Any
    shape: tuple[int, ...]
    dtype: torch.dtype


class _Slot:
    __slots__ = ("index", "dtype", "numel", "source")

    def __init__(self, index, dtype, numel, source):
        self.index, self.dtype, self.numel, self.source = index, dtype, numel, source


class _Pickler(pickle._Pickler):  # the pure-Python pickler: it lets us write GLOBALs ourselves
    def __init__(self, file, slots):
        super().__init__(file, protocol=2)
        self._slots = slots

    def _slot(self, dtype, numel, source):
        slot = _Slot(len(self._slots), dtype, numel, source)
        self._slots.append(slot)
        return slot

    def reducer_override(self, obj):
        if isinstance(obj, (Pending, torch.Tensor)):
            shape = tuple(obj.shape)
            strides, acc = [], 1
            for n in reversed(shape):
                strides.append(acc)
                acc *= n
            slot = self._slot(obj.dtype, math.prod(shape), obj)
            return (_GLOBAL_REBUILD, (slot, 0, torch.Size(shape), tuple(reversed(strides)), False,
                                      collections.OrderedDict()))
        if isinstance(obj, Record):  # built by NEWOBJ (cls.__new__) or by calling cls
            refuse_unsafe(obj)
            func, args = ((_NEWOBJ, (type(obj), *obj._args)) if obj._via_new
                          else (_Global(obj._module, obj._name), obj._args))
            return (func, args, obj._state, iter(obj._list) if obj._list else None,
                    iter(obj._items.items()) if obj._items else None)
        if isinstance(obj, type) and issubclass(obj, Record):
            return NotImplemented
        return NotImplemented

    def persistent_id(self, obj):
        if isinstance(obj, _Slot):
            return ("storage", _Global("torch", _storage_names()[obj.dtype]), str(obj.index), "cpu",
                    obj.numel)
        return None

    def save_global(self, obj, name=None):
        if isinstance(obj, type) and issubclass(obj, Record):  # a stand-in class as an argument
            refuse_unsafe(obj.__new__(obj))  # (copyreg.__newobj__ read back)
            obj = _Global(obj._module, obj._name)
        if isinstance(obj, _Global):
            self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
            self.memoize(obj)
            return
        super().save_global(obj, name)

    dispatch = dict(pickle._Pickler.dispatch)


class _Global:
    """A global referenced by name only (never imported)."""

    __slots__ = ("module", "name")

    def __init__(self, module, name):
        self.module, self.name = module, name

    def __call__(self, *args):  # pickle insists that a reduce function is callable
        raise TypeError(f"{self.module}.{self.name} is a name only")


_Pickler.dispatch[_Global] = lambda self, obj: self.save_global(obj)


class _NewObj(_Global):
    __slots__ = ()
    __name__ = "__newobj__"  # pickle then writes the NEWOBJ opcode, as the source had it


_NEWOBJ = _NewObj("copyreg", "__newobj__")
_GLOBAL_REBUILD = _Global("torch._utils", "_rebuild_tensor_v2")


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy."""
    flat = tensor.reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


class _ZipWriter:
    """The uncompressed zip that ``torch.load`` reads: 64-byte aligned records, sizes known
    up front (no data descriptors), zip64 where sizes or offsets need it. CRCs are left 0,
    as torch does with its CRC option off; the manifest's xxh3 covers integrity."""

    ALIGN = 64

    def __init__(self, write: Callable[[Any], Any], archive: str = "archive", force_zip64: bool = False):
        self._write, self._archive, self._zip64 = write, archive, force_zip64
        self._pos = 0
        self._entries: list[tuple[bytes, int, int]] = []

    def _emit(self, data) -> None:
        self._write(data)
        self._pos += memoryview(data).nbytes

    def structure_id(self) -> bytes:
        """torch.save writes a random ``serialization_id``; ours is derived from the records
        (names, sizes, offsets), so that writing the same data twice gives the same bytes
        (a resumed or distributed reshard equals a single uninterrupted one)."""

        return str(xxhash.xxh3_128_intdigest(repr(self._entries).encode())).encode()

    def record(self, name: str, data) -> None:
        data = memoryview(data) if not isinstance(data, memoryview) else data
        self.start(name, data.nbytes)
        self._write(data)

    def start(self, name: str, size: int) -> None:
        """Write the header of a record of ``size`` bytes; the caller then writes exactly
        those bytes to the stream (they are counted here)."""
        fname = f"{self._archive}/{name}".encode()
        offset = self._pos
        big = self._zip64 or size >= 0xFFFFFFFF
        extra = struct.pack("<HHQQ", 1, 16, size, size) if big else b""
        pad = (-(offset + 30 + len(fname) + len(extra) + 4)) % self.ALIGN
        extra += struct.pack("<HH", 0x4246, pad) + b"Z" * pad
        header = struct.pack("<IHHHHHIIIHH", 0x04034B50, 45 if big else 20, 0x800, 0, 0, 0x21, 0,
                             0xFFFFFFFF if big else size, 0xFFFFFFFF if big else size,
                             len(fname), len(extra))
        self._emit(header + fname + extra)
        self._entries.append((fname, size, offset))
        self._pos += size

    def finish(self) -> None:
        cd_start = self._pos
        for fname, size, offset in self._entries:
            fields = []
            if self._zip64 or size >= 0xFFFFFFFF:
                fields += [size, size]
            if self._zip64 or offset >= 0xFFFFFFFF:
                fields.append(offset)
            extra = struct.pack("<HH", 1, 8 * len(fields)) + struct.pack(f"<{len(fields)}Q", *fields) \
                if fields else b""
            big_size = self._zip64 or size >= 0xFFFFFFFF
            self._emit(struct.pack(
                "<IHHHHHHIIIHHHHHII", 0x02014B50, 45, 45 if fields else 20, 0x800, 0, 0, 0x21, 0,
                0xFFFFFFFF if big_size else size, 0xFFFFFFFF if big_size else size, len(fname),
                len(extra), 0, 0, 0, 0, 0xFFFFFFFF if (self._zip64 or offset >= 0xFFFFFFFF) else offset)
                + fname + extra)
        cd_size = self._pos - cd_start
        n = len(self._entries)
        if self._zip64 or cd_start >= 0xFFFFFFFF or n >= 0xFFFF:
            eocd64 = self._pos
            self._emit(struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, n, n, cd_size, cd_start))
            self._emit(struct.pack("<IIQI", 0x07064B50, 0, eocd64, 1))
            self._emit(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF,
                                   0xFFFFFFFF, 0))
        else:
            self._emit(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, n, n, cd_size, cd_start, 0))


class _Coalesced:
    """A ``write`` that joins the archive's small pieces (headers, small records) into one
    call; a large piece (tensor bytes) flushes them and goes through as it is."""

    __slots__ = ("_write", "_parts", "_size")
    LIMIT = 1 << 16

    def __init__(self, write):
        self._write, self._parts, self._size = write, [], 0

    def __call__(self, data) -> None:
        n = memoryview(data).nbytes
        if n >= self.LIMIT:
            self.flush()
            self._write(data)
            return
        self._parts.append(bytes(data))
        self._size += n
        if self._size >= self.LIMIT:
            self.flush()

    def flush(self) -> None:
        if self._parts:
            self._write(b"".join(self._parts))
            self._parts, self._size = [], 0


_TENSOR_PICKLES: dict[tuple, bytes] = {}
"""(dtype, shape) -> the pickle of one plain tensor of storage 0: it depends on nothing else."""


def _tensor_pickle(tensor: torch.Tensor) -> bytes:
    key = (tensor.dtype, tuple(tensor.shape))
    data = _TENSOR_PICKLES.get(key)
    if data is None:
        buf = io.BytesIO()
        _Pickler(buf, []).dump(tensor)
        data = buf.getvalue()
        if len(_TENSOR_PICKLES) < 65536:
            _TENSOR_PICKLES[key] = data
    return data


def save(obj: Any, stream: BinaryIO, produce: Callable[[Pending], torch.Tensor] | None = None,
         *, force_zip64: bool = False) -> None:
    """Write ``obj`` as a torch.save archive to ``stream``, producing Pending tensors on demand.

    ``torch.load`` reads the result. Memory: the pickle plus one tensor at a time; tensor
    bytes go to ``stream.write`` straight from the tensor's memory.
    """
    if type(obj) is torch.Tensor:  # one plain tensor (each DCP chunk): its pickle is known
        slots, data = [_Slot(0, obj.dtype, obj.numel(), obj)], _tensor_pickle(obj)
    else:
        slots = []
        buf = io.BytesIO()
        _Pickler(buf, slots).dump(obj)
        data = buf.getvalue()
    out = _Coalesced(stream.write)
    zf = _ZipWriter(out, force_zip64=force_zip64)
    zf.record("data.pkl", data)
    zf.record(".format_version", b"1")
    zf.record(".storage_alignment", b"64")
    zf.record("byteorder", sys.byteorder.encode())
    for slot in slots:
        src = slot.source
        tensor = produce(src) if isinstance(src, Pending) else src
        if hasattr(tensor, "write_to"):  # the engine's FileSpans: bytes streamed from the source
            if tensor.dtype != slot.dtype or tensor.numel != slot.numel:
                raise ValueError(f"produced spans for {getattr(src, 'key', '?')!r} are "
                                 f"{tensor.dtype} x{tensor.numel}, expected {slot.dtype} x{slot.numel}")
            zf.start(f"data/{slot.index}", tensor.numel * tensor.dtype.itemsize)
            out.flush()
            tensor.write_to(stream)
            continue
        tensor = tensor.detach().to("cpu").contiguous()
        if tensor.dtype != slot.dtype or tensor.numel() != slot.numel:
            raise ValueError(f"produced tensor for {getattr(src, 'key', '?')!r} is "
                             f"{tensor.dtype} x{tensor.numel()}, expected {slot.dtype} x{slot.numel}")
        zf.record(f"data/{slot.index}", tensor_bytes(tensor))
        del tensor
    zf.record("version", b"3\n")
    zf.record(".data/serialization_id", zf.structure_id())
    zf.finish()
    out.flush()
