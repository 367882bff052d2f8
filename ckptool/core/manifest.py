"""The manifest ``ckptool.json``: what a checkpoint is, and a checksum of every file.

It is written last. A checkpoint that ckptool wrote is committed exactly when its manifest
exists. Hashes are xxh3-128 of each whole file, computed while writing where the writer
can (:class:`HashingWriter`) and in one streaming pass otherwise (:func:`hash_files`).
"""

from __future__ import annotations

import datetime as _dt
import errno
import io
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable

import xxhash

from ckptool.core import VERSION
from ckptool.core.errors import BadCheckpoint, TopologyError
from ckptool.core.scan import SCAN_BLOCK, FileScan
from ckptool.core.storage import (
    Store,
    fsync,
    path_problem,
    pread_blocks,
    write_file_atomically,
)
from ckptool.core.topology import Topology

MANIFEST = "ckptool.json"
MANIFEST_VERSION = 1
MANIFEST_LIMIT = 256 << 20
"""The largest manifest read (1.7M file entries): past it, a damaged or crafted file."""
HASH = "xxh3-128"
SELF = "manifest_xxh3_128"
"""The manifest's checksum of itself: xxh3-128 of its other fields, in canonical JSON. A manifest
damaged or edited after commit (its step, format or topology) then fails ``verify`` as the files
it lists would. Manifests from before it have none, and are read as they are."""
_BLOCK = 64 << 20
_THREAD = threading.local()


def _read_buffer() -> bytearray:
    """This thread's buffer for :func:`hash_file`: a block that stays in the core's cache
    between the read, the hash and the scan."""
    buf = getattr(_THREAD, "buffer", None)
    if buf is None:
        buf = _THREAD.buffer = bytearray(SCAN_BLOCK)
    return buf


def _creator() -> str:
    return f"ckptool {VERSION}"


@dataclass(frozen=True, slots=True)
class FileEntry:
    path: str
    """Relative to the checkpoint directory, '/'-separated."""
    size: int
    xxh3_128: str


@dataclass(slots=True)
class Manifest:
    format: str
    files: list[FileEntry]
    format_version: str | None = None
    topology: dict | None = None
    model_config: dict | None = None
    true_vocab_size: int | None = None
    iteration: int | None = None
    sealed: bool = False
    """True when `verify --seal` wrote it for a checkpoint ckptool did not write."""
    creator: str = field(default_factory=_creator)
    created_utc: str = field(  # to the microsecond: saves a second apart are told apart in order
        default_factory=lambda: _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ"))
    extra: dict = field(default_factory=dict)
    """Anything else a writer records; the training hook: ``{"writer": "hook"}``."""

    def to_json(self) -> str:
        data = {"ckptool_manifest": MANIFEST_VERSION, "hash": HASH, **asdict(self)}
        data = json.loads(json.dumps(data))  # what a reader will parse (tuples, int keys)
        data[SELF] = self_digest(data)
        return json.dumps(data, indent=1, sort_keys=False) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, source: str) -> "Manifest":
        try:
            data = json.loads(text)
            if data.get("ckptool_manifest") != MANIFEST_VERSION:
                raise ValueError(f"unknown manifest version {str(data.get('ckptool_manifest'))[:20]!r}")
            if data.get("hash") != HASH:
                raise ValueError(f"unknown hash {str(data.get('hash'))[:20]!r} (ckptool writes {HASH})")
            if SELF in data and data[SELF] != self_digest(data):
                raise BadCheckpoint(
                    "manifest does not match its own checksum: it was edited or damaged after commit",
                    path=source, hint="Use another checkpoint (`ckptool latest ROOT` finds the newest "
                    "valid one), or restore this one from a copy")
            if not isinstance(data["files"], list):
                raise ValueError(f"files is {type(data['files']).__name__}, not a list")
            files = [_entry(f) for f in data["files"]]
            if len({f.path for f in files}) != len(files):
                raise ValueError("a file is listed twice")
            known = {k: data[k] for k in cls.__dataclass_fields__ if k in data and k != "files"}
            for name, value in known.items():
                if not isinstance(value, _FIELD_TYPES.get(name, object)):
                    raise ValueError(f"field {name} is {type(value).__name__}")
            if isinstance(known.get("topology"), dict):
                if not all(type(v) is int and v >= 0 for v in known["topology"].values()):
                    raise ValueError("topology sizes are not numbers")
                try:
                    Topology.from_dict(known["topology"])
                except TopologyError as exc:
                    raise ValueError(f"topology: {exc.message}") from None
            for name in ("true_vocab_size", "iteration"):  # a bool is an int to isinstance
                value = known.get(name)
                if value is not None and (type(value) is not int or value < (name == "true_vocab_size")):
                    raise ValueError(f"field {name} is {str(value)[:20]}")
            return cls(files=files, **known)
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            raise BadCheckpoint(f"manifest is not valid: {exc}", path=source,
                                hint="The checkpoint was not committed by a known ckptool") from None

    def created(self) -> "_dt.datetime | None":
        """When it was written (``created_utc``, to the second or the microsecond); None if that
        does not parse."""
        for form in ("%Y-%m-%dT%H:%M:%S.%fZ", "%Y-%m-%dT%H:%M:%SZ"):
            try:
                return _dt.datetime.strptime(self.created_utc, form)
            except ValueError:
                continue
        return None

    def size_mismatches(self, actual: dict[str, int]) -> dict[str, tuple[FileEntry, int | None]]:
        """The listed files ``actual`` (path -> size) does not hold at their recorded size: path
        -> (entry, the size there, None when missing). No byte is read."""
        return {e.path: (e, actual.get(e.path)) for e in self.files if actual.get(e.path) != e.size}

    def size_problem(self, actual: dict[str, int]) -> str | None:
        """The first of :meth:`size_mismatches` in words ("x is missing", "x is 3 bytes, the
        manifest says 8"), or None."""
        for entry, size in self.size_mismatches(actual).values():
            return f"{entry.path} is " + ("missing" if size is None else
                                         f"{size} bytes, the manifest says {entry.size}")
        return None

    def file_map(self) -> dict[str, FileEntry]:
        return {f.path: f for f in self.files}


def self_digest(data: dict) -> str:
    """xxh3-128 of a parsed manifest's fields but :data:`SELF`, as canonical JSON (sorted keys,
    no spaces): the same however the file is laid out."""
    body = {k: v for k, v in data.items() if k != SELF}
    return xxhash.xxh3_128(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


_HEX = frozenset("0123456789abcdef")
_FIELD_TYPES = {"format": str, "format_version": (str, type(None)), "topology": (dict, type(None)),
                "model_config": (dict, type(None)), "true_vocab_size": (int, type(None)),
                "iteration": (int, type(None)), "sealed": bool, "creator": str, "created_utc": str,
                "extra": dict}


def _entry(item) -> FileEntry:
    """One well-formed file entry: a relative path inside the checkpoint, a size, a hash."""
    path, size, digest = item["path"], item["size"], item["xxh3_128"]
    problem = path_problem(path)
    if problem is None and (not path or path.endswith("/") or path.split("/")[-1] in (".", "")):
        problem = "names no file"
    if problem is not None:
        raise ValueError(f"file entry {str(path)[:80]!r} {problem}")
    if type(size) is not int or not 0 <= size < 1 << 63:
        raise ValueError(f"file entry {path!r} has size {str(size)[:20]}")
    if not isinstance(digest, str) or len(digest) != 32 or not set(digest) <= _HEX:
        raise ValueError(f"file entry {path!r} has no xxh3-128 hash ({str(digest)[:40]!r})")
    return FileEntry(path, size, digest)


def read_manifest(store: Store) -> Manifest | None:
    """The manifest of ``store``, or None if it has none (not committed, or foreign)."""
    if not store.exists(MANIFEST):
        return None
    return Manifest.from_json(store.read_small(MANIFEST, MANIFEST_LIMIT), store.display(MANIFEST))


def write_manifest(store: Store, manifest: Manifest) -> None:
    write_file_atomically(store, MANIFEST, manifest.to_json().encode())


class HashingWriter:
    """A file-like writer that hashes what passes through it, so no second pass is needed.

    On a local file it also starts the disk write-back of every ``WRITEBACK`` bytes as soon
    as they are written (``posix_fadvise(DONTNEED)``: asynchronous on Linux, and it drops
    the pages once clean), so the disk is busy while later bytes are still being produced
    and the final ``fsync`` waits only for the tail; a large output also never holds
    gigabytes of dirty page cache.

    ``durable=False`` (a :class:`Store` that is not durable) leaves the write-back to the
    kernel, as ``cp`` does: no early write-back and no ``fsync``."""

    WRITEBACK = 64 << 20

    def __init__(self, raw, durable: bool = True):
        self._raw = raw
        self._hash = xxhash.xxh3_128()
        self.size = 0
        self._flushed = 0
        self._durable = durable
        self._fd = _fileno(raw) if durable and hasattr(os, "posix_fadvise") else None
        self._copy = hasattr(os, "copy_file_range")

    def write(self, data) -> int:
        self._raw.write(data)
        self._hash.update(data)
        n = memoryview(data).nbytes
        self._grew(n)
        return n

    def copy_from(self, fd: int, offset: int, count: int) -> int:
        """Append ``count`` bytes of the local file ``fd`` from ``offset`` by an in-kernel
        copy (``copy_file_range``: no pass through user memory), hashed from a read-only map
        of the source. Returns the bytes copied: fewer than ``count`` when the kernel or the
        filesystem cannot (the caller writes the rest, and reports a source that ends early)."""
        out = _fileno(self._raw) if self._copy and count else None
        if out is None:
            return 0
        self._raw.flush()
        done = 0
        while done < count:
            try:
                n = os.copy_file_range(fd, out, count - done, offset + done)
            except OSError:
                self._copy = False  # EXDEV, EINVAL, ENOSYS...: this stream writes its bytes
                break
            if n == 0:  # the end of the source, or a filesystem that copies nothing
                break
            done += n
        if done:
            self._raw.seek(0, os.SEEK_END)  # the buffered writer follows the fd's new offset
            self._hash_file(fd, offset, done)
            self._grew(done)
        return done

    def _hash_file(self, fd: int, offset: int, count: int) -> None:
        """Hash bytes just copied, read back from the page cache through the thread's
        cache-sized buffer (not mapped: a source another job truncates meanwhile is then a
        clean error, not a SIGBUS)."""
        done = 0
        for block in pread_blocks(fd, offset, count, memoryview(_read_buffer())):
            self._hash.update(block)
            done += len(block)
        if done < count:
            raise OSError(errno.EIO, "a source file changed while it was copied")

    def _grew(self, n: int) -> None:
        self.size += n
        if self._fd is not None and self.size - self._flushed >= self.WRITEBACK:
            self._writeback()

    def _writeback(self) -> None:
        try:
            self._raw.flush()
            os.posix_fadvise(self._fd, self._flushed, self.size - self._flushed, os.POSIX_FADV_DONTNEED)
        except (OSError, ValueError):
            self._fd = None  # not a plain local file after all: leave it to the final fsync
            return
        self._flushed = self.size

    def hexdigest(self) -> str:
        return self._hash.hexdigest()

    def flush(self) -> None:
        self._raw.flush()

    def fsync(self) -> None:
        self._raw.flush()
        fd = _fileno(self._raw) if self._durable else None
        if fd is not None:
            fsync(fd)


def _fileno(raw) -> int | None:
    """The OS file descriptor of a local file object, or None (object stores, buffers)."""
    try:
        return raw.fileno()
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return None


class _NoDigest:
    """What stands for the hash where only the scan is wanted (a file no manifest lists)."""

    def update(self, data) -> None:
        pass

    def hexdigest(self) -> None:
        return None


def hash_file(store: Store, rel: str, progress: Callable[[int], Any] | None = None,
              scan: FileScan | None = None, digest: bool = True) -> tuple[int, str | None]:
    """(size, xxh3-128 hex) of one file, streamed in large blocks; each block also goes
    through ``scan`` (``verify --deep``'s NaN/Inf test) while it is in cache. Without
    ``digest`` the hash is None and only the scan reads."""
    h = xxhash.xxh3_128() if digest else _NoDigest()
    if store.is_local:
        # Read into one cache-sized buffer of the thread, reused: the read's copy lands in
        # the core's cache, where the hash and the scan then find it. Not mapped: a file that
        # another job truncates meanwhile (a step being saved again) then reads short and is
        # reported, where a mapping would kill the process with SIGBUS. Measured here, the
        # deep pass costs the same either way; hashing alone about 10% more than a mapping.
        f = store.open_file(rel, "rb")  # contained, a regular file
        buf = _read_buffer()
        try:
            phase = scan.bind(buf) if scan is not None and scan.spans else 0
        except BaseException:
            f.close()
            raise
        # every block but the last ends at `phase` mod 8: an element starting there starts each
        # block aligned and never straddles two
        blocks = pread_blocks(f.fileno(), 0, None, memoryview(buf), first=len(buf) - (8 - phase) % 8)
    else:
        f = store.open_file(rel, "rb", block_size=_BLOCK)
        blocks = iter(lambda: f.read(_BLOCK), b"")
    size = 0
    try:
        with f:
            for block in blocks:
                h.update(block)
                if scan is not None:
                    scan.feed(size, block)
                size += len(block)
                if progress:
                    progress(len(block))
    finally:
        if scan is not None:
            scan.release()  # nothing to do unless bound
    return size, h.hexdigest()


def hash_files(store: Store, rels: Iterable[str], *, workers: int = 2,
               progress: Callable[[int], Any] | None = None,
               scans: dict[str, Callable[[], FileScan]] | None = None,
               sizes: dict[str, int] | None = None,
               digest: bool = True) -> dict[str, tuple[int, str | None]]:
    """Hash many files in parallel (xxhash and the scans release the GIL), the largest
    first where ``sizes`` are known, so that the workers finish together. ``scans`` go along
    with their files: each is made by its worker just before the file is read (making one
    may take a while: it then overlaps the other workers' reading). Without ``digest`` (files
    no manifest lists) only the scans read, and a file with nothing to scan is not read.
    Missing files raise."""
    rels = list(rels)
    scans, sizes = scans or {}, sizes or {}

    def one(rel: str) -> tuple[int, str | None]:
        make = scans.get(rel)
        scan = make() if make is not None else None
        if not digest and (scan is None or not scan.spans):  # nothing to hash or scan in it
            if progress:
                progress(sizes.get(rel, 0))
            return sizes.get(rel, 0), None
        return hash_file(store, rel, progress, scan, digest)

    if workers <= 1 or len(rels) <= 1:
        return {r: one(r) for r in rels}
    order = sorted(rels, key=lambda r: -sizes.get(r, 0))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        done = dict(zip(order, pool.map(one, order)))
    return {r: done[r] for r in rels}


def build_manifest(store: Store, fmt: str, *, files: Iterable[str] | None = None,
                   hashes: dict[str, tuple[int, str]] | None = None, **fields) -> Manifest:
    """A manifest over ``files`` (default: every file in ``store``), hashing what is not given."""
    rels = sorted(files if files is not None else
                  (f for f in store.files() if f != MANIFEST))
    known = dict(hashes or {})
    missing = [r for r in rels if r not in known]
    known.update(hash_files(store, missing))
    entries = [FileEntry(r, known[r][0], known[r][1]) for r in rels]
    return Manifest(format=fmt, files=entries, **fields)
