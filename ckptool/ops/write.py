"""Writing a planned rewrite: this rank's share of the target files, filled by the engine,
then the commit on rank 0 (the writer's finalize, the manifest, the atomic rename).

A re-run of the same job (:func:`ckptool.ops.journal.resume_key`) keeps the files an
interrupted run finished. Bad input aborts the output; any other failure (interrupted,
storage error) leaves it for a re-run.
"""

from __future__ import annotations

import errno
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Mapping

from ckptool.checkpoints.open import Opened, require_safe_pickles
from ckptool.core.engine import Producer, ScratchPool, TargetFile
from ckptool.core.errors import BadCheckpoint, CkptoolError, OutputFailed
from ckptool.core.index import Writer
from ckptool.core.layout import ModelSpec
from ckptool.core.manifest import FileEntry, Manifest, hash_file, hash_files, write_manifest
from ckptool.core.storage import Store, atomic_output
from ckptool.core.topology import Topology
from ckptool.ops import journal
from ckptool.ops.group import Group


@dataclass(frozen=True, kw_only=True)
class WriteJob:
    """A planned rewrite, ready to write."""

    opened: Opened
    dst: str
    fmt: str
    writer: Writer
    plan: list[TargetFile]
    spec: ModelSpec | None
    target: Topology
    weights_only: bool
    format_options: Mapping[str, Any]
    names: str | None
    true_vocab_size: int | None
    overwrite: bool
    workers: int
    fsync: bool
    verify_source: bool = True
    """Hash SRC's files against its manifest while writing (a source without one has no
    checksums to compare: nothing is hashed)."""


def write_output(job: WriteJob, result, progress: Callable[[int], object] | None = None
                 ) -> tuple[str, int]:
    """Write ``job`` (under torchrun, this rank's share) and commit it on rank 0; returns the
    destination's URL and how many files an interrupted run had finished."""
    group = Group.from_env()
    try:
        return _write(job, group, result, progress)
    finally:
        group.close()


def _write(job: WriteJob, group: Group, result, progress) -> tuple[str, int]:
    opened, writer, index = job.opened, job.writer, job.opened.index
    checked = _check_before_replacing(job, group)
    out = group.on_rank0(lambda: atomic_output(  # the key on rank 0 alone: it lists the source
        job.dst, overwrite=job.overwrite, durable=job.fsync,
        resume_key=journal.resume_key(opened, job.fmt, result, job.format_options, job.weights_only,
                                      job.names, job.true_vocab_size)))
    store = replace(Store.open(out.store.url), durable=job.fsync) if group.rank else out.store
    try:
        done = journal.finished(store)
        produce = _producer(opened, job.plan)
        vocab = job.true_vocab_size or index.true_vocab_size

        def write_one(target: TargetFile) -> tuple[FileEntry, bool]:
            entry = journal.reusable(store, target, done)
            kept = entry is not None
            if kept:
                record = done[target.path][1]
                if record is not None:
                    with journal.LOCK:
                        writer.absorb({target.path: record})
            else:
                try:
                    size, digest = writer.write_file(store, target, produce, index, vocab)
                except OSError as exc:
                    if exc.filename is None and exc.errno in _STORAGE_REFUSED:  # a write names no file
                        exc.filename = f"{store.url.rstrip('/')}/{target.path}"
                    raise
                finally:
                    produce.file_done()
                entry = FileEntry(target.path, size, digest)
                journal.record(store, group.rank, entry, writer.records().get(target.path))
            if progress:
                progress(target.nbytes)
            return entry, kept

        mine = job.plan[group.rank::group.world]
        error = None
        check = SourceCheck(opened, group) if job.verify_source and not checked else None
        try:
            if check is not None:
                check.start()
            with ThreadPoolExecutor(max_workers=max(1, job.workers)) as pool:
                written = list(pool.map(write_one, mine))
        except BaseException as exc:  # noqa: BLE001 - every rank must reach the gather
            written, error = None, exc
        if check is not None:
            if error is None or isinstance(error, Exception):
                check.join(group)  # a source that does not match its manifest fails every rank
            else:
                check.cancel()  # interrupted: no collective, no wait
        entries, reused = group.gather_entries(written, error)
        group.gather_records(writer)
        if group.rank:
            group.wait_commit()
            return job.dst, reused
        _commit(job, group, out, store, entries)
    except CkptoolError:
        if group.rank == 0:
            out.abort()  # bad input: nothing worth resuming
        raise
    except OSError as exc:
        if exc.errno not in _STORAGE_REFUSED:
            raise
        raise _refused(exc, store, len(job.plan)) from None
    return out.final.url, reused


def _check_before_replacing(job: WriteJob, group: Group) -> bool:
    """``--overwrite`` of an object store's DST: the output is written in place, so the old DST
    is deleted before the first byte. Everything that can refuse the source (its hashes, its
    pickles) is checked first, so a refusal keeps the old DST. True when the source's hashes
    were checked here."""
    dst = Store.open(job.dst)
    if not job.overwrite or dst.is_local or not dst.exists():
        return False
    require_safe_pickles(job.opened)
    if not job.verify_source:
        return False
    check = SourceCheck(job.opened, group)
    check.start()
    check.join(group)
    return True


_STORAGE_REFUSED = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}
"""Errors only a write raises: the destination, never the source (kept for a re-run)."""


def _refused(exc: OSError, store: Store, planned: int) -> OutputFailed:
    """One line for a write the destination's storage refused: which file, what is kept, and
    how to go on (a quota hit at 90 % of a 4 TB rewrite must not cost the 90 %)."""
    try:
        finished = len(journal.finished(store))
    except Exception:  # noqa: BLE001 - the journal is on the same full storage
        finished = 0
    return OutputFailed(
        f"the destination's storage refused a write: {exc.strerror or exc}",
        path=exc.filename or store.url,
        hint=f"{finished} of {planned} target files are finished and kept in {store.url}: free "
             f"space (or raise the quota) and re-run the same command to resume, or delete "
             f"{store.url} to start over")


class SourceCheck:
    """The source's files hashed against its manifest while the output is written, each
    rank its share, in a thread beside the writers: a reshard of a checkpoint corrupted on
    the disk would otherwise seal the damage under a fresh, valid manifest. The bytes the
    engine reads are a second read of files the check hashes whole (the page cache serves
    one of the two where the source fits in it)."""

    def __init__(self, opened: Opened, group: Group):
        entries = sorted(opened.manifest.files if opened.manifest is not None else [],
                         key=lambda e: (-e.size, e.path))  # the largest dealt first: shares even
        self.store, self.entries = opened.store, entries[group.rank::group.world]
        self.problem: str | None = None
        self._stop = threading.Event()  # a writer interrupted (Ctrl-C): hash no further file
        self._thread = threading.Thread(target=self._run, name="ckptool-source-check", daemon=True)

    def start(self) -> None:
        if self.entries:
            self._thread.start()

    def _run(self) -> None:
        for entry in self.entries:
            if self._stop.is_set():
                return
            try:
                size, digest = hash_file(self.store, entry.path)
            except Exception as exc:  # noqa: BLE001 - gone or unreadable since it was opened
                self.problem = f"{entry.path} cannot be read back to check it: {exc}"
                return
            if size != entry.size or digest != entry.xxh3_128:
                self.problem = (f"{entry.path} does not match the source's manifest (" +
                                (f"{size} bytes, it says {entry.size}" if size != entry.size else
                                 "xxh3-128 differs") + "): the source is corrupt or was changed")
                return

    def join(self, group: Group) -> None:
        """Wait for this rank's share; raise on every rank if any rank's share did not match."""
        if self.entries:
            self._thread.join()
        problem = group.first_problem(self.problem)
        if problem is not None:
            raise BadCheckpoint(problem, path=self.store.url,
                                hint="`ckptool verify SRC` names every damaged file. Nothing was "
                                     "written: use an intact checkpoint (`ckptool latest ROOT` names "
                                     "the newest)")

    def cancel(self) -> None:
        self._stop.set()


def _producer(opened: Opened, plan: list[TargetFile]) -> Producer:
    def read_box(piece, dtype, box, out_view):
        opened.reader.read_box_into(opened.store, piece, dtype, box, out_view)

    def span_of(piece, dtype, box):
        return opened.reader.file_span(opened.store, piece, dtype, box)

    largest = max((math.prod(t.shard.shape) * t.dtype.itemsize for f in plan for t in f.tensors),
                  default=0)
    pool = ScratchPool(max(2 * largest, 256 << 20))  # two of the largest in flight at most
    return Producer(opened.index, read_box, span_of, pool)


def _commit(job: WriteJob, group: Group, out, store: Store, entries: list[FileEntry]) -> None:
    """Rank 0: the writer's last files, the manifest, the atomic commit; every rank learns
    whether it worked."""
    index = job.opened.index
    status = None
    try:
        require_safe_pickles(job.opened)  # files first read while writing were checked too
        extra = job.writer.finalize(store, index)
        for rel, (size, digest) in hash_files(store, extra).items():
            entries.append(FileEntry(rel, size, digest))
        manifest = Manifest(format=job.fmt, files=sorted(entries, key=lambda e: e.path),
                            topology=job.target.to_dict(),
                            model_config=asdict(job.spec) if job.spec is not None else index.model_config,
                            true_vocab_size=job.true_vocab_size or index.true_vocab_size,
                            iteration=index.iteration, format_version=index.format_version)
        if store.is_local:  # inside DST.tmp-KEY, which the rename commits: cleared before it
            journal.clear(store)
        out.commit(lambda s_: write_manifest(s_, manifest))
        if not store.is_local:  # written in place, committed by the manifest: cleared after it,
            journal.clear(store)  # so a run killed before the commit leaves its re-run the key
    except BaseException as exc:
        status = f"rank 0 could not commit: {exc}"
        raise
    finally:
        group.commit_done(status)
