"""Storage through fsspec, and atomic output.

Paths are str rather than Path because a checkpoint may live at a URL (``s3://...``,
``memory://...``) that Path would mangle. Every URL is opened through
``fsspec.core.url_to_fs`` so that fsspec's own configuration (``FSSPEC_S3_ENDPOINT_URL``
and friends, config files) applies.

Atomicity is a named object, not scattered protocol checks:

* :class:`RenameOutput` (POSIX): write into ``NAME.tmp-<id>/``, write the manifest last,
  then rename to ``NAME``. A crash leaves only a ``.tmp-`` directory, which nothing reads.
* :class:`MarkerOutput` (object stores, no atomic rename): write in place; the manifest,
  written last, is the commit marker. Readers ignore a prefix without it.
"""

from __future__ import annotations

import errno
import os
import posixpath
import re
import threading
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from ckptool.core.errors import UnreadableInput, UsageError

TMP_MARK = ".tmp-"
_TMP_RE = re.compile(r"\.tmp-[0-9a-zA-Z]+$")
_STORAGE_OPTIONS: dict[str, Any] = {}


def set_storage_options(options: dict[str, Any]) -> None:
    """Extra fsspec storage options for every URL this process opens (--storage-option)."""
    _STORAGE_OPTIONS.clear()
    _STORAGE_OPTIONS.update(options)


def is_temporary(name: str) -> bool:
    """True for the name of an uncommitted output directory or file (``X.tmp-<id>``)."""
    return bool(_TMP_RE.search(name.rstrip("/")))


@dataclass
class Store:
    """A directory on some fsspec filesystem. All paths given to methods are relative."""

    url: str
    fs: fsspec.AbstractFileSystem = field(repr=False)
    root: str = field(repr=False)
    durable: bool = field(default=True, repr=False)
    """Whether files written here are fsynced before they count as written (local files;
    object stores are durable once a PUT returns). ``False`` leaves the write-back to the
    kernel, as ``cp`` and ``torch.save`` do: faster, but a power loss or kernel crash soon
    after can leave files whose checksums fail."""

    @classmethod
    def open(cls, url: str) -> "Store":
        url = str(url)
        try:
            fs, root = fsspec.core.url_to_fs(url, **_STORAGE_OPTIONS)
        except (ImportError, ValueError) as exc:
            raise UsageError(f"cannot open {url}: {exc}") from None
        return cls(url.rstrip("/") if len(url) > 1 else url, fs, root.rstrip("/") or root)

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, LocalFileSystem)

    @property
    def name(self) -> str:
        return posixpath.basename(self.root.rstrip("/"))

    def path(self, rel: str = "") -> str:
        return posixpath.join(self.root, rel) if rel else self.root

    def child(self, rel: str) -> "Store":
        return Store(_join_url(self.url, rel), self.fs, self.path(rel), self.durable)

    def exists(self, rel: str = "") -> bool:
        return self.fs.exists(self.path(rel))

    def isdir(self, rel: str = "") -> bool:
        return self.fs.isdir(self.path(rel))

    def size(self, rel: str) -> int:
        return int(self.fs.size(self.path(rel)))

    def ls(self, rel: str = "") -> list[tuple[str, bool]]:
        """(name, is_dir) of the entries directly under ``rel``; [] when it is missing."""
        try:
            entries = self.fs.ls(self.path(rel), detail=True, refresh=True) \
                if not self.is_local else self.fs.ls(self.path(rel), detail=True)
        except FileNotFoundError:
            return []
        base = self.path(rel).rstrip("/")
        out = []
        for e in entries:
            name = e["name"].rstrip("/")
            if name == base:
                continue
            out.append((posixpath.basename(name), e["type"] == "directory"))
        return sorted(out)

    def files(self) -> dict[str, int]:
        """Every file below this store: relative path -> size."""
        found = self.fs.find(self.root, detail=True, withdirs=False)
        prefix = self.root.rstrip("/") + "/"
        return {name[len(prefix):]: int(info["size"]) for name, info in found.items()
                if name.startswith(prefix)}

    def open_file(self, rel: str, mode: str = "rb", **kwargs):
        try:
            return self.fs.open(self.path(rel), mode, **kwargs)
        except FileNotFoundError:
            raise UnreadableInput("file not found", path=_join_url(self.url, rel)) from None

    def read_bytes(self, rel: str, start: int | None = None, end: int | None = None) -> bytes:
        try:
            return self.fs.cat_file(self.path(rel), start=start, end=end)
        except FileNotFoundError:
            raise UnreadableInput("file not found", path=_join_url(self.url, rel)) from None

    def range_reader(self, rel: str) -> "RangeReader":
        """A reader of byte ranges of one file that keeps it open (pread when local)."""
        return RangeReader(self, rel)

    def write_bytes(self, rel: str, data: bytes) -> None:
        with self.fs.open(self.path(rel), "wb") as f:
            f.write(data)
            if self.durable and self.is_local:
                f.flush()
                fsync(f.fileno())

    def display(self, rel: str = "") -> str:
        return _join_url(self.url, rel) if rel else self.url


class RangeReader:
    """``reader(start, end) -> bytes`` over one file; ``size`` is known up front."""

    def __init__(self, store: Store, rel: str):
        self._fd: int | None = None  # set first: close() and __del__ run even if opening fails
        self._file = None
        self.source = store.display(rel)
        try:
            if store.is_local:
                self._fd = os.open(store.path(rel), os.O_RDONLY)
                self.size = os.fstat(self._fd).st_size
            else:
                self._file = store.fs.open(store.path(rel), "rb", block_size=8 << 20)
                self.size = int(self._file.size)
        except FileNotFoundError:
            raise UnreadableInput("file not found", path=self.source) from None
        self._lock = threading.Lock()

    def __call__(self, start: int, end: int) -> bytes:
        if self._fd is not None:
            data = os.pread(self._fd, end - start, start)
            if len(data) < end - start and data:  # a single pread stops at 2 GiB
                parts = [data]
                got = len(data)
                while got < end - start:
                    more = os.pread(self._fd, end - start - got, start + got)
                    if not more:
                        break
                    parts.append(more)
                    got += len(more)
                data = b"".join(parts)
            return data
        with self._lock:
            self._file.seek(start)
            return self._file.read(end - start)

    @property
    def fd(self) -> int | None:
        """The open descriptor of a local file (for ``pread``), else None."""
        return self._fd if self._fd is not None and self._fd >= 0 else None

    def readinto(self, start: int, out: memoryview) -> int:
        """Fill ``out`` with the bytes from ``start``: straight from the page cache when local."""
        want = out.nbytes
        if self._fd is not None:
            got = 0
            while got < want:
                n = os.preadv(self._fd, [out[got:]], start + got)
                if n <= 0:
                    break
                got += n
            return got
        data = self(start, start + want)
        out[:len(data)] = data
        return len(data)

    def close(self) -> None:
        if self._fd is not None and self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        elif self._file is not None:
            self._file.close()
            self._file = None

    def __del__(self):  # readers are cached by format readers; never leak a descriptor
        try:
            self.close()
        except OSError:
            pass


def _join_url(url: str, rel: str) -> str:
    return url.rstrip("/") + "/" + rel if rel else url


class AtomicOutput:
    """Where a writer puts a new checkpoint, and how it becomes visible.

    ``store`` is where files go while writing; ``commit(write_manifest)`` makes the result
    visible, calling ``write_manifest(store)`` as the last write; ``abort()`` removes what
    was written.
    """

    final: Store
    store: Store

    def commit(self, write_manifest) -> Store:
        raise NotImplementedError

    def abort(self) -> None:
        try:
            self.store.fs.rm(self.store.root, recursive=True)
        except FileNotFoundError:
            pass


class RenameOutput(AtomicOutput):
    """POSIX: write to ``NAME.tmp-<id>/`` and rename into place. With a ``resume_key`` the
    id is that key, so a re-run of the same job finds what an interrupted one wrote."""

    def __init__(self, final: Store, resume_key: str | None = None):
        self.final = final
        tmp_root = f"{final.root}{TMP_MARK}{resume_key or uuid.uuid4().hex[:12]}"
        self.store = Store(f"{final.url}{tmp_root[len(final.root):]}", final.fs, tmp_root, final.durable)
        final.fs.makedirs(tmp_root, exist_ok=resume_key is not None)

    def commit(self, write_manifest) -> Store:
        write_manifest(self.store)
        if self.final.durable:  # every new directory's entries (iter_*/mp_rank_*/...), then the rename
            for path, _, _ in os.walk(self.store.root, topdown=False):
                _fsync_dir(path)
        os.rename(self.store.root, self.final.root)
        if self.final.durable:
            _fsync_dir(os.path.dirname(self.final.root) or ".")
        return self.final


class MarkerOutput(AtomicOutput):
    """Object stores: write in place; the manifest written last is the commit marker."""

    def __init__(self, final: Store):
        self.final = final
        self.store = final

    def commit(self, write_manifest) -> Store:
        write_manifest(self.store)
        return self.final


RESUME_KEY_FILE = ".ckptool-resume-key"


def atomic_output(url: str, *, overwrite: bool = False, resume_key: str | None = None,
                  durable: bool = True) -> AtomicOutput:
    """The right atomic output for ``url``. Refuses an existing destination unless asked.

    ``resume_key`` names the job (same source, target and options): an interrupted run's
    partial output with the same key is kept, so the caller can skip what is already done.
    On object stores that output is the uncommitted destination itself (no manifest yet),
    recognised by the key file written into it. ``durable=False``: see :attr:`Store.durable`.
    """
    final = replace(Store.open(url), durable=durable)
    if final.exists():
        resumable = (resume_key is not None and not final.is_local and not final.exists("ckptool.json")
                     and final.exists(RESUME_KEY_FILE)
                     and final.read_bytes(RESUME_KEY_FILE).decode() == resume_key)
        if resumable and not overwrite:
            return MarkerOutput(final)
        if not overwrite:
            raise UsageError(f"destination {final.url} already exists",
                             hint="Choose a new path or pass --overwrite")
        final.fs.rm(final.root, recursive=True)
    if final.is_local:
        final.fs.makedirs(posixpath.dirname(final.root) or ".", exist_ok=True)
        return RenameOutput(final, resume_key)
    if resume_key is not None:
        final.write_bytes(RESUME_KEY_FILE, resume_key.encode())
    return MarkerOutput(final)


def write_file_atomically(store: Store, rel: str, data: bytes) -> None:
    """Replace one file so that readers see the old or the new content, never a torn one."""
    if store.is_local:
        tmp = store.path(f"{rel}{TMP_MARK}{uuid.uuid4().hex[:12]}")
        with open(tmp, "wb") as f:
            f.write(data)
            if store.durable:
                f.flush()
                fsync(f.fileno())
        os.replace(tmp, store.path(rel))
        if store.durable:
            _fsync_dir(os.path.dirname(store.path(rel)))
    else:
        store.write_bytes(rel, data)  # a single PUT is atomic on object stores


def pread_blocks(fd: int, offset: int, count: int, buf: memoryview):
    """The ``count`` bytes of local file ``fd`` from ``offset``, read into ``buf`` block by
    block (each yielded view is valid until the next); stops early at the file's end."""
    done = 0
    while done < count:
        n = os.preadv(fd, [buf[:min(len(buf), count - done)]], offset + done)
        if n <= 0:
            return
        yield buf[:n]
        done += n


_CANNOT_SYNC = {errno.EINVAL, errno.EROFS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF}
"""fsync errors of descriptors that cannot be synced (a pipe, a read-only or special
filesystem): nothing to wait for. Any other error (EIO, ENOSPC...) means the data may not
be on disk, so the output must not be committed."""


def fsync(fd: int) -> None:
    """``os.fsync``, raising every error but those of a descriptor that cannot be synced."""
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _CANNOT_SYNC:
            raise


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        fsync(fd)
    finally:
        os.close(fd)
