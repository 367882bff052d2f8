"""``ckptool reshard`` (same format, another TP/PP layout) and ``ckptool convert`` (another
format, and optionally another layout): one rewrite path for both.

The source topology is read from the checkpoint (``--tp/--pp/--dp`` for the source are
assertions). Impossible targets are refused before anything is written. The plan is made
here; :mod:`ckptool.ops.write` writes it through an atomic output: DST appears whole, with
its manifest, or not at all.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Callable, Mapping

import converters
from ckptool.checkpoints.open import (
    Opened,
    open_checkpoint,
    require_committed,
    require_safe_pickles,
    resolve,
)
from ckptool.core.engine import bytes_read
from ckptool.core.errors import UnsupportedFormat, UsageError
from ckptool.core.gcpause import paused_gc
from ckptool.core.layout import check as check_layout
from ckptool.core.optimizer import FreshReader, fresh_state, is_optimizer_key, state_key
from ckptool.core.progress import step as progress_step
from ckptool.core.storage import overlap
from ckptool.ops.write import WriteJob, write_output
from converters.schemas.hf import refuse_uncarried_config
from converters.schemas.megatron_args import refuse_contradicted, refuse_uncarried_args


@dataclass(frozen=True, kw_only=True)
class RewriteOptions:
    """Everything ``reshard`` and ``convert`` take besides SRC and DST (the CLI builds one)."""

    to: Mapping[str, int] = field(default_factory=dict)
    """Target topology changes: tp, pp, dp, vpp, zero, ep, etp (missing ones keep the source's)."""
    expect: Mapping[str, int] = field(default_factory=dict)
    """Assertions about the source topology (``reshard --tp/--pp/--dp``)."""
    workers: int = 1
    """Target files written in parallel."""
    dry_run: bool = False
    overwrite: bool = False
    true_vocab_size: int | None = None
    drop_optimizer: bool = False
    """Write the model weights only when the optimizer state cannot be carried."""
    names: str | None = None
    """Tensor-name schema of a megatron target (mcore-local, mcore-te, legacy)."""
    model_family: str | None = None
    """The Hugging Face family on whichever side is Hugging Face."""
    model_config: str | None = None
    """An HF ``config.json`` for a source that does not say what model it holds."""
    init_optimizer: bool = False
    """Give a weights-only source a fresh optimizer state (deepspeed targets)."""
    fsync: bool = True
    """False leaves the write-back to the kernel (the commit is still atomic)."""
    verify_source: bool = True
    """Hash the source's files against its manifest while writing (False: trust it)."""
    format_options: Mapping[str, object] = field(default_factory=dict)
    """The target format's own (hf: max_shard_size, dtype; megatron: uneven stages...)."""

    def __post_init__(self):
        for name in ("to", "expect", "format_options"):  # None values mean "not given"
            given = {k: v for k, v in (getattr(self, name) or {}).items() if v is not None}
            object.__setattr__(self, name, MappingProxyType(given))
        if self.workers < 1:
            raise UsageError("--workers must be at least 1")
        if self.init_optimizer and self.drop_optimizer:
            raise UsageError("--init-optimizer and --drop-optimizer contradict each other")

    @classmethod
    def of(cls, given_options: "RewriteOptions | None", /, **given) -> "RewriteOptions":
        """``options``, or one built from keyword arguments (the Python API's form, where
        ``options=`` is the older name of ``format_options``)."""
        if given_options is not None:
            if given:
                raise TypeError("pass RewriteOptions or keyword options, not both")
            return given_options
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(given) - known - {"options"})
        if unknown:
            raise TypeError(f"unknown option(s): {', '.join(unknown)}")
        if "options" in given:  # the older spelling of format_options
            given["format_options"] = given.pop("options")
        return cls(**{k: v for k, v in given.items() if v is not None})


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


def reshard(src: str, dst: str, opts: RewriteOptions | None = None, *,
            progress: Callable[[int], object] | None = None, **given) -> ReshardResult:
    """Rewrite checkpoint ``src`` at ``dst`` in its own format, the topology changed by
    ``options.to``; ``options.expect`` holds assertions about the source topology. Keyword
    arguments build the options (``reshard(src, dst, to={"dp": 2})``)."""
    options = RewriteOptions.of(opts, **given)
    _load_torch()
    opened = open_checkpoint(src)
    if not converters.reshardable(opened.format):
        raise UnsupportedFormat(f"reshard of {opened.format} checkpoints is not implemented yet",
                                path=opened.store.url,
                                hint=f"Supported now: {', '.join(converters.reshardable_formats())}")
    if not options.to and not options.format_options:
        raise UsageError("nothing to change", hint="Give at least one of --to-tp, --to-pp, --to-dp")
    return rewrite(opened, dst, opened.format, options, progress)


def convert(src: str, dst: str, opts: RewriteOptions | None = None, *, to_format: str,
            progress: Callable[[int], object] | None = None, **given) -> ReshardResult:
    """Write checkpoint ``src`` at ``dst`` in format ``to_format`` (topology per ``options.to``).

    ``names`` picks the target's tensor-name schema where the format has several (Megatron:
    ``mcore-local``, ``mcore-te``, ``legacy``); by default the source's, else the format's default.
    ``model_family`` names the Hugging Face family (``llama``, ``gpt2``) on whichever side is
    Hugging Face: the source's schema where its reader takes one (hf, DeepSpeed with an HF
    model's names), and the hf output's, checked against the model. ``model_config`` is a
    Hugging Face ``config.json`` for a source that does not say what model it holds (a
    DeepSpeed checkpoint without one beside ``latest``); ``format_options`` are the target
    format's own (hf: ``max_shard_size``, ``dtype``).
    ``init_optimizer`` gives a weights-only source a fresh optimizer state (fp32 masters,
    zero moments, step 0) where the target format holds one; never done unasked.
    """
    options = RewriteOptions.of(opts, **given)
    _load_torch()
    store = resolve(src)
    source_format = converters.require_format(store)
    reads_family = hasattr(converters.reader_class(source_format), "model_family")
    family = options.model_family
    if family and not reads_family and to_format != "hf":
        raise UsageError(f"--model-family names a Hugging Face schema, and neither the {source_format} "
                         f"input nor the {to_format} output has one", path=store.url,
                         hint="It applies to hf input or output, and to DeepSpeed checkpoints of HF "
                              "models; drop it")
    opened = open_checkpoint(store, model_family=family if reads_family else None,
                             model_config=options.model_config)
    return rewrite(opened, dst, to_format, options, progress)


def _load_torch() -> None:
    """Rewriting moves tensors: torch is loaded before the source is read, so that every dtype
    read from it is torch's own (the light commands read them as names, without torch)."""
    import torch  # noqa: F401


def rewrite(opened: Opened, dst: str, fmt: str, options: RewriteOptions,
            progress: Callable[[int], object] | None = None) -> ReshardResult:
    """The one path for reshard and convert: plan the target files, fill them region by
    region from the source, commit atomically."""
    started = time.perf_counter()
    require_committed(opened)
    if why := overlap(opened.store, dst):
        raise UsageError(f"the destination {why}", path=f"{dst} -> {opened.store.url}",
                         hint="Write to a new path outside the source checkpoint (and move it "
                              "afterwards if you must); nothing was written")
    require_safe_pickles(opened)
    refuse_contradicted(opened.index, fmt, opened.format, options.names)
    target_format = converters.writer_class(fmt)  # what the format can do
    if fmt != opened.format:
        opened = opened.canonical() if target_format.canonical_source else opened.native()
    if options.init_optimizer:
        opened = _fresh_optimizer(opened, target_format)
    index = opened.index
    recorded, given = index.true_vocab_size, options.true_vocab_size
    if given is not None and recorded is not None and given != recorded:  # rows dropped or made up
        raise UsageError(f"--true-vocab-size {given} contradicts the checkpoint, which records a "
                         f"vocabulary of {recorded}", path=opened.store.url,
                         hint="Leave it out: the flag is for a source that does not record one; "
                              "nothing was written")
    writer = converters.writer(fmt, index)  # the format's writer for this source
    source_topo = index.topology
    if source_topo is None:
        raise UsageError("the source does not say what topology it holds",
                         path=opened.store.url, hint="Its format records no args/config")
    for name, value in options.expect.items():
        held = source_topo.expert_tp if name == "etp" else getattr(source_topo, name)
        if held != value:
            raise UsageError(f"--{name} {value} does not match the checkpoint, which is "
                             f"{name.upper()}{held} ({source_topo})",
                             path=opened.store.url, hint=f"Drop --{name} or fix it")
    changes = dict(options.to)
    if "pp" in changes and "vpp" not in changes and changes["pp"] != source_topo.pp:
        changes["vpp"] = 1
    format_options = dict(options.format_options)
    if options.model_family and fmt == "hf":
        format_options["model_family"] = options.model_family
    writer.configure(**format_options)
    writer.bind(opened)  # may adopt what a source records beside its tensors (the hook's args)
    # nothing that changes the model's math is dropped: each field is carried or refused here
    refuse_uncarried_config(index, fmt)
    refuse_uncarried_args(index, fmt)
    target_topo = writer.target_topology(source_topo, changes)
    uncarried = writer.unsupported_state(index)
    if uncarried and not options.drop_optimizer:
        raise UsageError(f"the optimizer state cannot be carried: {uncarried}", path=opened.store.url,
                         hint="Pass --drop-optimizer to write the model weights only (resume with "
                              "Megatron's --no-load-optim)")
    spec = writer.target_spec(index, source_topo, target_topo, options.true_vocab_size)
    if spec is not None:
        check_layout(spec, target_topo)
    # a target region and its sources per chunk: many acyclic objects
    with paused_gc(), progress_step("planning the target files"):
        plan = writer.plan(index, target_topo, spec,
                           schema=options.names or writer.source_schema(opened),
                           with_optimizer=not options.drop_optimizer)
    weights_only = options.drop_optimizer or not writer.holds_optimizer
    _refuse_unwritten(index, plan, fmt, weights_only)
    dropped_tensors = sum(is_optimizer_key(k) for k in index.tensors) if weights_only else 0
    if dropped_tensors and not uncarried:
        uncarried = f"optimizer state ({dropped_tensors} tensors)"
    result = ReshardResult(
        source=opened.store.url, destination=dst, format=fmt,
        source_topology=source_topo.to_dict(), target_topology=target_topo.to_dict(),
        files=[PlannedFile(f.path, f.nbytes) for f in plan], bytes_read=bytes_read(plan, index),
        bytes_written=sum(f.nbytes for f in plan), dry_run=options.dry_run,
        dropped=uncarried if weights_only else None, notes=writer.notes(index))
    if options.dry_run:
        return result
    job = WriteJob(opened=opened, dst=dst, fmt=fmt, writer=writer, plan=plan, spec=spec,
                   target=target_topo, weights_only=weights_only, format_options=format_options,
                   names=options.names, true_vocab_size=options.true_vocab_size,
                   overwrite=options.overwrite, workers=options.workers, fsync=options.fsync,
                   verify_source=options.verify_source)
    destination, reused = write_output(job, result, progress)
    return ReshardResult(**{**{f.name: getattr(result, f.name) for f in fields(result)},
                            "destination": destination, "reused_files": reused,
                            "seconds": time.perf_counter() - started})


def _fresh_optimizer(opened: Opened, writer: type) -> Opened:
    """``--init-optimizer``: a fresh optimizer state for a weights-only source (``writer``:
    the target format's writer class)."""
    if not writer.fresh_optimizer:
        raise UsageError(f"--init-optimizer does not apply to {writer.name} output",
                         hint="Megatron builds a fresh optimizer itself when it loads weights only "
                              "(--finetune or --no-load-optim); a DCP job builds its own. "
                              "Supported: deepspeed")
    held = sum(is_optimizer_key(k) for k in opened.index.tensors)
    if held or opened.index.unmapped:
        raise UsageError(f"the source holds optimizer state already ({held} tensors); "
                         "--init-optimizer would replace it", path=opened.store.url,
                         hint="Drop --init-optimizer to carry the source's state")
    return Opened(opened.store, opened.format, FreshReader(opened.reader), opened.manifest,
                  fresh_state(opened.index))


def _refuse_unwritten(index, plan, fmt: str, drop_optimizer: bool) -> None:
    """Never drop source tensors silently: each must land in some target file, unless it is
    optimizer state and the user asked to drop it."""
    used = {r.key for f in plan for t in f.tensors for r in t.shard.regions}
    used |= {k for k in index.tensors if state_key("fp32_param", k) in used}  # masters stood in
    left = sorted(k for k in index.tensors if k not in used
                  and not (drop_optimizer and is_optimizer_key(k)))
    if not left:
        return
    optimizer = all(is_optimizer_key(k) for k in left)
    raise UsageError(
        f"{len(left)} source tensors have no place in the {fmt} output, e.g. {', '.join(left[:3])}"
        + (" (optimizer state this writer cannot lay out from this source)" if optimizer else ""),
        path=index.url,
        hint="Pass --drop-optimizer to write the model weights only" if optimizer else
        "Convert to a format that holds them (dcp keeps every tensor)")


__all__ = ["reshard", "convert", "rewrite", "RewriteOptions", "ReshardResult", "PlannedFile"]
