"""Reading pickles from checkpoints without running them: one unpickler, one allowlist.

A pickle can run any code, and checkpoints come from other people's jobs. Every pickle
ckptool reads (``torch.save`` archives: Megatron and DeepSpeed files, DCP chunks and
non-tensor entries; DCP's ``.metadata``) goes through :class:`Unpickler`, whose
``find_class`` admits only :data:`ALLOWLIST`:

* plain data constructors that run no code of consequence (``OrderedDict``,
  ``argparse.Namespace``, numpy's array rebuild, torch dtypes and ``Size``...);
* known data classes of the peers (DCP's metadata, Megatron's enums, DeepSpeed's loss
  scaler and fragment addresses), rebuilt as inert :class:`Record`\\ s: their code is never
  imported, and they are pickled back under their own names, so what ckptool carries
  survives unchanged.

Any other global is never imported: it becomes an :class:`Unsafe` marker, and the
unpickler lists it. Commands then refuse the file, naming the file, the entry and the
global (``verify`` reports it, ``inspect`` warns), and no writer ever writes a marker
(:func:`refuse_unsafe`), so a hostile pickle is never copied into an output.
``trust_pickle(True)`` (the CLI's ``--trust-pickle``) is the only way past it: the
pickle is then really loaded (its code runs) and re-pickled from the loaded objects.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import copyreg
import functools
import io
import os
import pickle
import posixpath
import sys
import threading
import types
from dataclasses import dataclass
from typing import Any, BinaryIO, Iterator

from ckptool.core import progress
from ckptool.core.errors import BadCheckpoint, UnsafePickle

_TRUST = False

TRUST_HINT = "ckptool does not unpickle it; pass --trust-pickle only if you trust whoever wrote the file"


def trust_pickle(value: bool) -> None:
    """Allow full unpickling (arbitrary code) for this process. Off by default."""
    global _TRUST
    _TRUST = bool(value)


def trusted() -> bool:
    return _TRUST


# ------------------------------------------------------------------------ stand-ins


class Record:
    """An instance of an allowlisted class, rebuilt inert: its global name, the arguments it
    was built with and its state (never the class itself, whose code is not imported).

    Attributes of the pickled state read as attributes (``meta.storage_data``); an absent
    one reads as None (optional fields of older versions). The writer pickles a record
    back under its original name with the same arguments and state.
    """

    _module = "?"
    _name = "?"
    unsafe = False
    # Defaults an instance overrides only when it has them (a DCP .metadata holds several
    # records per chunk: each costs one object and its fields, nothing more).
    _args: tuple = ()
    _state = None
    _via_new = True
    _items: dict | None = None
    """A dict subclass's items (None: none)."""
    _list: list | None = None
    """A list subclass's items (None: none)."""

    def __new__(cls, *args):
        obj = object.__new__(cls)
        if args:
            obj.__dict__["_args"] = args
        return obj

    def __init__(self, *args):
        d = self.__dict__
        d["_args"], d["_via_new"] = args, False

    def __setstate__(self, state):
        d = self.__dict__
        d["_state"] = state
        if "_hash" in d:
            del d["_hash"]
        # the fields as plain attributes: read without __getattr__ (a DCP .metadata holds a
        # record per chunk); names the class itself uses (unsafe, fields...) stay the class's
        fields = state if type(state) is dict else self.fields()
        names = tuple(fields)
        safe = _SAFE_FIELDS.get(type(self))
        if safe is None:
            safe = _SAFE_FIELDS[type(self)] = set()
        if names in safe:  # the same field names as a record of this class before: all plain
            d.update(fields)
            return
        reserved = _RESERVED
        plain = True
        for k, v in fields.items():
            if type(k) is str and k[:1] != "_" and k not in reserved:
                d[k] = v
            else:
                plain = False
        if plain and len(safe) < 64:
            safe.add(names)

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return self.fields().get(name)

    def fields(self) -> dict:
        """The pickled state as a dict (a ``(dict, slots)`` pair merged)."""
        state = self.__dict__.get("_state")
        if isinstance(state, dict):
            return state
        if isinstance(state, tuple) and len(state) == 2:
            return {**(state[0] or {}), **(state[1] or {})} if all(
                s is None or isinstance(s, dict) for s in state) else {}
        return {}

    def __deepcopy__(self, memo):  # copy's default would feed our fields to __setstate__

        new = object.__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new

    def __setitem__(self, key, value):  # dict subclasses
        d = self.__dict__
        d.pop("_hash", None)
        d.setdefault("_items", {})[key] = value

    def append(self, value):  # list subclasses
        d = self.__dict__
        d.pop("_hash", None)
        d.setdefault("_list", []).append(value)

    def extend(self, values):
        d = self.__dict__
        d.pop("_hash", None)
        d.setdefault("_list", []).extend(values)

    @property
    def qualified_name(self) -> str:
        return f"{self._module}.{self._name}"

    def _key(self):
        return (self.qualified_name, self._args, self._state, self._items, self._list)

    def __repr__(self) -> str:
        return f"<{'refused' if self.unsafe else 'record'} {self.qualified_name}{self._args!r}>"

    def __eq__(self, other):
        return isinstance(other, Record) and self._key() == other._key()

    def __hash__(self):  # DCP's MetadataIndex is a dict key; hashed once (until changed)
        d = self.__dict__
        h = d.get("_hash")
        if h is None:
            h = d["_hash"] = hash((self._module, self._name, _frozen(self._args), _frozen(self._state),
                                   _frozen(self._items), _frozen(self._list)))
        return h


_SAFE_FIELDS: dict[type, set[tuple]] = {}
"""Per stand-in class, the field-name tuples seen whose every name reads as an attribute."""

_RESERVED = frozenset(dir(Record))
"""Attribute names of the stand-ins themselves, never shadowed by a pickled field."""


class Unsafe(Record):
    """What stands where a pickle names a global outside the allowlist: inert, listed by
    the unpickler, and never written (:func:`refuse_unsafe`)."""

    unsafe = True


_PLAIN_TYPES = (str, int, float, bool, type(None), bytes)


def _frozen(value):
    """A hashable value equal for equal ``value``s (what a record's hash is taken of)."""
    if type(value) in _PLAIN_TYPES:
        return value
    if isinstance(value, dict):
        if all(type(k) is str for k in value):  # distinct keys: the pairs sort by key alone
            return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
        return tuple(sorted(((k, _frozen(v)) for k, v in value.items()), key=repr))
    if isinstance(value, tuple):
        try:
            hash(value)  # a tuple of plain values (offsets, a torch.Size) is its own frozen form
            return value
        except TypeError:
            return tuple(_frozen(v) for v in value)
    if isinstance(value, list):
        return tuple(_frozen(v) for v in value)
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


_CLASSES: dict[tuple[str, str, bool], type] = {}


def record_class(module: str, name: str, unsafe: bool = False) -> type:
    """The inert stand-in class for global ``module.name`` (one per name)."""
    cls = _CLASSES.get((module, name, unsafe))
    if cls is None:
        base = Unsafe if unsafe else _RECORD_BASES.get((module, name), Record)
        cls = _CLASSES[(module, name, unsafe)] = type(
            name, (base,), {"_module": module, "_name": name, "__module__": "ckptool.record"})
    return cls


class _TensorProperties(Record):
    """DCP pickles TensorProperties as a tuple: (dtype, layout, requires_grad, memfmt, pin)."""

    @property
    def dtype(self):
        state = self._state
        return state[0] if isinstance(state, tuple) and state and is_dtype(state[0]) \
            else self.fields().get("dtype")


class ChunkRecord:
    """One of DCP's per-chunk records in a ``.metadata`` (``MetadataIndex``,
    ``ChunkStorageMetadata``, ``_StorageInfo``), as lean as the C unpickler can build it: no
    Python ``__new__`` or ``__setstate__`` (its pickled fields become instance attributes in
    C), an identity hash (``storage_data`` is a dict keyed by them: the reader indexes the
    items itself, and refuses two entries for one chunk). A ``.metadata`` of 2M chunks holds
    6M of these. Fields a version does not pickle read as None. Only
    :func:`load_dcp_metadata` builds them; they are read, never written back."""

    unsafe = False
    fqn = offset = index = None  # MetadataIndex
    offsets = sizes = None  # ChunkStorageMetadata
    relative_path = length = transform_descriptors = None  # _StorageInfo


_CHUNK_RECORDS = {
    (module, name): type(name, (ChunkRecord,), {"__module__": "ckptool.record", "_module": module})
    for module, name in (("torch.distributed.checkpoint.metadata", "MetadataIndex"),
                         ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
                         ("torch.distributed.checkpoint.filesystem", "_StorageInfo"))}


_RECORD_BASES = {("torch.distributed.checkpoint.metadata", "TensorProperties"): _TensorProperties}


# ------------------------------------------------------------------------ the allowlist


# torch's own names. Without torch imported (the light paths: `ckptool latest`, `verify`),
# they stand as TorchName records: a DCP .metadata is then read, checked and never written.


def _torch():
    return sys.modules.get("torch")


class TorchName:
    """``torch.<name>`` (a dtype, layout or memory format) read while torch is not imported."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"torch.{self.name}"

    def __eq__(self, other) -> bool:
        return isinstance(other, TorchName) and other.name == self.name

    def __hash__(self) -> int:
        return hash(("torch", self.name))

    @property
    def itemsize(self) -> int:
        """Bytes per element of a dtype name (as ``torch.dtype.itemsize``)."""
        return _itemsize(self.name)


@functools.lru_cache(maxsize=256)
def _itemsize(name: str) -> int:
    if name in _ITEMSIZE:
        return _ITEMSIZE[name]
    digits = "".join(c for c in name.split("_")[0] if c.isdigit())
    if not digits:
        raise ValueError(f"torch.{name} is not a dtype")
    return int(digits) // 8


_ITEMSIZE = {"float": 4, "double": 8, "half": 2, "short": 2, "int": 4, "long": 8, "bool": 1,
             "cfloat": 8, "cdouble": 16, "complex32": 4, "complex64": 8, "complex128": 16,
             "qint8": 1, "quint8": 1, "qint32": 4, "quint4x2": 1}


_TORCH_DTYPES = frozenset({
    "float32", "float", "float64", "double", "float16", "half", "bfloat16", "complex32", "complex64",
    "complex128", "cfloat", "cdouble", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "short",
    "int32", "int", "int64", "long", "bool", "qint8", "quint8", "qint32", "quint4x2",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu"})
_TORCH_CONSTANTS = _TORCH_DTYPES | {
    "strided", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc", "_mkldnn",
    "contiguous_format", "preserve_format", "channels_last", "channels_last_3d"}


def _torch_constant(name: str):
    torch = _torch()
    if torch is not None:
        value = getattr(torch, name, None)
        return value if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)) else None
    return TorchName(name) if name in _TORCH_CONSTANTS else None


def is_dtype(value) -> bool:
    """A dtype as the unpickler gives it: ``torch.dtype``, or :class:`TorchName` without torch."""
    torch = _torch()
    if torch is None:  # a layout or memory format named where a dtype belongs is none
        return isinstance(value, TorchName) and value.name in _TORCH_DTYPES
    return isinstance(value, torch.dtype)


def dtype_named(name: str):
    """``torch.<name>`` as the unpickler gives dtypes: the dtype once torch is imported, else a
    :class:`TorchName`."""
    torch = _torch()
    return getattr(torch, name) if torch is not None else TorchName(name)


_DTYPE_ALIASES = {"float": "float32", "double": "float64", "half": "float16", "short": "int16",
                  "int": "int32", "long": "int64", "cfloat": "complex64", "cdouble": "complex128"}


def dtype_name(dtype) -> str:
    """The canonical name of a dtype in either form (``float32`` for ``torch.float``)."""
    name = str(dtype).removeprefix("torch.")
    return _DTYPE_ALIASES.get(name, name)


def as_torch(dtype):
    """A dtype read as a :class:`TorchName` is torch's own once torch is imported (the archive
    was opened before, by a light command that went on to read tensors)."""
    if isinstance(dtype, TorchName):
        torch = _torch()
        if torch is not None:
            return getattr(torch, dtype.name)
    return dtype


def same_dtype(a, b) -> bool:
    """Whether two dtypes are the same, whichever form each was read in (torch may have been
    imported between reading one and the other)."""
    return a == b or (is_dtype(a) or isinstance(a, TorchName)) and dtype_name(a) == dtype_name(b)


def _torch_size(*args):
    torch = _torch()
    return torch.Size(*args) if torch is not None else tuple(*args)


def _torch_device(*args):
    torch = _torch()
    return torch.device(*args) if torch is not None else ":".join(map(str, args))


def _path(*parts) -> str:
    """pathlib paths pickle as their parts; keep them as a plain string."""
    return posixpath.join(*map(str, parts)) if parts else ""


def _codecs_encode(text, encoding="latin1"):
    return text.encode(encoding)


def _bytearray(*args):
    """``bytearray`` of pickled bytes; never ``bytearray(n)``, which would allocate n bytes
    that no file holds."""
    if args and not isinstance(args[0], (bytes, bytearray, str)):
        raise pickle.UnpicklingError("bytearray of a size, not of bytes")
    return bytearray(*args)


def _plain() -> dict[tuple[str, str], Any]:
    """Constructors of plain data that run no code of consequence."""
    plain: dict[tuple[str, str], Any] = {
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("argparse", "Namespace"): argparse.Namespace,
        ("types", "SimpleNamespace"): types.SimpleNamespace,
        ("builtins", "set"): set,
        ("builtins", "frozenset"): frozenset,
        ("builtins", "bytearray"): _bytearray,
        ("builtins", "slice"): slice,
        ("builtins", "complex"): complex,
        ("_codecs", "encode"): _codecs_encode,
        ("torch", "Size"): _torch_size,
        ("torch", "device"): _torch_device,
        ("torch.serialization", "_get_layout"): str,
        **{("pathlib", name): _path for name in
           ("Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")},
    }
    return plain


_NUMPY: dict[tuple[str, str], Any] = {}


def _numpy_plain() -> dict[tuple[str, str], Any]:
    """numpy's array and dtype constructors (its RNG states), imported when a pickle first
    names numpy: most pickles never do, and the light commands should not pay for numpy."""
    if _NUMPY:
        return _NUMPY
    plain: dict[tuple[str, str], Any] = {("", ""): None}  # looked once
    try:
        import numpy as np  # optional (its RNG states are refused without it)
    except ImportError:  # numpy's RNG states then stay refused
        _NUMPY.update(plain)
        return _NUMPY
    core = getattr(np, "_core", None) or np.core
    for mod in ("numpy._core.multiarray", "numpy.core.multiarray"):
        plain[(mod, "_reconstruct")] = core.multiarray._reconstruct
        plain[(mod, "scalar")] = core.multiarray.scalar
    plain[("numpy", "ndarray")] = np.ndarray
    plain[("numpy", "dtype")] = np.dtype
    for name in dir(getattr(np, "dtypes", ())):
        if name.endswith("DType"):
            plain[("numpy.dtypes", name)] = getattr(np.dtypes, name)
    _NUMPY.update(plain)  # whole at once: another thread never sees a part
    return _NUMPY


_PLAIN = _plain()

_RECORDS = frozenset({
    # torch DCP's metadata (.metadata; Megatron-Core's torch_dist too)
    *(("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "MetadataIndex", "StorageMeta", "TensorProperties", "_MEM_FORMAT_ENCODING")),
    *(("torch.distributed.checkpoint.filesystem", n) for n in ("_StorageInfo", "_StoragePrefix")),
    *(("torch.distributed.checkpoint.planner", n) for n in (
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "LoadItemType", "ReadItem")),
    # Megatron-Core's torch_dist planner data (older versions' classes too)
    *(("megatron.core.dist_checkpointing.strategies.torch", n) for n in (
        "MCoreSavePlan", "MCoreMetadata")),
    # DeepSpeed's ZeRO files
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
    ("deepspeed.utils.tensor_fragment", "fragment_address"),
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
    # Megatron's args: enums
    ("megatron.core.enums", "ModelType"),
    ("megatron.core.transformer.enums", "AttnBackend"),
    ("megatron.core.transformer.enums", "AttnMaskType"),
    ("megatron.core.transformer.enums", "AttnType"),
    ("megatron.core.transformer.enums", "LayerType"),
    ("megatron.core.enums", "Fp8Recipe"),
    ("megatron.core.rerun_state_machine", "RerunMode"),
    ("megatron.model.enums", "AttnMaskType"),  # Megatron-DeepSpeed
    ("megatron.model.enums", "AttnType"),
    ("megatron.model.enums", "LayerType"),
    ("megatron.model.enums", "PositionEmbeddingType"),
})
"""Known data classes of the peers, rebuilt as inert records. Only names whose
construction and state are plain data belong here."""

ALLOWLIST = frozenset(_PLAIN) | _RECORDS
"""Every global a pickle may name (plus numpy's array and dtype constructors, looked up
when a pickle names numpy, and torch's dtypes, layouts, memory formats, storage types and
tensor rebuild functions, which the unpickler handles itself)."""


class Unpickler(pickle.Unpickler):
    """The one unpickler: admits :data:`ALLOWLIST`, turns any other global into an
    :class:`Unsafe` marker and lists it in ``refused`` (or, when pickles are trusted,
    imports it). Subclasses add what their container needs (tensors, storages)."""

    def __init__(self, file: BinaryIO):
        super().__init__(file)
        self.refused: list[str] = []

    def find_class(self, module: str, name: str) -> Any:
        found = _PLAIN.get((module, name))
        if found is None and module.startswith("numpy"):
            found = _numpy_plain().get((module, name))
        if found is not None:
            if found is _torch_size:  # resolved once per pickle, not per call
                torch = _torch()
                return torch.Size if torch is not None else tuple
            return found
        if (module, name) in _RECORDS:
            return record_class(module, name)
        if module == "torch":
            constant = _torch_constant(name)
            if constant is not None:
                return constant
        if (module, name) == ("copyreg", "__newobj__"):
            return _newobj
        if (module, name) == ("copyreg", "_reconstructor"):
            return _reconstructor
        if _TRUST:
            return super().find_class(module, name)
        self.refused.append(f"{module}.{name}")
        return record_class(module, name, unsafe=True)


class _MetadataUnpickler(Unpickler):
    """The unpickler of a DCP ``.metadata``: DCP's per-chunk classes stand as
    :class:`ChunkRecord`\\ s."""

    def find_class(self, module: str, name: str) -> Any:
        lean = _CHUNK_RECORDS.get((module, name))
        return lean if lean is not None else super().find_class(module, name)


def _newobj(cls, *args):
    """``copyreg.__newobj__``: ``cls.__new__`` of a stand-in class; anything else refused."""
    if isinstance(cls, type) and issubclass(cls, Record) or _TRUST:
        return cls.__new__(cls, *args)
    return record_class("copyreg", "__newobj__", unsafe=True)(cls, *args)


def _reconstructor(cls, base, state):
    """``copyreg._reconstructor`` (protocol 0/1 objects) of a stand-in class."""
    if isinstance(cls, type) and issubclass(cls, Record):
        return cls.__new__(cls)
    if _TRUST:
        return copyreg._reconstructor(cls, base, state)
    return record_class("copyreg", "_reconstructor", unsafe=True)(cls, base, state)


class _Counted(io.BytesIO):
    """The pickle's bytes, each frame read counted as progress."""

    def __init__(self, data: bytes, step):
        super().__init__(data)
        self._step = step

    def read(self, n: int = -1) -> bytes:
        out = super().read(n)
        self._step.advance(len(out))
        return out

    def readinto(self, b) -> int:
        n = super().readinto(b)
        self._step.advance(n)
        return n


_MEMO_PUTS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})
CHECKED_PICKLE = 256 << 10
"""Pickles up to this size (every ``torch.save`` data.pkl ckptool meets, small DCP metadata)
are walked opcode by opcode before CPython's unpickler runs them (:func:`check_opcodes`).
Larger ones (a 100B+ model's ``.metadata``: 157 MB) are not: the walk, in Python, costs three
times the parse. What bounds them is the address space (:func:`parsing`)."""

PARSE_ROOM_PER_BYTE = 32
"""Address space the parse of an unwalked pickle may add, per byte of it (at least
:data:`PARSE_ROOM_MIN`): the objects a DCP ``.metadata`` holds take about 15 bytes per byte
of pickle (4.7 GB of process for 329 MB at 512 ranks)."""
PARSE_ROOM_MIN = 1 << 30

_BOUNDED = [False]
_BOUND_LOCK = threading.Lock()


def bound_unwalked_pickles(enabled: bool) -> None:
    """Whether :func:`parsing` caps the address space (``RLIMIT_AS``) while a pickle too large
    to walk is parsed. A process limit: the command line turns it on for its command; a library
    host (a training job, whose CUDA context maps more than any cap) keeps it off."""
    _BOUNDED[0] = enabled


@contextlib.contextmanager
def parsing(data: bytes, source: str):
    """Around CPython's unpickler running ``data``: a pickle up to :data:`CHECKED_PICKLE` is
    walked first (:func:`check_opcodes`); a larger one runs under an address-space cap of what
    the process maps now plus :data:`PARSE_ROOM_PER_BYTE` per byte, where the command line set
    one (:func:`bound_unwalked_pickles`) and no other thread works (:func:`_working_threads`),
    so that a memo index or a length it claims fails as a MemoryError (which the callers report
    as damage) instead of being allocated: ``LONG_BINPUT 2**28`` makes the unpickler zero-fill
    a 4 GB memo. Large pickles parse one at a time."""
    if len(data) <= CHECKED_PICKLE:
        check_opcodes(data, source)
        yield
        return
    if not _BOUNDED[0] or _working_threads():
        yield
        return
    with _BOUND_LOCK, _address_space(max(PARSE_ROOM_MIN, PARSE_ROOM_PER_BYTE * len(data))):
        yield


def _working_threads() -> bool:
    """Whether threads other than this one may allocate meanwhile (a rewrite's workers filling
    buffers): the cap is for the whole process, so it is set only where none runs (reading a
    checkpoint's index, before any pool starts); daemon helpers (progress, fsspec's loop) do
    not count."""
    me = threading.current_thread()
    return any(t is not me and not t.daemon and t.is_alive() for t in threading.enumerate())


@contextlib.contextmanager
def _address_space(room: int):
    """``RLIMIT_AS`` at what the process maps now plus ``room`` (never above a limit already
    set), restored after; nothing where the mapping cannot be read (not Linux)."""
    try:
        import resource

        with open("/proc/self/statm") as f:
            mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (ImportError, OSError, ValueError):
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = mapped + room
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    if soft != resource.RLIM_INFINITY and soft <= cap:
        yield  # a tighter limit is set already
        return
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def check_opcodes(data: bytes, source: str) -> None:
    """Refuse what would make CPython's C unpickler allocate what the pickle claims rather
    than what it holds: a memo index ahead of the entries made so far (``LONG_BINPUT 2**28``
    resizes and zero-fills a 4 GB memo for a 5-byte opcode) and lengths past the end of the
    data. Picklers number the memo in order, so a real pickle never jumps ahead."""
    import pickletools

    made = 0
    try:
        for op, arg, _ in pickletools.genops(data):
            if op.name == "MEMOIZE":
                made += 1
            elif op.name in _MEMO_PUTS:
                if not isinstance(arg, int) or arg > made:
                    raise BadCheckpoint(f"damaged pickle: memo index {str(arg)[:20]} after {made} "
                                        "entries", path=source)
                made += arg == made
    except (ValueError, EOFError, OverflowError, UnicodeDecodeError) as exc:  # a length past the end
        raise BadCheckpoint(f"damaged pickle ({str(exc)[:120]})", path=source) from None


def load_dcp_metadata(data: bytes, source: str) -> Any:
    """Unpickle a DCP ``.metadata`` into inert records; a global outside the allowlist is
    :class:`UnsafePickle` (nothing else of the checkpoint can be read without it).

    Records keep DCP's attribute names (``state_dict_metadata``, ``storage_data``,
    ``chunks``, ``offsets``...), so readers use them as DCP documents them.
    """
    with progress.step(f"reading {posixpath.basename(source)}", len(data), "B") as step:
        unpickler = _MetadataUnpickler(_Counted(data, step))
        try:
            with parsing(data, source):
                meta = unpickler.load()
        except (pickle.UnpicklingError, EOFError, ValueError, AttributeError, ImportError,
                IndexError, TypeError, KeyError, RecursionError, MemoryError, OverflowError) as exc:
            raise BadCheckpoint(f"DCP metadata cannot be parsed ({type(exc).__name__}: "
                                f"{str(exc)[:120]})", path=source) from None
    if unpickler.refused:
        raise unsafe_error(source, None, unpickler.refused[0])
    return meta


# ------------------------------------------------------------------------ findings


@dataclass(frozen=True, slots=True)
class UnsafeFinding:
    """A pickled entry that names a global outside the allowlist."""

    file: str
    key: str | None
    """Where in the file's object tree (``rng_state.np_rng_state``), when known."""
    name: str
    """The global the pickle wanted (``posix.mkdir``)."""

    def error(self) -> UnsafePickle:
        return unsafe_error(self.file, self.key, self.name)


def unsafe_error(file: str, key: str | None, name: str) -> UnsafePickle:
    entry = f"entry {key!r} " if key else ""
    if " " in name:  # a description, not a global
        return UnsafePickle(f"{entry or 'an entry '}is {name}, which ckptool does not read",
                            path=file, hint=TRUST_HINT)
    return UnsafePickle(f"{entry}pickles a call of {name}, which is not on the allowlist",
                        path=file, hint=TRUST_HINT)


def unsafe_in(tree: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """``(path, global)`` of every :class:`Unsafe` marker in an object tree."""
    stack = [(path, tree)]
    seen: set[int] = set()
    while stack:
        where, obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, Unsafe):
            yield where, obj.qualified_name
        if isinstance(obj, dict):
            stack += [(f"{where}.{k}" if where else str(k), v) for k, v in obj.items()]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack += [(f"{where}.{i}" if where else str(i), v) for i, v in enumerate(obj)]
        elif isinstance(obj, Record):
            stack += [(where, v) for v in (obj._args, obj._state, obj._items, obj._list)]
        elif isinstance(obj, argparse.Namespace | types.SimpleNamespace):
            stack += [(f"{where}.{k}" if where else k, v) for k, v in vars(obj).items()]


def refuse_unsafe(obj: Any) -> None:
    """Raise UnsafePickle for a marker about to be written (the last line of defence: a
    hostile pickle is never copied into an output)."""
    if isinstance(obj, Unsafe):
        raise unsafe_error("the output", None, obj.qualified_name)
