"""``ckptool verify``: is this checkpoint whole, committed and uncorrupted?

Checks, in order:

1. the manifest (if any): every file it lists is present, with its size and xxh3-128 hash;
   files it does not list are *warnings* (they do not change any data ckptool reads, and
   parallel filesystems leave such files, e.g. NFS ``.nfs*``); ``strict=True`` makes them
   errors;
2. the format's own metadata: every file it names is present and long enough;
3. every global tensor is covered exactly once by its stored pieces;
4. with ``deep``: every piece reads back with its declared shape and dtype, and holds no
   NaN/Inf (reported per tensor with counts); every object can be read.

A checkpoint that ckptool wrote (the format's metadata carries ckptool's mark) without a
manifest was never committed: that is an error. A foreign checkpoint without a manifest
is checked on its structure and reported as unsealed; ``seal=True`` then writes one.
"""

from __future__ import annotations

import math
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import converters
from ckptool.checkpoints.open import merge_manifest, read_index, resolve
from ckptool.checkpoints.reports import Problem, VerifyReport
from ckptool.core.errors import BadCheckpoint, CkptoolError, UnsafePickle, UsageError
from ckptool.core.index import CheckpointIndex, Reader
from ckptool.core.lazy import lazy
from ckptool.core.manifest import (
    MANIFEST,
    Manifest,
    build_manifest,
    hash_files,
    read_manifest,
    write_manifest,
)
from ckptool.core.regions import coverage_problems, plan_copies
from ckptool.core.safe_pickle import trusted
from ckptool.core.scan import FileScan, Span, float_kind
from ckptool.core.storage import Store, is_temporary

torch = lazy("torch", globals())

Progress = Callable[[int], object]


@dataclass
class _Check:
    store: Store
    problems: list[Problem] = field(default_factory=list)
    warnings: list[Problem] = field(default_factory=list)
    bad_files: set = field(default_factory=set)
    bytes_hashed: int = 0
    pieces_read: int = 0
    scanned: set = field(default_factory=set)  # files hashed (and scanned) already

    def add(self, kind: str, message: str, rel: str | None = None, key: str | None = None):
        file = self.store.display(rel) if rel else None
        self.problems.append(Problem(kind, message, file, key))
        if rel:
            self.bad_files.add(rel)

    def add_error(self, exc: CkptoolError, kind: str):
        if exc.path and any(exc.path == self.store.display(f) for f in self.bad_files):
            return  # already reported as missing/truncated
        message = f"{exc.message}; {exc.hint}" if isinstance(exc, UnsafePickle) else exc.message
        self.problems.append(Problem(kind, message, exc.path, exc.key))


def verify(url: str, *, deep: bool = False, seal: bool = False, strict: bool = False,
           workers: int | None = None, progress: Progress | None = None) -> VerifyReport:
    """Verify the checkpoint at ``url`` (a checkpoint directory or a run root), hashing
    ``workers`` files at a time (default: the cores, at most 8)."""
    deep = deep or seal
    workers = workers or min(8, os.cpu_count() or 2)
    try:
        store = resolve(url)
        fmt = converters.require_format(store)
    except BadCheckpoint as exc:  # its tracker, `latest` or manifest is bad: a finding too
        check = _Check(Store.open(url))
        check.add_error(exc, "metadata")
        return VerifyReport(path=check.store.url, format="unknown", ok=False, committed=None,
                            sealed=False, deep=deep, files_checked=0, bytes_hashed=0, tensors=0,
                            pieces_read=0, problems=check.problems)
    check = _Check(store)
    if is_temporary(store.name):  # named directly: a crash left it before its rename
        check.add("uncommitted", "not committed: a temporary output of a write that never finished "
                  "(NAME.tmp-*); the committed checkpoint is NAME")
    actual = store.files()
    for rel, why in sorted(store.refused().items()):
        check.add("unsafe-path", f"{why}: nothing reads it", rel)
    try:
        manifest = read_manifest(store)
    except BadCheckpoint as exc:
        manifest = None
        check.add_error(exc, "manifest")
    reader = converters.reader(fmt)
    index = index_error = None
    try:
        index = merge_manifest(read_index(reader, store), manifest)
    except CkptoolError as exc:
        index_error = exc
    plan = _plan_deep(store, reader, index) if deep and index is not None else None
    if plan is not None and any(t.replicas for t in index.tensors.values()) \
            and "torch" not in sys.modules:  # replicas are compared as tensors
        import torch  # noqa: F401

        reader = converters.reader(fmt)
        index = merge_manifest(read_index(reader, store), manifest)
        plan = _plan_deep(store, reader, index)
    if manifest is not None:
        _check_manifest(check, manifest, actual, strict, workers, progress,
                        {rel: plan.planner(rel) for rel in plan.files} if plan else None,
                        read=set(index.files) if index is not None else set())
    if plan is not None:
        unread = [rel for rel in plan.files if rel not in check.scanned and rel not in check.bad_files]
        for rel in unread:
            if rel not in actual:  # no file holds them (zarr's all-fill chunk): the reader does
                plan.planner(rel)()
        unread = [rel for rel in unread if rel in actual]
        if unread:  # no manifest entry hashed them: read them for the scan alone
            hash_files(store, unread, workers=workers, progress=progress, digest=False,
                       scans={rel: plan.planner(rel) for rel in unread}, sizes=actual)
        if plan.pieces and "torch" not in sys.modules:
            # Pieces the scan cannot read in place are read as tensors: read the index again
            # with torch loaded, so that its dtypes (and the reader's archives) are torch's.
            import torch  # noqa: F401

            reader = converters.reader(fmt)
            index = merge_manifest(read_index(reader, store), manifest)
            _torch_pieces(plan, index)
    if index_error is not None:
        # A file the manifest already condemned may fail in any way; otherwise only a
        # bad checkpoint (or a pickle ckptool will not load) is a finding, and unreadable
        # input stays exit 2.
        exc = index_error
        if not isinstance(exc, (BadCheckpoint, UnsafePickle)) and not check.problems:
            raise exc
        check.add_error(exc, "pickle" if isinstance(exc, UnsafePickle) else "metadata")
    committed: bool | None = True if manifest is not None else None
    if is_temporary(store.name):
        committed = False
    if index is not None:
        if manifest is None and index.written_by_ckptool:
            committed = False
            check.add("uncommitted", f"not committed: {MANIFEST} is missing, so its writer never "
                      "finished", MANIFEST)
        _check_structure(check, index, actual)
        _check_objects(check, reader, index)
        if plan is not None:
            _check_deep(check, reader, index, plan, progress, workers)
        _check_pickles(check, reader)
    elif manifest is None and check.problems == []:
        committed = None

    sealed = False
    if seal and not check.problems:
        sealed = _seal(store, fmt, index, manifest)
    return VerifyReport(
        path=store.url, format=fmt, ok=not check.problems, committed=committed, sealed=sealed,
        deep=deep, files_checked=len(actual), bytes_hashed=check.bytes_hashed,
        tensors=len(index.tensors) if index else 0, pieces_read=check.pieces_read,
        problems=check.problems, warnings=check.warnings)


def _check_manifest(check: _Check, manifest: Manifest, actual: dict[str, int], strict: bool,
                    workers: int, progress: Progress | None,
                    scans: dict[str, Callable[[], FileScan]] | None = None,
                    read: set[str] = frozenset()) -> None:
    mismatched = manifest.size_mismatches(actual)
    for entry, size in mismatched.values():
        if size is None:
            check.add("missing", "file listed in the manifest is missing", entry.path)
        else:
            what = "truncated" if size < entry.size else "longer than recorded"
            check.add("size", f"file is {what}: {size} bytes, manifest says {entry.size}", entry.path)
    to_hash = [e for e in manifest.files if e.path not in mismatched]
    hashes = hash_files(check.store, [e.path for e in to_hash], workers=workers, progress=progress,
                        scans=scans, sizes=actual)
    check.scanned.update(e.path for e in to_hash)
    for entry in to_hash:
        size, digest = hashes[entry.path]
        check.bytes_hashed += size
        if digest != entry.xxh3_128:
            check.add("checksum", "checksum mismatch: the file changed after it was committed",
                      entry.path)
    listed = manifest.file_map()
    for rel in sorted(actual):
        if rel == MANIFEST or rel in listed:
            continue
        if rel in read:  # a file the checkpoint is read through (data, metadata), whose bytes no hash covers
            check.add("unlisted", "the checkpoint reads this file, which is not in the manifest, so no "
                                  "checksum covers its bytes (the manifest was edited, or the file "
                                  "added after the commit)", rel)
            continue
        problem = Problem("extra", "unexpected file, not in the manifest", check.store.display(rel))
        (check.problems if strict else check.warnings).append(problem)


def _check_structure(check: _Check, index: CheckpointIndex, actual: dict[str, int]) -> None:
    for rel, least in sorted(index.files.items()):
        if rel in check.bad_files:
            continue
        size = actual.get(rel)
        if size is None:
            check.add("missing", "data file named by the checkpoint metadata is missing", rel)
        elif size < least:
            check.add("size", f"data file is truncated: {size} bytes, metadata needs {least}", rel)
    for key, tensor in index.tensors.items():
        coverage = coverage_problems(tensor.shape, [p.region for p in tensor.pieces])
        for text in coverage.problems:
            check.add("coverage", text, key=key)


@dataclass
class _DeepPlan:
    """What ``--deep`` reads. Pieces stored as plain bytes are scanned per file while the
    files are hashed: one pass over the bytes, no torch. The rest go through the reader.

    Where each piece's bytes are is found per file, by the worker that hashes the file, just
    before it does (:meth:`planner`): finding them opens each piece's archive (Python, holding
    the GIL), which then runs beside the other workers' hashing (C, without it)."""

    store: Store
    reader: Reader
    files: dict[str, list] = field(default_factory=dict)  # file -> (key, piece, dtype) it holds
    scans: dict[str, FileScan] = field(default_factory=dict)  # filled as files are planned
    spanned: dict[str, int] = field(default_factory=dict)  # file -> pieces the scan reads
    pieces: list = field(default_factory=list)  # (key, piece, dtype) read through the reader
    errors: list = field(default_factory=list)  # (file, CkptoolError) found while planning

    def planner(self, rel: str) -> Callable[[], FileScan]:
        return lambda: self._plan_file(rel)

    def _plan_file(self, rel: str) -> FileScan:
        spans, local, spanned = [], self.store.is_local, 0
        for key, piece, dtype in self.files[rel]:
            try:
                where = self.reader.raw_span(self.store, piece, dtype) if local else None
            except CkptoolError as exc:
                self.errors.append((rel, exc))
                continue
            if where is None:
                self.pieces.append((key, piece, dtype))
                continue
            spanned += 1
            kind = float_kind(dtype)
            if kind:  # integers are read back by the pass alone: their bytes hold no NaN
                spans.append(Span(where[1], piece.region.numel * dtype.itemsize, kind, key))
        self.spanned[rel] = spanned
        scan = self.scans[rel] = FileScan(spans)
        return scan


def _plan_deep(store: Store, reader: Reader, index: CheckpointIndex) -> _DeepPlan:
    plan = _DeepPlan(store, reader)
    for key, tensor in index.tensors.items():
        for piece in tensor.pieces:
            found = plan.files.get(piece.location.file)
            if found is None:
                found = plan.files[piece.location.file] = []
            found.append((key, piece, tensor.dtype))
    return plan


def _torch_pieces(plan: _DeepPlan, index: CheckpointIndex) -> None:
    """The pieces the scan could not read in place, again from ``index`` (read with torch
    loaded, so that its dtypes and the reader's archives are torch's)."""
    wanted = {(p.region, p.location.file, p.location.offset) for _, p, _ in plan.pieces}
    plan.pieces = [(key, p, t.dtype) for key, t in index.tensors.items() for p in t.pieces
                   if (p.region, p.location.file, p.location.offset) in wanted]


def _check_deep(check: _Check, reader: Reader, index: CheckpointIndex, plan: _DeepPlan,
                progress: Progress | None, workers: int = 2) -> None:
    store = check.store
    counts: dict[str, list[int]] = {}
    for rel, scan in plan.scans.items():
        if rel in check.bad_files:  # condemned already (missing, truncated, changed)
            continue
        check.pieces_read += plan.spanned[rel]
        for span in scan.spans:
            c = counts.setdefault(span.tag, [0, 0])
            c[0] += span.nan
            c[1] += span.inf
        for span in scan.unfinished():
            check.add("size", "data file ends inside a stored piece", rel, span.tag)
    for rel, exc in plan.errors:
        if rel not in check.bad_files:
            check.add_error(exc, "unreadable")

    def scan(item):
        key, piece, dtype = item
        try:
            data = reader.read_piece(store, piece, dtype)
        except CkptoolError as exc:
            return key, exc, 0, 0, 0
        nan = inf = 0
        # Fast path: NaN and Inf propagate through a sum (20x cheaper than isfinite). A sum
        # that merely overflows falls through to the exact count, which then finds none.
        if data.is_floating_point() and data.numel() and not bool(torch.isfinite(data.sum())):
            nan, inf = int(torch.isnan(data).sum()), int(torch.isinf(data).sum())
        return key, None, nan, inf, data.numel() * data.element_size()

    items = [item for item in plan.pieces if item[1].location.file not in check.bad_files]
    # Reading and scanning release the GIL: pieces go through a small thread pool, in order.
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        for key, error, nan, inf, nbytes in pool.map(scan, items):
            if error is not None:
                check.add_error(error, "unreadable")
                continue
            check.pieces_read += 1
            if progress:
                progress(nbytes)
            c = counts.setdefault(key, [0, 0])
            c[0] += nan
            c[1] += inf
    _check_replicas(check, reader, index)
    for key in index.tensors:
        nan, inf = counts.get(key, (0, 0))
        if nan or inf:
            check.add("nonfinite", f"tensor holds {nan} NaN and {inf} Inf values "
                      f"(of {math.prod(index.tensors[key].shape)})", key=key)


def _check_objects(check: _Check, reader: Reader, index: CheckpointIndex) -> None:
    """Every stored non-tensor entry reads (through the one unpickler: nothing is run)."""
    for obj in index.objects.values():
        if obj.location is None or obj.location.file in check.bad_files:
            continue
        try:
            reader.read_object(check.store, obj)
        except CkptoolError as exc:
            check.add_error(exc, "unreadable")


def _check_pickles(check: _Check, reader: Reader) -> None:
    """A pickle that names a global outside the allowlist is a finding (never run)."""
    if trusted():
        return
    for finding in reader.unsafe_pickles():
        check.add_error(finding.error(), "pickle")


def _check_replicas(check: _Check, reader: Reader, index: CheckpointIndex) -> None:
    """Every stored replica must equal the primary copy of the same region."""
    for key, tensor in index.tensors.items():
        if not tensor.replicas:
            continue  # no index to build: 20k tensors of an optimizer have none
        sources, boxes = [p.region for p in tensor.pieces], tensor.box_index()
        for replica in tensor.replicas:
            if replica.location.file in check.bad_files:
                continue
            try:
                copy = reader.read_piece(check.store, replica, tensor.dtype)
                for c in plan_copies(sources, [replica.region], boxes):
                    primary = reader.read_box(check.store, tensor.pieces[c.src], tensor.dtype, c.box)
                    if not torch.equal(primary.reshape(c.box[1]), replica.region.view(copy, c.box)):
                        check.add("replica", "replica differs from the primary copy",
                                  replica.location.file, key)
                        break
            except CkptoolError as exc:
                check.add_error(exc, "unreadable")


def _seal(store: Store, fmt: str, index: CheckpointIndex | None, manifest: Manifest | None) -> bool:
    if manifest is not None:
        return False  # already committed; nothing to do
    if index is not None and index.written_by_ckptool:
        raise UsageError("refusing to seal a checkpoint that ckptool wrote but never committed",
                         path=store.url, hint="Its writer died; use an older checkpoint")
    files = [f for f in store.files() if f != MANIFEST and not is_temporary(f)]
    fields = {}
    if index is not None:
        fields = dict(iteration=index.iteration, model_config=index.model_config,
                      true_vocab_size=index.true_vocab_size, format_version=index.format_version,
                      topology=index.topology.to_dict() if index.topology else None)
    write_manifest(store, build_manifest(store, fmt, files=files, sealed=True, **fields))
    return True
