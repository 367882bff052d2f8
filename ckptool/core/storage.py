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
import fcntl
import os
import posixpath
import re
import stat
import sys
import threading
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from ckptool.core.errors import (
    BadCheckpoint,
    DanglingPointer,
    NotRegularFile,
    OutputFailed,
    PathEscape,
    UnreadableInput,
    UsageError,
)
from ckptool.core.lazy import lazy

TMP_MARK = ".tmp-"
METADATA_LIMIT = 64 << 20
"""The most bytes of one metadata document ckptool reads (:meth:`Store.read_small`): the
largest real ones (a 1T model's safetensors index) are a few MB."""
_TMP_RE = re.compile(r"\.tmp-[0-9a-zA-Z]+$")
_STORAGE_OPTIONS: dict[str, Any] = {}
_OBJECT_STORES = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "oss"}
"""fsspec protocols whose keys are plain strings (``b//x`` is not ``b/x``)."""
fsspec = lazy("fsspec", globals())  # ~0.1 s to import: local paths need it only to write


class _LocalFS:
    """fsspec's ``LocalFileSystem``, created on first use. Reading a local checkpoint goes
    through ``os`` (see :class:`Store`), so the light commands (``latest``, ``verify``) never
    import fsspec; anything else asked of the filesystem is the real one's."""

    __slots__ = ("_fs",)

    def __init__(self):
        self._fs = None

    def __getattr__(self, name: str) -> Any:
        if self._fs is None:
            from fsspec.implementations.local import LocalFileSystem

            self._fs = LocalFileSystem()
        return getattr(self._fs, name)


def _is_local_fs(fs) -> bool:
    if isinstance(fs, _LocalFS):
        return True
    local = sys.modules.get("fsspec.implementations.local")
    return local is not None and isinstance(fs, local.LocalFileSystem)


def _local_root(url: str) -> str | None:
    """The absolute path of a plain local path or ``file://`` URL, as fsspec gives it; None
    for any other URL (a protocol, a chain) and whenever storage options are set."""
    if _STORAGE_OPTIONS or "::" in url:
        return None
    path = url[len("file://"):] if url.startswith("file://") else url
    if "://" in path:
        return None
    path = os.path.expanduser(path)
    if not os.path.isabs(path):
        path = os.path.abspath(path)
    return path.rstrip("/") or "/"


def set_storage_options(options: dict[str, Any]) -> None:
    """Extra fsspec storage options for every URL this process opens (--storage-option)."""
    _STORAGE_OPTIONS.clear()
    _STORAGE_OPTIONS.update(options)


def is_temporary(name: str) -> bool:
    """True for the name of an uncommitted output directory or file (``X.tmp-<id>``)."""
    return bool(_TMP_RE.search(name.rstrip("/")))


@dataclass
class Store:
    """A directory on some fsspec filesystem. All paths given to methods are relative.

    **Containment.** A checkpoint is untrusted input, and the paths its metadata names
    (index entries, DCP storage paths, trackers, ``latest``) are read through this class
    only. Every read checks the one rule (:meth:`contained`): the path is relative, has no
    ``..`` and, on a local filesystem, resolves (symlinks followed) inside ``boundary``;
    only regular files are opened, so a FIFO cannot block a read for ever. Writers'
    paths pass the same lexical check.
    """

    url: str
    fs: Any = field(repr=False)
    """An fsspec filesystem (for a local path, one created on first use)."""
    root: str = field(repr=False)
    durable: bool = field(default=True, repr=False)
    """Whether files written here are fsynced before they count as written (local files;
    object stores are durable once a PUT returns). ``False`` leaves the write-back to the
    kernel, as ``cp`` and ``torch.save`` do: faster, but a power loss or kernel crash soon
    after can leave files whose checksums fail."""
    boundary: str | None = field(default=None, repr=False)
    """The directory every read must stay inside (default: ``root``); see :func:`_boundary_of`."""

    @classmethod
    def open(cls, url: str) -> "Store":
        url = str(url)
        root = _local_root(url)
        if root is not None:
            fs = _LocalFS()
        else:
            try:
                fs, root = fsspec.core.url_to_fs(url, **_STORAGE_OPTIONS)
            except (ImportError, ValueError) as exc:
                raise UsageError(f"cannot open {url}: {exc}") from None
            root = root.rstrip("/") or root
        store = cls(url.rstrip("/") if len(url) > 1 else url, fs, root)
        if store.bucket is not None and any(part in ("", ".", "..") for part in root.split("/")):
            # an object store's keys are strings: "b//x" and "b/./x" are other keys than "b/x",
            # which its listings would then mix up
            raise UsageError(f"{url} has an empty, '.' or '..' path segment",
                             hint="Write the URL with single slashes and no '.' segments")
        if store.is_local:
            store.boundary = _boundary_of(root)
        return store

    @property
    def is_local(self) -> bool:
        return _is_local_fs(self.fs)

    @property
    def bucket(self) -> str | None:
        """The bucket (container) of an object store's URL; None on any other storage."""
        protocols = {self.fs.protocol} if isinstance(self.fs.protocol, str) else set(self.fs.protocol)
        return self.root.split("/")[0] if protocols & _OBJECT_STORES else None

    @property
    def name(self) -> str:
        return posixpath.basename(self.root.rstrip("/"))

    def path(self, rel: str = "") -> str:
        return posixpath.join(self.root, rel) if rel else self.root

    def child(self, rel: str) -> "Store":
        """The directory ``rel`` as a store of its own, contained in itself."""
        self.contained(rel)
        return Store(_join_url(self.url, rel), self.fs, self.path(rel), self.durable)

    def named(self, rel: str) -> "Store":
        """The entry ``rel`` as a store, unchecked: only to name it (a symlink out of a run root,
        listed as skipped), never to read through."""
        return Store(_join_url(self.url, rel), self.fs, self.path(rel), self.durable)

    def contained(self, rel: str, *, named_by: str | None = None, key: str | None = None) -> str:
        """``rel`` if reading it stays inside the checkpoint, else :class:`PathEscape` naming
        the file that named it (``named_by``) and the entry (``key``). Local paths are
        resolved, so a symlink whose target leaves the checkpoint is refused too."""
        reason = path_problem(rel)
        where = self.display(named_by) if named_by else self.display()
        if reason is None and rel and self.is_local:
            real = self._outside(self.path(rel))
            if real is not None:
                reason = f"is a symlink to {real}, outside the checkpoint"
                where = self.display(named_by) if named_by else self.display(rel)
        if reason is None:
            return rel
        raise PathEscape(f"the path {rel!r} {reason}", path=where, key=key,
                         hint="ckptool reads nothing outside the checkpoint; copy the files in "
                              "(cp -rL) only if you trust them")

    def _real_boundary(self) -> str:
        real = self.__dict__.get("_real")
        if real is None:
            real = self.__dict__["_real"] = os.path.realpath(self.boundary or self.root)
        return real

    def _read_path(self, rel: str) -> str:
        """The local path of a file to read: contained, and a regular file (else refused
        before it is opened)."""
        self.contained(rel)
        path = self.path(rel)
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            raise UnreadableInput("file not found", path=self.display(rel)) from None
        except OSError as exc:
            raise UnreadableInput(f"cannot read ({exc.strerror})", path=self.display(rel)) from None
        _require_regular(mode, self.display(rel))
        return path

    def exists(self, rel: str = "") -> bool:
        self.contained(rel)
        if self.is_local:  # what LocalFileSystem does, without importing it
            return os.path.exists(self.path(rel))
        return self.fs.exists(self.path(rel))

    def isdir(self, rel: str = "") -> bool:
        self.contained(rel)
        if self.is_local:
            return os.path.isdir(self.path(rel))
        return self.fs.isdir(self.path(rel))

    def size(self, rel: str) -> int:
        self.contained(rel)
        if self.is_local:
            try:
                return os.path.getsize(self.path(rel))
            except FileNotFoundError:
                raise UnreadableInput("file not found", path=self.display(rel)) from None
        return int(self.fs.size(self.path(rel)))

    def ls(self, rel: str = "") -> list[tuple[str, bool]]:
        """(name, is_dir) of the entries directly under ``rel``; [] when it is missing. A
        symlink counts as what it points at when that is inside the checkpoint."""
        self.contained(rel)
        if self.is_local:
            return self._ls_local(rel)
        try:
            entries = self.fs.ls(self.path(rel), detail=True, refresh=True)
        except FileNotFoundError:
            return []
        base = self.path(rel).rstrip("/")
        out = []
        for e in entries:
            name = e["name"].rstrip("/")
            if name == base:
                continue
            name = posixpath.basename(name)
            if name in ("", ".", ".."):  # an object store's odd key (``root/../x``): no entry
                continue                 # of this directory, and nothing is read through it
            out.append((name, e["type"] == "directory"))
        return sorted(out)

    def _ls_local(self, rel: str) -> list[tuple[str, bool]]:
        try:
            entries = list(os.scandir(self.path(rel)))
        except (FileNotFoundError, NotADirectoryError):
            return []
        out = []
        for e in entries:
            is_dir = e.is_dir(follow_symlinks=False)
            if e.is_symlink():
                inner = posixpath.join(rel, e.name) if rel else e.name
                is_dir = self._outside(e.path) is None and self.fs.isdir(self.path(inner))
            out.append((e.name, is_dir))
        return sorted(out)

    def link_out(self, rel: str) -> str | None:
        """Where the entry ``rel`` leads when it is a symlink to a directory outside the store
        (which :meth:`ls` lists as no directory, and no read enters); else None."""
        if not self.is_local:
            return None
        path = self.path(rel)
        real = self._outside(path) if os.path.islink(path) else None
        return real if real is not None and os.path.isdir(real) else None

    def _outside(self, path: str) -> str | None:
        """Where the local ``path`` resolves (symlinks followed) when that is outside this
        store's boundary; None inside: the one containment test of local paths."""
        real = os.path.realpath(path)
        return None if _within(real, self._real_boundary()) else real

    def files(self) -> dict[str, int]:
        """Every regular file below this store that reading may touch: relative path -> size.
        What is refused (symlinks out, FIFOs...) is in :meth:`refused`."""
        return self._walk()[0]

    def refused(self) -> dict[str, str]:
        """Entries below this store that no read will open: relative path -> why (a symlink
        whose target leaves the checkpoint, a FIFO, a device or a socket)."""
        return self._walk()[1]

    def _walk(self) -> tuple[dict[str, int], dict[str, str]]:
        if not self.is_local:
            found = self.fs.find(self.root, detail=True, withdirs=False)
            prefix = self.root.rstrip("/") + "/"
            return {name[len(prefix):]: int(info["size"]) for name, info in found.items()
                    if name.startswith(prefix)}, {}
        files: dict[str, int] = {}
        refused: dict[str, str] = {}
        pending = [""]
        seen: set[str] = set()
        while pending:
            rel = pending.pop()
            try:
                entries = list(os.scandir(self.path(rel)))
            except OSError:
                continue
            for e in entries:
                inner = posixpath.join(rel, e.name) if rel else e.name
                if e.is_symlink():
                    real = self._outside(e.path)
                    if real is not None:
                        refused[inner] = f"is a symlink to {real}, outside the checkpoint"
                        continue
                try:
                    st = os.stat(e.path)
                except OSError:
                    refused[inner] = "is a dangling symlink"
                    continue
                if stat.S_ISDIR(st.st_mode):
                    real = os.path.realpath(e.path)
                    if real not in seen:  # a symlink loop inside the checkpoint ends here
                        seen.add(real)
                        pending.append(inner)
                elif stat.S_ISREG(st.st_mode):
                    files[inner] = st.st_size
                else:
                    refused[inner] = f"is a {_kind(st.st_mode)}, not a regular file"
        return files, refused

    def open_file(self, rel: str, mode: str = "rb", **kwargs):
        if self.is_local and mode == "rb":
            return os.fdopen(_open_regular(self._read_path(rel), self.display(rel)), "rb")
        self.contained(rel)
        try:
            return self.fs.open(self.path(rel), mode, **kwargs)
        except FileNotFoundError:
            raise UnreadableInput("file not found", path=_join_url(self.url, rel)) from None

    def read_bytes(self, rel: str, start: int | None = None, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of a file, never more than it holds (a length a header
        claims is not an allocation)."""
        if self.is_local:
            reader = RangeReader(self, rel)
            try:
                begin = 0 if start is None else start if start >= 0 else max(0, reader.size + start)
                stop = reader.size if end is None else end if end >= 0 else reader.size + end
                return reader(begin, stop)
            finally:
                reader.close()
        self.contained(rel)
        try:
            return self.fs.cat_file(self.path(rel), start=start, end=end)
        except FileNotFoundError:
            raise UnreadableInput("file not found", path=_join_url(self.url, rel)) from None

    def stamps(self) -> dict[str, tuple]:
        """What changes when a file below this store is written again, from one listing:
        relative path -> (size, modification time) locally, (size, ETag or modification time)
        on an object store."""
        if not self.is_local:
            prefix = self.root.rstrip("/") + "/"
            return {name[len(prefix):]: (info.get("size"), str(
                        info.get("ETag") or info.get("etag") or info.get("mtime") or info.get("LastModified")
                        or info.get("last_modified") or info.get("created")))
                    for name, info in self.fs.find(self.root, detail=True, withdirs=False).items()
                    if name.startswith(prefix)}
        out = {}
        for rel in self.files():  # contained regular files only
            try:
                st = os.stat(self.path(rel))
            except OSError:
                continue
            out[rel] = (st.st_size, st.st_mtime_ns)
        return out

    def read_small(self, rel: str, limit: int = METADATA_LIMIT) -> bytes:
        """The whole of a metadata file (a JSON document: ``config.json``, an index, a manifest)
        that holds at most ``limit`` bytes; a larger one (a damaged or crafted file, 3 GB of
        zeros after its JSON) is refused, never allocated whole and parsed."""
        size = self.size(rel) if self.is_local else None  # a stat locally; a HEAD is not worth it
        data = self.read_bytes(rel, 0, limit + 1) if size is None or size <= limit else b""
        if (size or 0) > limit or len(data) > limit:
            raise BadCheckpoint(f"{posixpath.basename(rel) or self.name} is "
                                f"{size if size is not None else 'over ' + str(limit)} bytes, more than "
                                f"any such file ckptool reads ({limit >> 20} MiB): damaged, or not what "
                                "its name says", path=self.display(rel))
        return data

    def range_reader(self, rel: str) -> "RangeReader":
        """A reader of byte ranges of one file that keeps it open (pread when local)."""
        return RangeReader(self, rel)

    def write_bytes(self, rel: str, data: bytes) -> None:
        self.contained(rel)
        with self.fs.open(self.path(rel), "wb") as f:
            f.write(data)
            if self.durable and self.is_local:
                f.flush()
                fsync(f.fileno())

    def display(self, rel: str = "") -> str:
        return _join_url(self.url, rel) if rel else self.url


def path_problem(rel) -> str | None:
    """Why ``rel`` is not a plain relative path inside its directory, or None."""
    if not isinstance(rel, str):
        return f"is not a path ({type(rel).__name__})"
    if "\x00" in rel:
        return "holds a NUL byte"
    if rel.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", rel) or "://" in rel:
        return "is absolute"
    if any(part == ".." for part in re.split(r"[/\\]", rel)):
        return "leaves the checkpoint (..)"
    return None


def _within(real: str, boundary: str) -> bool:
    return real == boundary or real.startswith(boundary.rstrip("/") + "/")


def overlap(source: Store, dst_url: str) -> str | None:
    """How writing a checkpoint at ``dst_url`` would touch what ``source`` reads ("is the
    source", "is inside the source", "holds the source"), or None. Local paths are compared
    resolved, so a symlink or ``..`` does not hide it; object stores by bucket and key."""
    dst = Store.open(dst_url)
    if source.is_local != dst.is_local:
        return None
    if source.is_local:
        src, out = source._real_boundary(), os.path.realpath(dst.root)
    elif type(source.fs) is not type(dst.fs):
        return None
    else:
        src, out = source.root.rstrip("/"), dst.root.rstrip("/")
    if src == out:
        return "is the source"
    if _within(out, src):
        return "is inside the source"
    if _within(src, out):
        return "holds the source"
    return None


_HUB_SNAPSHOT = re.compile(r"^(?P<repo>.*/(models|datasets)--[^/]+)/snapshots/[^/]+$")


def _boundary_of(root: str) -> str:
    """What a local checkpoint's reads must stay inside: the directory itself, except for a
    Hugging Face hub cache snapshot (``models--org--name/snapshots/<rev>/``), whose files are
    symlinks into the repository's own ``blobs/``: there, the repository's cache directory."""
    m = _HUB_SNAPSHOT.match(os.path.realpath(root))
    return m.group("repo") if m else root


def _kind(mode: int) -> str:
    return ("FIFO" if stat.S_ISFIFO(mode) else "socket" if stat.S_ISSOCK(mode) else
            "character device" if stat.S_ISCHR(mode) else "block device" if stat.S_ISBLK(mode)
            else "directory" if stat.S_ISDIR(mode) else "special file")


def _require_regular(mode: int, where: str) -> None:
    if not stat.S_ISREG(mode):
        raise NotRegularFile(f"is a {_kind(mode)}, not a regular file", path=where,
                             hint="A checkpoint holds regular files only; remove it")


def _open_regular(path: str, where: str) -> int:
    """A read-only descriptor of the regular file ``path``. Opened non-blocking and checked
    again after opening, so a file swapped for a FIFO cannot block."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise UnreadableInput("file not found", path=where) from None
    except OSError as exc:
        raise UnreadableInput(f"cannot read ({exc.strerror})", path=where) from None
    try:
        _require_regular(os.fstat(fd).st_mode, where)
    except BaseException:
        os.close(fd)
        raise
    return fd


class RangeReader:
    """``reader(start, end) -> bytes`` over one file; ``size`` is known up front."""

    def __init__(self, store: Store, rel: str):
        self._fd: int | None = None  # set first: close() and __del__ run even if opening fails
        self._file = None
        self.source = store.display(rel)
        if store.is_local:
            self._fd = _open_regular(store._read_path(rel), self.source)
            self.size = os.fstat(self._fd).st_size
        else:
            store.contained(rel)
            try:
                self._file = store.fs.open(store.path(rel), "rb", block_size=8 << 20)
            except FileNotFoundError:
                raise UnreadableInput("file not found", path=self.source) from None
            self.size = int(self._file.size)
        self._lock = threading.Lock()

    def __call__(self, start: int, end: int) -> bytes:
        """Bytes ``[start, end)``; fewer when the file ends first (never an allocation of
        what the caller asked beyond the file's size)."""
        end = min(end, self.size)
        if end <= start:
            return b""
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


_POINTER_BYTES = 4096


def pointer_text(store: Store, pointer: str) -> str:
    """What a pointer file (Megatron's tracker, DeepSpeed's ``latest``) says: its first
    :data:`_POINTER_BYTES`, stripped (a pointer is a short name, whatever the file holds)."""
    return store.read_bytes(pointer, 0, _POINTER_BYTES).decode(errors="replace").strip()


def plain_name(name: str | None) -> str | None:
    """A directory name a pointer gives, in its plain form (``global_step2/`` and
    ``./global_step2`` are ``global_step2``, as the frameworks' loaders read them); None for
    one that names no directory (``.``). One that leaves the checkpoint is left as it is, for
    the containment check to name."""
    if not name or path_problem(name) is not None:
        return name
    plain = posixpath.normpath(name)
    return None if plain == "." else plain


def pointed_dir(store: Store, pointer: str, name_of: Callable[[str], str | None] = lambda t: t) -> str | None:
    """The directory that the pointer file ``pointer`` names (Megatron's tracker, DeepSpeed's
    ``latest``), or None when there is no such file: the one rule for every pointer.

    ``name_of`` turns the file's text into a directory name (None: the text is not one).
    The directory must exist inside the checkpoint; a pointer to a missing one is
    :class:`DanglingPointer`, never a substitution by another checkpoint."""
    if not store.exists(pointer) or store.isdir(pointer):
        return None
    text = pointer_text(store, pointer)
    name = plain_name(name_of(text)) if text else None
    if not name:
        raise BadCheckpoint(f"{pointer} holds {text[:60]!r}, which names no checkpoint",
                            path=store.display(pointer), hint="Fix or remove the file")
    store.contained(name, named_by=pointer)
    if not store.isdir(name):
        raise DanglingPointer(f"{pointer} names {name}, which does not exist",
                              path=store.display(pointer),
                              hint="Point it at an existing checkpoint, or name one directly")
    return name


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
    id is that key, so a re-run of the same job finds what an interrupted one wrote.

    ``replace``: what is at ``NAME`` (``--overwrite``) stays there until the commit, which
    moves it aside to a ``.tmp-`` name, renames the new output in and then deletes it: a
    failed or interrupted run leaves the old checkpoint as it was."""

    def __init__(self, final: Store, resume_key: str | None = None, replace: bool = False):
        self.final = final
        self.replace = replace
        tmp_root = f"{final.root}{TMP_MARK}{resume_key or uuid.uuid4().hex[:12]}"
        self.store = Store(f"{final.url}{tmp_root[len(final.root):]}", final.fs, tmp_root, final.durable)
        final.fs.makedirs(tmp_root, exist_ok=resume_key is not None)
        self._lock = _hold(tmp_root, final) if resume_key is not None else None

    def commit(self, write_manifest) -> Store:
        write_manifest(self.store)
        if self.final.durable:  # every new directory's entries (iter_*/mp_rank_*/...), then the rename
            for path, _, _ in os.walk(self.store.root, topdown=False):
                _fsync_dir(path)
        old = None
        if self.replace and os.path.lexists(self.final.root):
            old = f"{self.final.root}{TMP_MARK}{uuid.uuid4().hex[:12]}"  # never read by `latest`
            os.rename(self.final.root, old)
        try:
            os.rename(self.store.root, self.final.root)
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST) or old is not None:
                raise
            self.abort()  # another run committed the destination while this one wrote it
            raise OutputFailed("the destination appeared while this run wrote it (another run "
                               "committed it)", path=self.final.url,
                               hint="Check that one job writes it; verify what is there") from None
        self._release()
        if self.final.durable:
            _fsync_dir(os.path.dirname(self.final.root) or ".")
        if old is not None:
            if os.path.isdir(old) and not os.path.islink(old):
                self.final.fs.rm(old, recursive=True)
            else:
                os.unlink(old)
        return self.final

    def abort(self) -> None:
        super().abort()
        self._release()

    def _release(self) -> None:
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None


def _hold(tmp_root: str, final: Store) -> int | None:
    """An exclusive lock on the temporary directory a job of this resume key writes into (it
    is the same directory for the same job): a second run of the same command at the same time
    (a prelaunch script run on every node) is refused, where it used to rewrite the first one's
    files under it. None where the filesystem has no ``flock`` (Lustre without -o flock)."""
    fd = os.open(tmp_root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.stat(tmp_root).st_ino != os.fstat(fd).st_ino:  # committed by the other run meanwhile
            raise BlockingIOError
        return fd
    except (BlockingIOError, FileNotFoundError):
        os.close(fd)
        raise OutputFailed("another ckptool run is writing this destination", path=final.url,
                           hint=f"It writes into {tmp_root}; wait for it (or stop it: a re-run "
                                "resumes what it wrote)") from None
    except OSError:  # no locks on this filesystem: as before
        os.close(fd)
        return None


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
    dangling = final.is_local and os.path.islink(final.root) and not final.exists()
    if dangling and not overwrite:  # the rename would fail at the end, leaving the whole output
        raise UsageError(f"destination {final.url} is a symlink to {os.readlink(final.root)}, which "
                         "does not exist", hint="Give the path to write at, or pass --overwrite to "
                         "replace the link")
    if final.exists() or dangling:
        resumable = (resume_key is not None and not final.is_local and not final.exists("ckptool.json")
                     and final.exists(RESUME_KEY_FILE)
                     and final.read_bytes(RESUME_KEY_FILE).decode() == resume_key)
        if resumable and not overwrite:
            return MarkerOutput(final)
        if not overwrite:
            raise UsageError(f"destination {final.url} already exists",
                             hint="Choose a new path or pass --overwrite")
        if final.is_local:  # replaced at the commit, not before: a failed run keeps it
            return _rename_output(final, resume_key, replace=True)
        final.fs.rm(final.root, recursive=True)  # written in place: the old must go first
    if final.is_local:
        return _rename_output(final, resume_key)
    if resume_key is not None:
        final.write_bytes(RESUME_KEY_FILE, resume_key.encode())
    return MarkerOutput(final)


def _rename_output(final: Store, resume_key: str | None, replace: bool = False) -> RenameOutput:
    try:
        final.fs.makedirs(posixpath.dirname(final.root) or ".", exist_ok=True)
        return RenameOutput(final, resume_key, replace)
    except OSError as exc:
        raise OutputFailed(f"cannot create the destination: {exc.strerror or exc}",
                           path=exc.filename or final.url,
                           hint="Choose a path whose directory exists or can be made, and is "
                                "writable") from None


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


def pread_blocks(fd: int, offset: int, count: int | None, buf: memoryview, first: int | None = None):
    """The ``count`` bytes of local file ``fd`` from ``offset`` (None: to its end), read into
    ``buf`` block by block (each yielded view is valid until the next); stops early at the
    file's end. Every block but the last is full (a short read is read on): the first is
    ``first`` bytes long when given, the others ``len(buf)``, so where each starts is known."""
    done, want = 0, len(buf) if first is None else first
    while count is None or done < count:
        if count is not None:
            want = min(want, count - done)
        n = 0
        while n < want:
            got = os.preadv(fd, [buf[n:want]], offset + done + n)
            if got <= 0:
                break
            n += got
        if not n:
            return
        yield buf[:n]
        done += n
        if n < want:
            return
        want = len(buf)


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
