"""Loading pickles from checkpoints without executing them.

A pickle can run any code, and checkpoints come from other people's jobs. Every ``.pt``
file goes through ``torch.load(weights_only=True)`` with an explicit allowlist, and DCP's
``.metadata`` through a restricted unpickler that admits only DCP's own metadata classes.
``trust_pickle(True)`` (the CLI's ``--trust-pickle``) is the only way past it.

A class outside the allowlist is never imported: the load fails with
:class:`~ckptool.core.errors.UnsafePickle`, which names the class, or, for non-tensor
objects that are only carried along, the bytes are kept opaque (:class:`Opaque`).
"""

from __future__ import annotations

import argparse
import io
import pickle
import posixpath
import re
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

from ckptool.core.errors import BadCheckpoint, UnsafePickle

_TRUST = False

TRUST_HINT = "Pass --trust-pickle only if you trust whoever wrote this file"


def trust_pickle(value: bool) -> None:
    """Allow full unpickling (arbitrary code) for this process. Off by default."""
    global _TRUST
    _TRUST = bool(value)


@dataclass(frozen=True, slots=True)
class Opaque:
    """A pickled object whose classes are not on the allowlist, kept as raw bytes."""

    data: bytes
    reason: str

    def __repr__(self) -> str:
        return f"<opaque pickle, {len(self.data)} bytes: {self.reason}>"


class _Record:
    """Stand-in for a DCP metadata class: holds the pickled state as attributes.

    DCP's own classes are never imported or run to read ``.metadata`` (importing
    torch.distributed.checkpoint alone costs a second of start-up).
    """

    def __init__(self, *args):
        self._args = args

    def __setstate__(self, state):
        if isinstance(state, dict):
            self.__dict__.update(state)
        elif isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
            self.__dict__.update(state[1])  # (dict state, slots state)
            if isinstance(state[0], dict):
                self.__dict__.update(state[0])
        else:
            self._state = state

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return None  # optional fields absent from older versions

    def __hash__(self):
        return hash((type(self).__name__, tuple(sorted((k, _hashable(v)) for k, v in self.__dict__.items()))))

    def __eq__(self, other):
        return type(self) is type(other) and self.__dict__ == other.__dict__


def _hashable(value):
    return tuple(value) if isinstance(value, list) else value


class _TensorProperties(_Record):
    """DCP pickles TensorProperties as a tuple: (dtype, layout, requires_grad, memfmt, pin)."""

    def __setstate__(self, state):
        if isinstance(state, tuple):
            self.dtype = state[0]
        else:
            super().__setstate__(state)


def _path(*parts) -> str:
    """pathlib paths pickle as their parts; keep them as a plain string."""
    return posixpath.join(*map(str, parts)) if parts else ""


_DCP_STANDINS: dict[tuple[str, str], type] = {
    ("torch.distributed.checkpoint.metadata", "TensorProperties"): _TensorProperties,
    **{("torch.distributed.checkpoint.metadata", name): type(name, (_Record,), {})
       for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                    "ChunkStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")},
    **{("torch.distributed.checkpoint.filesystem", name): type(name, (_Record,), {})
       for name in ("_StorageInfo", "_StoragePrefix")},
    **{("torch.distributed.checkpoint.planner", name): type(name, (_Record,), {})
       for name in ("WriteItemType", "LoadItemType")},
}
_RECORD_MODULES = ("torch.distributed.checkpoint.", "megatron.core.dist_checkpointing.")
_PLAIN = {
    ("torch", "Size"): tuple,
    ("torch.serialization", "_get_layout"): str,
    ("collections", "OrderedDict"): dict,
    ("pathlib", "PosixPath"): _path,
    ("pathlib", "PurePosixPath"): _path,
    ("pathlib", "WindowsPath"): _path,
    ("pathlib", "PureWindowsPath"): _path,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
}


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, file: BinaryIO, source: str):
        super().__init__(file)
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        found = _DCP_STANDINS.get((module, name)) or _PLAIN.get((module, name))
        if found is not None:
            return found
        if module.startswith(_RECORD_MODULES):
            # Planner data of DCP and of Megatron-Core's DCP strategy: plain data classes,
            # rebuilt as inert records (their code is never imported).
            return _DCP_STANDINS.setdefault((module, name), type(name, (_Record,), {}))
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                          torch.memory_format)):
            return getattr(torch, name)
        raise UnsafePickle(f"refusing to unpickle {module}.{name}: it is not on the allowlist",
                           path=self._source, hint=TRUST_HINT)


def load_dcp_metadata(data: bytes, source: str) -> Any:
    """Unpickle a DCP ``.metadata`` into plain stand-in records; nothing else is admitted.

    Records keep DCP's attribute names (``state_dict_metadata``, ``storage_data``,
    ``chunks``, ``offsets``...), so readers use them as DCP documents them.
    """
    return _RestrictedUnpickler(io.BytesIO(data), source).load()


# torch.load(weights_only=True) already admits tensors, dtypes and containers. What real
# checkpoints add: Megatron's args Namespace and numpy RNG state.
def _extra_safe_globals() -> list:
    extra: list[Any] = [argparse.Namespace]
    try:
        import numpy as np

        core = getattr(np, "_core", None) or np.core
        extra += [core.multiarray._reconstruct, np.ndarray, np.dtype]
        extra += [type(np.dtype(t)) for t in ("uint32", "int64", "float32", "float64", "bool")]
        extra += [np.dtypes.UInt32DType] if hasattr(np, "dtypes") else []
    except Exception:  # numpy missing or very old: its RNG states then stay opaque
        pass
    return extra


_SAFE_GLOBALS = _extra_safe_globals()
_BLOCKED = re.compile(r"GLOBAL ([\w.]+)")


def torch_load(data: bytes | BinaryIO, source: str, *, mmap: bool = False) -> Any:
    """``torch.load`` on CPU with the allowlist.

    Raises UnsafePickle naming the class when a global is not allowlisted, and
    BadCheckpoint when the bytes are not a readable archive.
    """
    stream = io.BytesIO(data) if isinstance(data, (bytes, bytearray, memoryview)) else data
    try:
        with torch.serialization.safe_globals(_SAFE_GLOBALS):
            return torch.load(stream, map_location="cpu", weights_only=not _TRUST, mmap=mmap or None)
    except pickle.UnpicklingError as exc:
        found = _BLOCKED.search(str(exc))
        if found is None:
            raise BadCheckpoint(f"cannot be read: damaged pickle ({_first_line(exc)})",
                                path=source) from None
        raise UnsafePickle(f"refusing to unpickle {found.group(1)}: it is not on the allowlist",
                           path=source, hint=TRUST_HINT) from None
    except (RuntimeError, EOFError, ValueError, KeyError, IndexError, TypeError,
            UnicodeDecodeError) as exc:
        raise BadCheckpoint(f"cannot be read: damaged archive ({_first_line(exc)})",
                            path=source) from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:160] if text else type(exc).__name__


def torch_load_or_opaque(data: bytes, source: str) -> Any:
    """Like :func:`torch_load`, but an object outside the allowlist comes back as Opaque."""
    try:
        return torch_load(data, source)
    except UnsafePickle as exc:
        return Opaque(bytes(data), exc.message)
