"""``ckptool reshard`` (same format, another TP/PP layout) and ``ckptool convert`` (another
format, and optionally another layout): one rewrite path for both.

The source topology is read from the checkpoint (``--tp/--pp/--dp`` for the source are
assertions). Impossible targets are refused before anything is written. The output is
written through an atomic output: DST appears whole, with its manifest, or not at all.
"""

from __future__ import annotations

import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

import converters
from ckptool.checkpoint import Opened, open_checkpoint, require_safe_pickles, resolve
from ckptool.core.engine import Scratch, ScratchPool, bytes_read, file_spans, fill_tensor
from ckptool.core.errors import CkptoolError, UsageError, UnsupportedFormat
from ckptool.core.layout import check as check_layout
from ckptool.core.manifest import FileEntry, Manifest, hash_files, write_manifest
from ckptool.core.storage import Store, atomic_output, fsync
from converters.hf_schema import refuse_uncarried_config
from converters.megatron_common import refuse_uncarried_args
from converters.megatron_optimizer import state_key

RESHARDABLE = ("megatron", "megatron-dist", "dcp", "deepspeed")
OPTIMIZER_PREFIX = "optimizer."


@dataclass(frozen=True, slots=True)
class PlannedFile:
    path: str
    bytes: int


@dataclass(frozen=True, slots=True)
class ReshardResult:
    source: str
    destination: str
    format: str
    source_topology: dict
    target_topology: dict
    files: list[PlannedFile] = field(default_factory=list)
    bytes_read: int = 0
    bytes_written: int = 0
    dropped: str | None = None
    """State of the source that was left out on request (--drop-optimizer)."""
    notes: list[str] = field(default_factory=list)
    """What whoever resumes from DST must know."""
    seconds: float = 0.0
    dry_run: bool = False
    reused_files: int = 0
    """Target files an interrupted run had finished, checked by hash and kept."""


def reshard(src: str, dst: str, *, to: dict, expect: dict | None = None, workers: int = 1,
            dry_run: bool = False, overwrite: bool = False, true_vocab_size: int | None = None,
            drop_optimizer: bool = False, options: dict | None = None, fsync: bool = True,
            progress: Callable[[int], object] | None = None) -> ReshardResult:
    """Rewrite checkpoint ``src`` at ``dst`` in its own format, the topology changed by ``to``.

    ``to`` maps tp/pp/dp/vpp/zero to target values (missing keys keep the source's);
    ``expect`` holds assertions about the source topology. ``fsync=False`` leaves the
    write-back to the kernel (the commit is still atomic; see ``Store.durable``).
    """
    opened = open_checkpoint(src)
    if opened.format not in RESHARDABLE:
        raise UnsupportedFormat(f"reshard of {opened.format} checkpoints is not implemented yet",
                                path=opened.store.url, hint=f"Supported now: {', '.join(RESHARDABLE)}")
    changes = {k: v for k, v in to.items() if v is not None}
    if not changes and not any(v is not None for v in (options or {}).values()):
        raise UsageError("nothing to change", hint="Give at least one of --to-tp, --to-pp, --to-dp")
    return rewrite(opened, dst, opened.format, to=changes, expect=expect, workers=workers,
                   dry_run=dry_run, overwrite=overwrite, true_vocab_size=true_vocab_size,
                   drop_optimizer=drop_optimizer, progress=progress, fsync=fsync,
                   options={k: v for k, v in (options or {}).items() if v is not None})


def convert(src: str, dst: str, *, to_format: str, to: dict | None = None, workers: int = 1,
            dry_run: bool = False, overwrite: bool = False, true_vocab_size: int | None = None,
            drop_optimizer: bool = False, names: str | None = None, model_family: str | None = None,
            model_config: str | None = None, options: dict | None = None,
            init_optimizer: bool = False, fsync: bool = True,
            progress: Callable[[int], object] | None = None) -> ReshardResult:
    """Write checkpoint ``src`` at ``dst`` in format ``to_format`` (topology per ``to``).

    ``names`` picks the target's tensor-name schema where the format has several (Megatron:
    ``mcore-local``, ``mcore-te``, ``legacy``); by default the source's, else the format's default.
    ``model_family`` names the Hugging Face family (``llama``, ``gpt2``) on whichever side is
    Hugging Face: the source's schema where its reader takes one (hf, DeepSpeed with an HF
    model's names), and the hf output's, checked against the model. ``model_config`` is a
    Hugging Face ``config.json`` for a source that does not say what model it holds (a
    DeepSpeed checkpoint without one beside ``latest``); ``options`` are the target format's
    own (hf: ``max_shard_size``, ``dtype``).
    ``init_optimizer`` gives a weights-only source a fresh optimizer state (fp32 masters,
    zero moments, step 0) where the target format holds one; never done unasked.
    """
    store = resolve(src)
    source_format = converters.require_format(store)
    reads_family = hasattr(converters.reader_class(source_format), "model_family")
    if model_family and not reads_family and to_format != "hf":
        raise UsageError(f"--model-family names a Hugging Face schema, and neither the {source_format} "
                         f"input nor the {to_format} output has one", path=store.url,
                         hint="It applies to hf input or output, and to DeepSpeed checkpoints of HF "
                              "models; drop it")
    opened = open_checkpoint(store, model_family=model_family if reads_family else None,
                             model_config=model_config)
    options = {k: v for k, v in (options or {}).items() if v is not None}
    if model_family and to_format == "hf":
        options["model_family"] = model_family
    return rewrite(opened, dst, to_format, to={k: v for k, v in (to or {}).items() if v is not None},
                   workers=workers, dry_run=dry_run, overwrite=overwrite,
                   true_vocab_size=true_vocab_size, drop_optimizer=drop_optimizer, names=names,
                   options=options, init_optimizer=init_optimizer, progress=progress, fsync=fsync)


def rewrite(opened: Opened, dst: str, fmt: str, *, to: dict, expect: dict | None = None,
            workers: int = 1, dry_run: bool = False, overwrite: bool = False,
            true_vocab_size: int | None = None, drop_optimizer: bool = False,
            names: str | None = None, options: dict | None = None, init_optimizer: bool = False,
            fsync: bool = True, progress: Callable[[int], object] | None = None) -> ReshardResult:
    """The one path for reshard and convert: plan the target files, fill them region by
    region from the source, commit atomically."""
    started = time.perf_counter()
    require_safe_pickles(opened)
    writer = converters.writer(fmt)
    if fmt != opened.format:
        opened = opened.canonical() if writer.canonical_source else opened.native()
    if init_optimizer:
        opened = _fresh_optimizer(opened, writer, drop_optimizer)
    index = opened.index
    source_topo = index.topology
    if source_topo is None:
        raise UsageError("the source does not say what topology it holds",
                         path=opened.store.url, hint="Its format records no args/config")
    for name, value in (expect or {}).items():
        if value is not None and getattr(source_topo, name) != value:
            raise UsageError(f"--{name} {value} does not match the checkpoint, which is "
                             f"{name.upper()}{getattr(source_topo, name)} ({source_topo})",
                             path=opened.store.url, hint=f"Drop --{name} or fix it")
    changes = dict(to)
    if "pp" in changes and "vpp" not in changes and changes["pp"] != source_topo.pp:
        changes["vpp"] = 1
    writer.configure(**(options or {}))
    # nothing that changes the model's math is dropped: each field is carried or refused here
    refuse_uncarried_config(index, fmt)
    refuse_uncarried_args(index, fmt)
    target_topo = writer.target_topology(source_topo, changes)
    uncarried = writer.unsupported_state(index)
    if uncarried and not drop_optimizer:
        raise UsageError(f"the optimizer state cannot be carried: {uncarried}", path=opened.store.url,
                         hint="Pass --drop-optimizer to write the model weights only (resume with "
                              "Megatron's --no-load-optim)")
    writer.bind(opened)
    spec = writer.target_spec(index, source_topo, target_topo, true_vocab_size)
    if spec is not None:
        check_layout(spec, target_topo)
    plan = writer.plan(index, target_topo, spec, schema=names or writer.source_schema(opened),
                       with_optimizer=not drop_optimizer)
    weights_only = drop_optimizer or not writer.holds_optimizer
    _refuse_unwritten(index, plan, fmt, weights_only)
    dropped_tensors = sum(k.startswith(OPTIMIZER_PREFIX) for k in index.tensors) if weights_only else 0
    if dropped_tensors and not uncarried:
        uncarried = f"optimizer state ({dropped_tensors} tensors)"
    result = ReshardResult(
        source=opened.store.url, destination=dst, format=fmt,
        source_topology=source_topo.to_dict(), target_topology=target_topo.to_dict(),
        files=[PlannedFile(f.path, f.nbytes) for f in plan], bytes_read=bytes_read(plan, index),
        bytes_written=sum(f.nbytes for f in plan), dry_run=dry_run,
        dropped=uncarried if weights_only else None, notes=writer.notes(index))
    if dry_run:
        return result

    group = _Group.from_env()
    try:
        return _write_output(opened, dst, fmt, group, writer, plan, index, spec, target_topo, result,
                             options, weights_only, names, true_vocab_size, overwrite, workers,
                             progress, started, fsync)
    finally:
        group.close()


def _write_output(opened, dst, fmt, group, writer, plan, index, spec, target_topo, result, options,
                  weights_only, names, true_vocab_size, overwrite, workers, progress, started, fsync):
    """Write the planned files (this rank's share), then commit on rank 0."""
    key = _resume_key(opened, fmt, result, options, weights_only, names, true_vocab_size)
    out = group.on_rank0(lambda: atomic_output(dst, overwrite=overwrite, resume_key=key, durable=fsync))
    store = replace(Store.open(out.store.url), durable=fsync) if group.rank else out.store
    try:
        def read_box(piece, dtype, box, out_view):
            opened.reader.read_box_into(opened.store, piece, dtype, box, out_view)

        done = _journal(store)
        largest = max((math.prod(t.shard.shape) * t.dtype.itemsize for f in plan for t in f.tensors),
                      default=0)
        buffers = ScratchPool(max(2 * largest, 256 << 20))  # two of the largest in flight at most
        local = threading.local()

        def produce(t):
            if not hasattr(local, "scratch"):
                local.scratch = Scratch(buffers)
            return fill_tensor(t, index, read_box, scratch=local.scratch)

        def span_of(piece, dtype, box):
            return opened.reader.file_span(opened.store, piece, dtype, box)

        # a writer that streams (torchreader.save_target) asks for runs of source files first
        produce.spans = lambda t: file_spans(t, index, span_of)

        def write_one(target):
            entry = _reusable(store, target, done)
            kept = entry is not None
            if kept:
                record = done[target.path][1]
                if record is not None:
                    with _JOURNAL_LOCK:
                        writer.absorb({target.path: record})
            else:
                try:
                    size, digest = writer.write_file(store, target, produce, index,
                                                     true_vocab_size or index.true_vocab_size)
                finally:
                    if hasattr(local, "scratch"):
                        local.scratch.done()  # the file is written: its last buffer is free
                entry = FileEntry(target.path, size, digest)
                _record(store, group.rank, entry, writer.records().get(target.path))
            if progress:
                progress(target.nbytes)
            return entry, kept

        mine = plan[group.rank::group.world]
        error = None
        try:
            with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
                written = list(pool.map(write_one, mine))
        except BaseException as exc:  # noqa: BLE001 - every rank must reach the gather
            written, error = None, exc
        entries, reused = group.gather_entries(written, error)
        group.gather_records(writer)
        if group.rank:
            group.wait_commit()
            return replace(result, destination=dst, reused_files=reused,
                           seconds=time.perf_counter() - started)
        status = None
        try:
            require_safe_pickles(opened)  # files first read while writing were checked too
            extra = writer.finalize(store, index)
            for rel, (size, digest) in hash_files(store, extra).items():
                entries.append(FileEntry(rel, size, digest))
            manifest = Manifest(format=fmt, files=sorted(entries, key=lambda e: e.path),
                                topology=target_topo.to_dict(),
                                model_config=asdict(spec) if spec is not None else index.model_config,
                                true_vocab_size=true_vocab_size or index.true_vocab_size,
                                iteration=index.iteration, format_version=index.format_version)
            _clear_journal(store)
            out.commit(lambda s_: write_manifest(s_, manifest))
        except BaseException as exc:
            status = f"rank 0 could not commit: {exc}"
            raise
        finally:
            group.commit_done(status)
    except CkptoolError:
        if group.rank == 0:
            out.abort()  # bad input: nothing worth resuming
        raise
    # Anything else (interrupted, storage error): the partial output stays for a re-run.
    return replace(result, destination=out.final.url, reused_files=reused,
                   seconds=time.perf_counter() - started)


JOURNAL = ".ckptool-done"
"""Per-rank journals of finished target files (path, size, xxh3) in an unfinished output."""


def _resume_key(opened, fmt, result, options, weights_only, names, true_vocab_size) -> str:
    """Names the job: the same source content, target and options give the same key."""
    import json

    import xxhash

    source = opened.manifest.files if opened.manifest else sorted(opened.index.files.items())
    blob = json.dumps([opened.store.url, [list(map(str, f if isinstance(f, tuple) else
                                                    (f.path, f.size, f.xxh3_128))) for f in source],
                       fmt, result.target_topology, [(f.path, f.bytes) for f in result.files],
                       sorted((options or {}).items()), weights_only, names, true_vocab_size],
                      default=str)
    return xxhash.xxh3_64_hexdigest(blob.encode())


def _journal(store: Store) -> dict[str, tuple[FileEntry, dict | None]]:
    """Finished files of an interrupted run: entry and the writer's record (JSON form)."""
    import json

    done = {}
    for name, is_dir in store.ls():
        if is_dir or not name.startswith(JOURNAL):
            continue
        for line in store.read_bytes(name).decode(errors="replace").splitlines():
            try:
                d = json.loads(line)
                done[d["path"]] = (FileEntry(d["path"], int(d["size"]), d["xxh3_128"]), d.get("record"))
            except (ValueError, KeyError, TypeError):
                continue  # a torn last line of a killed run
    return done


def _reusable(store: Store, target, done: dict) -> FileEntry | None:
    """The journaled entry of ``target`` if the file on storage still hashes to it."""
    from ckptool.core.manifest import hash_file

    entry = done.get(target.path, (None, None))[0]
    if entry is None or not store.exists(target.path):
        return None
    try:
        size, digest = hash_file(store, target.path)
    except OSError:
        return None
    return entry if (size, digest) == (entry.size, entry.xxh3_128) else None


def _record(store: Store, rank: int, entry: FileEntry, record=None) -> None:
    import json

    line = json.dumps({**asdict(entry), "record": record.to_json() if record is not None else None}) + "\n"
    path = f"{JOURNAL}.{rank}"
    with _JOURNAL_LOCK:
        if store.is_local:
            with open(store.path(path), "a") as f:
                f.write(line)
                f.flush()
                if store.durable:
                    fsync(f.fileno())
        else:  # object stores cannot append: rewrite the small journal
            old = store.read_bytes(path) if store.exists(path) else b""
            store.write_bytes(path, old + line.encode())


def _clear_journal(store: Store) -> None:
    from ckptool.core.storage import RESUME_KEY_FILE

    for name, is_dir in store.ls():
        if not is_dir and (name.startswith(JOURNAL) or name == RESUME_KEY_FILE):
            store.fs.rm(store.path(name))


class _Group:
    """The ranks of a ``torchrun ... -m ckptool reshard`` job (one rank without torchrun).

    Target files are dealt round-robin; rank 0 creates the output, and commits once every
    rank has finished. Coordination is over gloo on CPU.
    """

    def __init__(self, rank: int = 0, world: int = 1):
        self.rank, self.world = rank, world

    @classmethod
    def from_env(cls) -> "_Group":
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or "RANK" not in os.environ:
            return cls()
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo")
        return cls(dist.get_rank(), dist.get_world_size())

    def _broadcast(self, value):
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def on_rank0(self, make):
        """``make()`` on rank 0; its result (or its error) on every rank."""
        if self.world == 1:
            return make()
        value = error = None
        if self.rank == 0:
            try:
                value = make()
            except CkptoolError as exc:
                error = exc
        error = self._broadcast(error)
        if error is not None:
            raise error
        url = self._broadcast(value.store.url if self.rank == 0 else None)
        return value if self.rank == 0 else _Remote(url)

    def gather_entries(self, written, error: BaseException | None = None):
        """Every rank's finished entries (and how many were kept from an earlier run);
        raises on every rank if any rank failed."""
        if self.world == 1:
            if error is not None:
                raise error
            return [e for e, _ in written], sum(1 for _, kept in written if kept)
        import torch.distributed as dist

        mine = None if error is not None else \
            ([(e.path, e.size, e.xxh3_128) for e, _ in written], sum(1 for _, kept in written if kept))
        out = [None] * self.world
        dist.all_gather_object(out, mine)
        if error is not None:
            raise error
        failed = [r for r, o in enumerate(out) if o is None]
        if failed:
            raise OSError(f"reshard failed on rank(s) {failed}; their errors are in their logs")
        return [FileEntry(*e) for part, _ in out for e in part], sum(n for _, n in out)

    def gather_records(self, writer) -> None:
        """Rank 0's writer absorbs the per-file records of the files other ranks wrote."""
        if self.world == 1:
            return
        import torch.distributed as dist

        out = [None] * self.world
        dist.all_gather_object(out, writer.records())
        if self.rank == 0:
            for records in out[1:]:
                writer.absorb(records)

    def close(self) -> None:
        """Tear the process group down after the last collective, every rank together (gloo
        aborts a process at exit otherwise, "terminate called without an active exception":
        seen once in CI when one rank tore down while the other still used the connection)."""
        if self.world > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                try:
                    dist.barrier()
                finally:
                    dist.destroy_process_group()

    def commit_done(self, error: str | None = None):
        if self.world > 1:
            self._broadcast(error or "committed")

    def wait_commit(self):
        status = self._broadcast(None)
        if status != "committed":
            raise OSError(status)


class _Remote:
    """What ranks other than 0 know of the output: where to write."""

    def __init__(self, url: str):
        self.store = Store.open(url)


_JOURNAL_LOCK = threading.Lock()


def _fresh_optimizer(opened: Opened, writer, drop_optimizer: bool) -> Opened:
    """``--init-optimizer``: a fresh optimizer state for a weights-only source."""
    from converters.megatron_optimizer import with_fresh_state

    if drop_optimizer:
        raise UsageError("--init-optimizer and --drop-optimizer contradict each other")
    if not writer.fresh_optimizer:
        raise UsageError(f"--init-optimizer does not apply to {writer.name} output",
                         hint="Megatron builds a fresh optimizer itself when it loads weights only "
                              "(--finetune or --no-load-optim); a DCP job builds its own. "
                              "Supported: deepspeed")
    held = sum(k.startswith(OPTIMIZER_PREFIX) for k in opened.index.tensors)
    if held or opened.index.unmapped:
        raise UsageError(f"the source holds optimizer state already ({held} tensors); "
                         "--init-optimizer would replace it", path=opened.store.url,
                         hint="Drop --init-optimizer to carry the source's state")
    return with_fresh_state(opened)


def _refuse_unwritten(index, plan, fmt: str, drop_optimizer: bool) -> None:
    """Never drop source tensors silently: each must land in some target file, unless it is
    optimizer state and the user asked to drop it."""
    used = {r.key for f in plan for t in f.tensors for r in t.shard.regions}
    used |= {k for k in index.tensors if state_key("fp32_param", k) in used}  # masters stood in
    left = sorted(k for k in index.tensors if k not in used
                  and not (drop_optimizer and k.startswith(OPTIMIZER_PREFIX)))
    if not left:
        return
    optimizer = all(k.startswith(OPTIMIZER_PREFIX) for k in left)
    raise UsageError(
        f"{len(left)} source tensors have no place in the {fmt} output, e.g. {', '.join(left[:3])}"
        + (" (optimizer state this writer cannot lay out from this source)" if optimizer else ""),
        path=index.url,
        hint="Pass --drop-optimizer to write the model weights only" if optimizer else
        "Convert to a format that holds them (dcp keeps every tensor)")


__all__ = ["reshard", "convert", "rewrite", "ReshardResult", "PlannedFile"]
