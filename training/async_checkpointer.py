"""``AsyncCheckpointer``: save without stalling training; commit only what is whole.

``save(step, state)`` copies this rank's shards into host buffers that are reused from
save to save (the only stall), then returns. A background thread writes the rank's DCP
file (hashing while writing, then fsync) into ``step_XXXXXXXX.tmp-<id>/`` under the run
root. The ranks then agree over a gloo side group, never the training process group:
when every rank's data is durable, rank 0 writes ``.metadata`` and ``ckptool.json`` last
and renames the directory into place. A failed write on any rank commits nothing and is
raised by the next ``save()`` or ``wait()``. The result is a plain DCP checkpoint:
``torch.distributed.checkpoint.load`` reads it at any world size.
"""

from __future__ import annotations

import atexit
import io
import logging
import operator
import os
import re
import threading
import uuid
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ckptool.checkpoints.latest import UNFINISHED, latest
from ckptool.checkpoints.open import (
    abandoned,
    candidates,
    iteration_from_name,
    open_checkpoint,
    require_committed,
)
from ckptool.core.dcpfile import METADATA
from ckptool.core.dcpwrite import DcpFileWriter, FileRecord, write_metadata
from ckptool.core.engine import check_fill, fill_into
from ckptool.core.errors import BadCheckpoint, CkptoolError, NoCheckpoint
from ckptool.core.manifest import MANIFEST, FileEntry, Manifest, write_manifest
from ckptool.core.safe_pickle import trusted
from ckptool.core.storage import Store, is_temporary
from ckptool.core.regions import Region, Shard
from ckptool.core.torchfile import writable_dtypes
from training.state import (
    Owned,
    Sharded,
    boxes,
    describe,
    dotted,
    dtensor_entry,
    flatten,
    is_dtensor,
    set_leaf,
)

logger = logging.getLogger(__name__)
RESAVE_MARK = ".ckptool-resaving"
"""On an object store, the object a re-save of a committed step leaves in its prefix until the
new save commits (:meth:`AsyncCheckpointer._target_name`)."""

STEP_DIR = "step_{:08d}"
_STEP = re.compile(r"^step_\d{8,}$")
"""The hook's own checkpoints: the only ones ``keep_last`` counts and deletes (a user's
``ckptool convert run/step_00000100 run/hf-100`` beside them is never touched)."""
_TMP_STEP = re.compile(r"^step_(\d{8,})\.tmp-[0-9a-f]+$")


@dataclass
class _Chunk:
    key: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    host: torch.Tensor
    """A view of the staging buffer."""


@dataclass
class _RankResult:
    """What one rank reports to rank 0 after writing (or failing)."""

    error: str | None
    file: str | None = None
    size: int = 0
    digest: str = ""
    record: FileRecord | None = None
    shapes: dict | None = None


class AsyncCheckpointer:
    """Asynchronous, atomic, checksummed DCP checkpoints under ``root`` (a path or fsspec URL)."""

    def __init__(self, root: str, keep_last: int = 3, process_group=None, *,
                 topology: dict | None = None, model_config: dict | None = None,
                 true_vocab_size: int | None = None, writer: str = "thread"):
        if keep_last is not None and (type(keep_last) is not int or keep_last < 1):
            raise ValueError(f"keep_last must be an int of at least 1 (or None to keep everything), "
                             f"not {keep_last!r}")
        if writer not in ("thread", "process"):
            raise ValueError("writer must be 'thread' or 'process'")
        # "process": a persistent writer process per rank hashes and writes from shared-memory
        # staging buffers, so the write competes less with training for the GIL
        # (benchmarks/writer_thread_vs_process.py); "thread" needs no extra process.
        self._writer = _ProcessWriter() if writer == "process" else None
        self.root = Store.open(str(root))
        self.keep_last = keep_last
        # Recorded in the manifest so that offline tools know the layout (reshard, convert).
        self.topology, self.model_config = topology, model_config
        self.true_vocab_size = true_vocab_size
        self._pg = process_group
        self._distributed = dist.is_available() and dist.is_initialized()
        self._rank = dist.get_rank(process_group) if self._distributed else 0
        self._world = dist.get_world_size(process_group) if self._distributed else 1
        ranks = dist.get_process_group_ranks(process_group) if self._distributed and process_group \
            else None
        # Coordination runs on its own gloo group so the training group (NCCL) never blocks.
        self._side = dist.new_group(ranks=ranks, backend="gloo") if self._distributed else None
        self._buffers: dict[tuple, tuple] = {}  # (key, shape, dtype) -> (buffer, shard, chunks, pinned)
        self._registered: list[torch.Tensor] = []  # shared buffers page-locked by us
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_committed: str | None = None
        atexit.register(_finish_at_exit, weakref.ref(self))

    # ------------------------------------------------------------------ public API

    def save(self, step: int, state: dict) -> None:
        """Stage this rank's shards in host memory and return; writing continues behind."""
        # checked on every rank before any collective (an error on rank 0 alone hung the others);
        # a numpy integer is a step too
        try:
            valid = not isinstance(step, bool) and operator.index(step) >= 0
        except TypeError:
            valid = False
        if not valid:
            raise ValueError(f"step must be a non-negative integer, not {step!r}")
        step = operator.index(step)
        self.wait()
        chunks, objects = self._stage(state)
        name = self._agree(self._target_name(step) if self._rank == 0 else None)
        self._thread = threading.Thread(target=self._write, args=(step, name, chunks, objects),
                                        name="ckptool-async-save", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Wait for the last save, then stop the writer process (if any)."""
        try:
            self.wait()
        finally:
            try:
                if self._writer is not None:
                    self._writer.close()
            finally:
                for buf in self._registered:
                    torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
                self._registered.clear()
                self._buffers.clear()

    def wait(self) -> None:
        """Block until the last save is committed; raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def load_latest(self, state: dict, root: str | None = None) -> int | None:
        """Fill ``state`` in place from the newest checkpoint that verifies; its step, or None.

        Every local box is read from whichever stored chunks overlap it, so the checkpoint
        may come from any number of ranks in any layout. ``root`` loads from another run
        root (e.g. one resharded offline) instead of this checkpointer's.
        """

        found = None  # rank 0's answer for every rank: a path, None, or why none is loadable
        if self._rank == 0:
            try:
                found = latest(str(root) if root else self.root.url).path
            except NoCheckpoint as exc:
                skipped = [k for k in getattr(exc, "skipped", []) if k.reason != UNFINISHED]
                found = None if not skipped else ("error", (
                    f"no checkpoint under {exc.path} can be loaded: {len(skipped)} skipped, the newest "
                    f"{skipped[0].path}: {skipped[0].reason}"))
        found = self._broadcast(found)
        if isinstance(found, tuple):  # saves exist and none loads: never a fresh start (step 0)
            raise NoCheckpoint(found[1], hint="Fix or remove them (ckptool latest ROOT lists why); "
                                              "load_latest returns None only where nothing was saved")
        if found is None:
            return None
        try:
            step, error = load(found, state, self._rank), None
        except Exception as exc:  # noqa: BLE001 - every rank must reach the agreement
            step, error = None, exc
        self._share_failure(error, found)
        return step

    def _share_failure(self, error: Exception | None, path: str) -> None:
        """Raise on every rank if the load failed on any: a rank that returned while another
        raised would go on training and hang in its next collective."""
        if self._distributed:
            shared = error if isinstance(error, CkptoolError) else \
                (None if error is None else f"{type(error).__name__}: {error}")
            out = [None] * self._world
            dist.all_gather_object(out, shared, group=self._side)
            if error is None:
                rank, first = next(((r, e) for r, e in enumerate(out) if e is not None), (None, None))
                if first is not None:
                    if isinstance(first, CkptoolError):
                        first.message = f"rank {rank} could not load the checkpoint: {first.message}"
                        first.args = (first.message,)
                        raise first
                    raise BadCheckpoint(f"rank {rank} could not load the checkpoint: {first}", path=path)
        if error is not None:
            raise error

    # ------------------------------------------------------------------ staging

    def _stage(self, state: dict) -> tuple[list[_Chunk], dict[str, Any]]:
        """Copy this rank's primary tensors into the staging buffers; the chunks to write and
        the pickled objects. A leaf's plan (its buffer and the chunk views into it) is kept
        from save to save while its key, shape, dtype and shard stay the same, so a save of
        many small tensors costs one copy each, not a re-planning."""
        with torch.no_grad():  # staging copies are not part of any graph
            return self._stage_leaves(state)

    def _stage_leaves(self, state: dict) -> tuple[list[_Chunk], dict[str, Any]]:
        chunks, objects, pinned, used = [], {}, False, set()
        for path, value in flatten(state):
            if isinstance(value, Sharded):
                local, shard, writes = value.local, value.shard, not value.replica
            elif is_dtensor(value):
                entry = dtensor_entry(path, value)
                local, shard, writes = entry.local, entry.shard, entry.writes
            elif isinstance(value, torch.Tensor):  # replicated: rank 0 writes it
                local, shard, writes = value, None, self._rank == 0
            else:
                # non-tensors are replicated: rank 0 keeps them (as DCP does), unless Owned says
                if isinstance(value, Owned):
                    value, keeps = value.value, not value.replica
                else:
                    keeps = self._rank == 0
                if keeps:
                    data = io.BytesIO()
                    torch.save(value, data)
                    objects[dotted(path)] = data.getvalue()
                continue
            if local.dtype not in writable_dtypes():  # on every rank, before any collective
                kinds = ", ".join(sorted(str(d).removeprefix("torch.") for d in writable_dtypes()))
                raise ValueError(f"state entry {dotted(path)!r} is a {local.dtype} tensor, which ckptool "
                                 f"does not write yet (it writes {kinds})")
            if not writes:
                continue
            key = dotted(path)
            slot = (key, tuple(local.shape), local.dtype)
            plan = self._buffers.get(slot)
            if plan is None or plan[1] != shard:
                buf = plan[0] if plan is not None else self._host_buffer(local.detach())
                layout = shard if shard is not None else Shard.of(Region.whole(key, local.shape))
                plan = self._buffers[slot] = (buf, shard, [_Chunk(*box) for box in boxes(layout, buf)],
                                              buf.is_pinned())
            plan[0].copy_(local, non_blocking=local.is_cuda)
            chunks += plan[2]
            pinned = pinned or plan[3]
            used.add(slot)
        if pinned:
            torch.cuda.synchronize()
        self._drop_buffers(used)
        return chunks, objects

    def _drop_buffers(self, used: set) -> None:
        """Free the staging buffers of entries this save no longer holds (a key dropped, a
        tensor resized): the last save was written, none is in flight."""
        for slot in [s for s in self._buffers if s not in used]:
            buf = self._buffers.pop(slot)[0]
            for i, registered in enumerate(self._registered):
                if registered is buf:
                    torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
                    del self._registered[i]
                    break

    def _host_buffer(self, like: torch.Tensor) -> torch.Tensor:
        """A staging buffer for ``like``, kept for the next save.

        Page-locked when ``like`` is on a GPU, so the device-to-host copy runs at full speed
        and asynchronously (one synchronize at the end of staging); in shared memory when a
        writer process reads it, then page-locked in place with cudaHostRegister.
        """
        cuda = like.is_cuda and torch.cuda.is_available()
        shared = self._writer is not None
        buf = torch.empty(like.shape, dtype=like.dtype, pin_memory=cuda and not shared)
        if shared:
            buf.share_memory_()  # the writer process reads it in place
            nbytes = buf.untyped_storage().nbytes()
            if cuda and nbytes:
                try:
                    torch.cuda.check_error(
                        torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 0))
                    self._registered.append(buf)
                except RuntimeError as exc:  # still correct, only slower
                    logger.warning("could not page-lock a shared staging buffer (%s); "
                                   "device-to-host copies will be slower", exc)
        return buf

    # ------------------------------------------------------------------ writing

    def _write(self, step: int, name: str, chunks: list[_Chunk], objects: dict[str, bytes]) -> None:
        result = _RankResult(error=None)
        tmp = self.root.child(name)
        try:
            jobs = [(c.key, c.offsets, c.lengths, c.host) for c in chunks]
            write = self._writer.write if self._writer is not None else write_rank_file
            size, digest, record = write(tmp.url, f"__{self._rank}_0.distcp", jobs, objects)
            result = _RankResult(None, record.path, size, digest, record,
                                 {c.key: (c.global_shape, c.host.dtype) for c in chunks})
        except BaseException as exc:  # noqa: BLE001 - reported to every rank, raised on wait()
            result = _RankResult(f"rank {self._rank}: {type(exc).__name__}: {exc}")
        try:
            results = self._gather(result)
            committed = None
            if self._rank == 0:
                try:
                    committed = self._commit(step, name, results)
                except BaseException as exc:  # noqa: BLE001 - the others wait for the broadcast
                    committed = f"error: rank 0 commit: {type(exc).__name__}: {exc}"
            committed = self._broadcast(committed)
            if committed is None or committed.startswith("error:"):
                raise OSError(f"checkpoint at step {step} was not committed: "
                              f"{(committed or 'error: unknown')[len('error: '):]}")
            self.last_committed = committed
        except BaseException as exc:  # noqa: BLE001
            self._error = exc

    def _commit(self, step: int, name: str, results: list[_RankResult]) -> str:
        failed = [r.error for r in results if r.error]
        tmp = self.root.child(name)
        if failed:  # every rank has stopped writing: the partial directory can go
            try:
                tmp.fs.rm(tmp.root, recursive=True)
            except Exception as exc:  # noqa: BLE001 - an object store's own errors are not OSError
                logger.warning("[rank 0] could not remove the failed save %s: %s: %s", tmp.url,
                               type(exc).__name__, exc)
            return "error: " + "; ".join(failed)
        try:
            shapes = {}
            for r in results:
                shapes.update(r.shapes)
            size, digest = write_metadata(tmp, shapes, [r.record for r in results])

            files = [FileEntry(r.file, r.size, r.digest) for r in results] + \
                [FileEntry(METADATA, size, digest)]
            manifest = Manifest(format="dcp", files=sorted(files, key=lambda f: f.path),
                                format_version="1.0.0", iteration=step, topology=self.topology,
                                model_config=self.model_config,
                                true_vocab_size=self.true_vocab_size, extra={"writer": "hook"})
            write_manifest(tmp, manifest)
            final = self.root.child(STEP_DIR.format(step))
            if tmp.is_local:
                if final.exists():
                    final.fs.rm(final.root, recursive=True)
                os.rename(tmp.root, final.root)
            else:  # object stores: written in place; the manifest is the commit marker
                final = tmp
                if final.exists(RESAVE_MARK):  # committed again: the trace goes
                    final.fs.rm(final.path(RESAVE_MARK))
            try:  # the step is committed: pruning older ones that fails is a warning, not a failed save
                self._retain(final)
                if final.is_local:
                    self._sweep(step)
            except Exception as exc:  # noqa: BLE001
                logger.warning("[rank %s] committed %s, but removing older checkpoints failed: %s: %s",
                               self._rank, final.url, type(exc).__name__, exc)
            logger.info("[rank %s] committed %s", self._rank, final.url)
            return final.url
        except BaseException as exc:  # noqa: BLE001
            return f"error: rank 0 commit: {type(exc).__name__}: {exc}"

    def _sweep(self, step: int) -> None:
        """Remove the temporary directories of saves that never committed (a crashed job's)
        for steps up to ``step``, which was just committed: no run can still need them."""
        for name, is_dir in self.root.ls():
            m = _TMP_STEP.match(name)
            if is_dir and m and int(m.group(1)) <= step:
                try:
                    self.root.fs.rm(self.root.path(name), recursive=True)
                except OSError:
                    pass

    def _retain(self, newest: Store) -> None:
        """Delete the hook's committed checkpoints older than its ``keep_last`` newest; never
        others (temporary ones, anything else in the root, such as a user's offline outputs),
        nor the saves of a trajectory the run went back from (:func:`abandoned`: kept for the
        user, skipped by ``latest``)."""
        if not self.keep_last:
            return

        found = candidates(self.root)
        left = abandoned(found)  # another trajectory's: kept, not counted
        committed = [c for c in found if not c.temporary and c.known and c.store.url not in left
                     and _STEP.match(c.store.name) and c.store.exists("ckptool.json")]
        for cand in committed[self.keep_last:]:
            if cand.store.url != newest.url and not is_temporary(cand.store.name):
                cand.store.fs.rm(cand.store.root, recursive=True)

    # ------------------------------------------------------------------ coordination

    def _target_name(self, step: int) -> str:
        """Where this save writes (rank 0 decides). Local: a temporary directory renamed on
        commit. Object stores have no atomic rename: the final prefix itself, emptied first,
        whose manifest, written last, is the commit marker (readers skip it until then)."""
        final = STEP_DIR.format(step)
        if self.root.is_local:
            return f"{final}.tmp-{uuid.uuid4().hex[:12]}"
        target = self.root.child(final)
        if target.exists():  # a re-save of this step after a restart: uncommit it first
            if target.exists(MANIFEST):
                target.fs.rm(target.path(MANIFEST))
                # a trace that a committed save stood here until the new one commits: a job
                # killed meanwhile finds a save that does not load (load_latest raises), not an
                # empty run root (None: a silent restart from step 0 with keep_last=1)
                target.write_bytes(RESAVE_MARK, f"step {step} was committed here and is being "
                                                "saved again\n".encode())
            for name, is_dir in target.ls():
                if name != RESAVE_MARK:
                    target.fs.rm(target.path(name), recursive=is_dir)
        return final

    def _agree(self, value: str) -> str:
        return self._broadcast(value)

    def _broadcast(self, value):
        if not self._distributed:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self._side, 0)
                                   if self._pg is not None else 0, group=self._side)
        return box[0]

    def _gather(self, result: _RankResult) -> list[_RankResult]:
        if not self._distributed:
            return [result]
        out = [None] * self._world
        dist.all_gather_object(out, result, group=self._side)
        return out


def write_rank_file(url: str, name: str, jobs: list, objects: dict[str, bytes]):
    """Write one rank's DCP file (hashing while writing, then fsync): (size, xxh3, record)."""
    store = Store.open(url)
    store.fs.makedirs(store.root, exist_ok=True)
    with DcpFileWriter(store, name) as w:
        for key, offsets, lengths, tensor in jobs:
            w.add_chunk(key, offsets, lengths, tensor)
        for key, data in objects.items():
            w.add_bytes(key, data)
    return w.digest[0], w.digest[1], w.record()


def _writer_main(jobs, results) -> None:
    """The persistent writer process: one rank file per job, until None."""
    torch.set_num_threads(1)
    while True:
        job = jobs.get()
        if job is None:
            return
        try:
            results.put(("ok", write_rank_file(*job)))
        except BaseException as exc:  # noqa: BLE001 - sent back, raised by the trainer
            results.put(("error", f"{type(exc).__name__}: {exc}"))


class _ProcessWriter:
    """A persistent writer process (spawned on first use). Staging buffers live in shared
    memory, so a job carries only tensor handles and metadata."""

    def __init__(self):
        self._proc = None

    def write(self, url: str, name: str, jobs: list, objects: dict[str, bytes]):
        import torch.multiprocessing as mp  # lazy: only the process writer needs it

        if self._proc is None or not self._proc.is_alive():
            ctx = mp.get_context("spawn")
            self._jobs, self._results = ctx.Queue(), ctx.Queue()
            self._proc = ctx.Process(target=_writer_main, args=(self._jobs, self._results),
                                     name="ckptool-writer", daemon=True)
            self._proc.start()
        self._jobs.put((url, name, jobs, objects))
        while True:
            try:
                status, value = self._results.get(timeout=5.0)
                break
            except Exception:  # queue.Empty: check the writer is still there
                if not self._proc.is_alive():
                    raise OSError(f"the writer process died (exit code {self._proc.exitcode})")
        if status == "error":
            raise OSError(value)
        return value

    def close(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            self._jobs.put(None)
            self._proc.join(timeout=30)
        self._proc = None


def _finish_at_exit(ref: "weakref.ref[AsyncCheckpointer]") -> None:
    """At interpreter exit, the save still being written is finished (its writer thread is a
    daemon, which exit would kill: the last save was lost without a word); a failure is logged."""
    ckpt = ref()
    if ckpt is None or ckpt._thread is None:
        return
    logger.info("[rank %s] exiting: finishing the save in flight (call wait() or close() before exit)",
                ckpt._rank)
    try:
        ckpt.wait()
    except BaseException as exc:  # noqa: BLE001 - at exit: say it, never raise
        logger.warning("[rank %s] the save in flight at exit failed: %s", ckpt._rank, exc)


def load(path: str, state: dict, rank: int = 0) -> int | None:
    """Fill ``state`` in place from the checkpoint at ``path``; its step (from the manifest, else the
    directory name of a training save, else None).

    Works for any checkpoint ckptool reads whose global keys match the state's: the
    checkpoint's layout and world size need not be this job's.
    """

    opened = open_checkpoint(path)
    require_committed(opened)
    index = opened.index
    entries, leaves = describe(state, rank)

    def read_box(piece, dtype, box, out_view):
        opened.reader.read_box_into(opened.store, piece, dtype, box, out_view)

    for e in entries:  # every key there at its shape before any tensor is written: no half load
        check_fill(e.shard, index)
    for key in leaves:
        if index.objects.get(key) is None:
            raise BadCheckpoint(f"checkpoint has no entry {key!r}", path=opened.store.url, key=key)
    with torch.no_grad():
        for e in entries:
            if e.local.is_cuda or not e.local.is_contiguous():
                # filled through a dense host copy: views of a channels_last or transposed
                # tensor are copies, and filling them left the parameter as it was
                host = torch.empty(e.local.shape, dtype=e.local.dtype)
                fill_into(e.shard, host, index, read_box)
                e.local.copy_(host)
            else:
                fill_into(e.shard, e.local, index, read_box)
    values = {key: opened.reader.read_object(opened.store, index.objects[key]) for key in leaves}
    found = [] if trusted() else opened.reader.unsafe_pickles()
    if found:  # a class outside the allowlist is never imported (trust_pickle(True) allows it)
        raise found[0].error()
    for key, (path_, _) in leaves.items():
        set_leaf(state, path_, values[key])
    # a checkpoint that records no step (a plain torch DCP save) has it in its name, if anywhere
    return index.iteration if index.iteration is not None else iteration_from_name(opened.store.name)
