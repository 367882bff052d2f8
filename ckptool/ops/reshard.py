"""``ckptool reshard`` (same format, another TP/PP layout) and ``ckptool convert`` (another
format, and optionally another layout): one rewrite path for both.

The source topology is read from the checkpoint (``--tp/--pp/--dp`` for the source are
assertions). Impossible targets are refused before anything is written. The output is
written through an atomic output: DST appears whole, with its manifest, or not at all.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

import converters
from ckptool.checkpoint import Opened, open_checkpoint
from ckptool.core.engine import bytes_read, fill_tensor
from ckptool.core.errors import UsageError, UnsupportedFormat
from ckptool.core.layout import check as check_layout
from ckptool.core.manifest import FileEntry, Manifest, hash_files, write_manifest
from ckptool.core.storage import atomic_output

RESHARDABLE = ("megatron", "megatron-dist", "dcp")
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


def reshard(src: str, dst: str, *, to: dict, expect: dict | None = None, workers: int = 1,
            dry_run: bool = False, overwrite: bool = False, true_vocab_size: int | None = None,
            drop_optimizer: bool = False,
            progress: Callable[[int], object] | None = None) -> ReshardResult:
    """Rewrite checkpoint ``src`` at ``dst`` in its own format, the topology changed by ``to``.

    ``to`` maps tp/pp/dp/vpp/zero to target values (missing keys keep the source's);
    ``expect`` holds assertions about the source topology.
    """
    opened = open_checkpoint(src)
    if opened.format not in RESHARDABLE:
        raise UnsupportedFormat(f"reshard of {opened.format} checkpoints is not implemented yet",
                                path=opened.store.url, hint=f"Supported now: {', '.join(RESHARDABLE)}")
    changes = {k: v for k, v in to.items() if v is not None}
    if not changes:
        raise UsageError("nothing to change", hint="Give at least one of --to-tp, --to-pp, --to-dp")
    return rewrite(opened, dst, opened.format, to=changes, expect=expect, workers=workers,
                   dry_run=dry_run, overwrite=overwrite, true_vocab_size=true_vocab_size,
                   drop_optimizer=drop_optimizer, progress=progress)


def convert(src: str, dst: str, *, to_format: str, to: dict | None = None, workers: int = 1,
            dry_run: bool = False, overwrite: bool = False, true_vocab_size: int | None = None,
            drop_optimizer: bool = False, names: str | None = None, model_family: str | None = None,
            options: dict | None = None,
            progress: Callable[[int], object] | None = None) -> ReshardResult:
    """Write checkpoint ``src`` at ``dst`` in format ``to_format`` (topology per ``to``).

    ``names`` picks the target's tensor-name schema where the format has several (Megatron:
    ``mcore-local``, ``mcore-te``, ``legacy``); by default the source's, else the format's default.
    ``model_family`` names the Hugging Face family (``llama``, ``gpt2``) where it cannot be
    inferred; ``options`` are the target format's own (hf: ``max_shard_size``, ``dtype``).
    """
    opened = open_checkpoint(src, model_family=model_family)
    options = {k: v for k, v in (options or {}).items() if v is not None}
    if model_family and to_format == "hf":
        options["model_family"] = model_family
    return rewrite(opened, dst, to_format, to={k: v for k, v in (to or {}).items() if v is not None},
                   workers=workers, dry_run=dry_run, overwrite=overwrite,
                   true_vocab_size=true_vocab_size, drop_optimizer=drop_optimizer, names=names,
                   options=options, progress=progress)


def rewrite(opened: Opened, dst: str, fmt: str, *, to: dict, expect: dict | None = None,
            workers: int = 1, dry_run: bool = False, overwrite: bool = False,
            true_vocab_size: int | None = None, drop_optimizer: bool = False,
            names: str | None = None, options: dict | None = None,
            progress: Callable[[int], object] | None = None) -> ReshardResult:
    """The one path for reshard and convert: plan the target files, fill them region by
    region from the source, commit atomically."""
    started = time.perf_counter()
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
    writer = converters.writer(fmt)
    writer.configure(**(options or {}))
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

    out = atomic_output(dst, overwrite=overwrite)
    try:
        def read_box(piece, dtype, box, out_view):
            opened.reader.read_box_into(opened.store, piece, dtype, box, out_view)

        def write_one(target):
            size, digest = writer.write_file(out.store, target,
                                             lambda t: fill_tensor(t, index, read_box), index,
                                             true_vocab_size or index.true_vocab_size)
            if progress:
                progress(target.nbytes)
            return FileEntry(target.path, size, digest)

        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            entries = list(pool.map(write_one, plan))
        extra = writer.finalize(out.store, index)
        for rel, (size, digest) in hash_files(out.store, extra).items():
            entries.append(FileEntry(rel, size, digest))
        manifest = Manifest(format=fmt, files=sorted(entries, key=lambda e: e.path),
                            topology=target_topo.to_dict(),
                            model_config=asdict(spec) if spec is not None else index.model_config,
                            true_vocab_size=true_vocab_size or index.true_vocab_size,
                            iteration=index.iteration, format_version=index.format_version)
        out.commit(lambda store: write_manifest(store, manifest))
    except BaseException:
        out.abort()
        raise
    return replace(result, destination=out.final.url, seconds=time.perf_counter() - started)


def _refuse_unwritten(index, plan, fmt: str, drop_optimizer: bool) -> None:
    """Never drop source tensors silently: each must land in some target file, unless it is
    optimizer state and the user asked to drop it."""
    used = {r.key for f in plan for t in f.tensors for r in t.shard.regions}
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
