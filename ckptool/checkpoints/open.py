"""Finding and opening checkpoints: run roots, candidates, and the merged index.

A *run root* holds checkpoint directories (``step_000100/``, ``iter_0000200/``...). A
checkpoint directory is anything a format detects, or that has a manifest. Names ending in
``.tmp-<id>`` are outputs whose writer never finished; nothing reads them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import converters
from ckptool.core.errors import BadCheckpoint, CkptoolError, UnknownFormat
from ckptool.core.gcpause import paused_gc
from ckptool.core.index import CheckpointIndex, Reader
from ckptool.core.manifest import MANIFEST, Manifest, read_manifest
from ckptool.core.safe_pickle import trusted
from ckptool.core.storage import Store, is_temporary, plain_name, pointer_text
from ckptool.core.topology import Topology
from ckptool.core.view import ViewReader

@dataclass(frozen=True, slots=True)
class Candidate:
    """A directory under a run root that is, or was meant to be, a checkpoint."""

    store: Store
    temporary: bool
    order: tuple
    """Sort key: (iteration or -1, whether the name is a training save's, name)."""
    hook_commit: Any = None
    """When the training hook committed it (its manifest says), for :func:`abandoned`; None for
    anything else."""
    known: bool = True
    """False for a directory named like a training save that no format detects (an emptied or
    half-copied save): ``latest`` lists it as skipped, with why, rather than passing it by."""
    refused: str | None = None
    """Why no read enters it (a symlink out of the run root); it is not :attr:`known` either."""


_SAVED_NAME = re.compile(r"^(?:(?:step|iter|iteration|global_step|checkpoint|ckpt)[-_=]?)?(\d+)$")
"""The names trainers give their saves: the hook's ``step_00000100``, Megatron's ``iter_0000100``,
DeepSpeed's ``global_step100``, the HF Trainer's ``checkpoint-100``, torchtitan's ``step-100``,
a bare number."""


def iteration_from_name(name: str) -> int | None:
    """The step a training save's directory name says (:data:`_SAVED_NAME`); None for any other
    name (a model's ``llama-13b-base``, a conversion's ``step_00000100_hf``), whose digits are
    no step."""
    m = _SAVED_NAME.match(name)
    return int(m.group(1)) if m else None


def _order(iteration: int | None, name: str) -> tuple:
    """Newest first: by iteration (the manifest's, else the name's), then a training save's name
    before anything else made at the same step (a conversion or reshard kept beside it)."""
    from_name = iteration_from_name(name)
    return (iteration if iteration is not None else from_name if from_name is not None else -1,
            from_name is not None, name)


def candidates(root: Store) -> list[Candidate]:
    """Checkpoint directories directly under ``root``, newest first."""
    found = []
    for name, is_dir in root.ls():
        if not is_dir:
            out = root.link_out(name)
            if out is not None:  # not read through the root: listed, so it is not passed by
                found.append(Candidate(root.named(name), False, _order(None, name), known=False,
                                       refused=f"is a symlink to {out}, outside the run root; "
                                       "give that path to use it"))
            continue
        child = root.child(name)
        if is_temporary(name):
            base = name[:name.rfind(".tmp-")]
            found.append(Candidate(child, True, _order(None, base)))
            continue
        try:
            fmt = converters.detect(child)
        except Exception:  # a child with a broken manifest is still a (bad) candidate
            fmt = "?"
        if fmt is None:
            if iteration_from_name(name) is not None:
                found.append(Candidate(child, False, _order(None, name), known=False))
            continue
        manifest = _manifest(child)
        iteration = manifest.iteration if manifest else None
        hook_commit = manifest.created() if manifest and manifest.extra.get("writer") == "hook" \
            and iteration is not None else None
        found.append(Candidate(child, False, _order(iteration, name), hook_commit))
    return sorted(found, key=lambda c: c.order, reverse=True)


def abandoned(found: list[Candidate]) -> dict[str, Candidate]:
    """The training hook's saves a run went back from: save X is abandoned when a save of a
    lower step was committed after it (the run resumed from an earlier step, after a loss
    spike, and saved again). Maps each one's url to that later save. Megatron's tracker has
    the same effect (the run's last save is what it names); without one, the newest step would
    resume the trajectory that was given up."""
    saves = sorted((c for c in found if c.hook_commit is not None and not c.temporary),
                   key=lambda c: c.order[0])
    out, latest_below = {}, None  # the save of a lower step committed last
    i = 0
    while i < len(saves):
        j = i
        while j < len(saves) and saves[j].order[0] == saves[i].order[0]:
            if latest_below is not None and saves[j].hook_commit < latest_below.hook_commit:
                out[saves[j].store.url] = latest_below
            j += 1
        for c in saves[i:j]:
            if latest_below is None or c.hook_commit > latest_below.hook_commit:
                latest_below = c
        i = j
    return out


def is_checkpoint(store: Store) -> bool:
    """Whether ``store`` is itself a checkpoint (not a run root of them). A run root whose
    checkpoints are committed (a manifest in each, the hook's ``step_*``) is one without
    asking every format's reader, so ``latest`` and ``verify`` of it import no torch."""
    if not store.exists(MANIFEST):
        committed = [store.child(name) for name, is_dir in store.ls()
                     if is_dir and not is_temporary(name) and store.child(name).exists(MANIFEST)]
        if committed and not _tracker_leads(store, committed):
            return False
    return converters.detect(store) is not None


def tracker_of(store: Store) -> str | None:
    """The tracker file of a Megatron or DeepSpeed run root (it names the step --load takes),
    or None (:func:`converters.root_trackers`)."""
    return next((t for t in converters.root_trackers() if store.exists(t)), None)


def _tracker_leads(store: Store, committed: list[Store]) -> bool:
    """Whether ``store`` is a Megatron or DeepSpeed run root (its tracker names the step --load
    takes) that stays one checkpoint beside the committed ones in it (a conversion kept there):
    unless one of those is of a later step (the hook saving into a root Megatron saved to
    before), when the root is a run root of candidates like any other."""
    tracker = tracker_of(store)
    if tracker is None:
        return False
    try:
        tracked = iteration_from_name(plain_name(pointer_text(store, tracker)) or "")
    except (OSError, CkptoolError):
        return True
    if tracked is None:  # "release", or unreadable: the tracker says what Megatron loads
        return True
    for child in committed:
        manifest = _manifest(child)
        if manifest is not None and manifest.iteration is not None and manifest.iteration > tracked:
            return False
    return True


def _manifest(store: Store) -> Manifest | None:
    try:
        return read_manifest(store)
    except Exception:  # a broken manifest: the candidate is judged (and skipped) later
        return None


def resolve(url: str) -> Store:
    """The checkpoint at ``url``: the directory itself, or the newest one in a run root."""
    store = Store.open(url)
    if not store.exists():
        raise UnknownFormat("no such file or directory", path=store.url)
    if not store.isdir():
        raise UnknownFormat("is a file, not a checkpoint directory", path=store.url,
                            hint="Give the checkpoint's directory, or a run root of them")
    if is_checkpoint(store):
        return store
    found = candidates(store)
    left = abandoned(found)
    found = [c for c in found if not c.temporary and c.known and c.store.url not in left]
    if not found:
        converters.require_format(store)  # raises with what was found
    return found[0].store


@dataclass
class Opened:
    """A checkpoint with its format, reader, manifest (if any) and index."""

    store: Store
    format: str
    reader: Reader
    manifest: Manifest | None
    index: CheckpointIndex

    def canonical(self) -> "Opened":
        """This checkpoint under canonical tensor names (itself when it has them already)."""

        view = self.reader.canonical(self.store, self.index)
        if view is None:
            return self
        return Opened(self.store, self.format, ViewReader(self.reader), self.manifest, view)

    def native(self) -> "Opened":
        """This checkpoint under the names its format stores (itself when they are its index's)."""
        stored = self.reader.native(self.store, self.index)
        if stored is None:
            return self
        return Opened(self.store, self.format, self.reader, self.manifest, stored)


def unsafe_pickles(opened: Opened) -> list:
    """Every pickled entry of the checkpoint that names a global outside the allowlist:
    what its reader met while indexing, and every stored object, read once through the
    one unpickler (markers stand in for what is refused; nothing is run)."""
    for obj in opened.index.objects.values():
        if obj.location is not None:
            opened.reader.read_object(opened.store, obj)
    return opened.reader.unsafe_pickles()


def require_safe_pickles(opened: Opened) -> None:
    """Refuse a source with pickles outside the allowlist, before anything is written (with
    ``--trust-pickle`` they were loaded for real, and are pickled again from the objects)."""
    if trusted():
        return
    found = unsafe_pickles(opened)
    if found:
        error = found[0].error()
        if len(found) > 1:
            error.message += f" (and {len(found) - 1} more entries)"
        raise error


def require_committed(opened: Opened) -> None:
    """Refuse (exit 1) a checkpoint that ckptool wrote and never committed: without its
    manifest, written last, its writer may have stopped anywhere, so what it holds may be
    partial; a ``NAME.tmp-*`` directory, even with a manifest, was never renamed into place.
    A foreign checkpoint (no ckptool mark) has no manifest to miss."""
    if is_temporary(opened.store.name):
        raise BadCheckpoint("not committed: a temporary output of a write that never finished "
                            "(NAME.tmp-*)", path=opened.store.url,
                            hint="Use the committed NAME (ckptool latest ROOT names the newest); "
                                 "nothing was written")
    if opened.manifest is None and opened.index.written_by_ckptool:
        raise BadCheckpoint(f"not committed: {MANIFEST} is missing, so its writer never finished "
                            "and the checkpoint may be partial", path=opened.store.url,
                            hint="Use a committed checkpoint (ckptool latest ROOT names the newest); "
                                 "nothing was written")
    if opened.manifest is not None:  # every listed file there at its size (no byte read: verify hashes)
        problem = opened.manifest.size_problem(opened.store.files())
        if problem is not None:
            raise BadCheckpoint(problem, path=opened.store.url,
                                hint="`ckptool verify` names everything that is wrong; nothing was written")


def merge_manifest(index: CheckpointIndex, manifest: Manifest | None) -> CheckpointIndex:
    """Fill what the format itself does not record from the manifest."""
    if manifest is None:
        return index
    if manifest.topology:  # what ckptool recorded when it wrote the checkpoint wins
        index.topology = Topology.from_dict(manifest.topology)
    if index.model_config is None and manifest.model_config:
        index.model_config = manifest.model_config
    if index.iteration is None:
        index.iteration = manifest.iteration
    if index.true_vocab_size is None:
        index.true_vocab_size = manifest.true_vocab_size
    return index


def open_checkpoint(url: str | Store, **reader_options) -> Opened:
    """Open a checkpoint; ``reader_options`` (None values ignored) go to its format's reader."""
    store = url if isinstance(url, Store) else resolve(url)
    fmt = converters.require_format(store)
    manifest = read_manifest(store)
    reader = converters.reader(fmt)
    options = {k: v for k, v in reader_options.items() if v is not None}
    if options:
        reader.configure(**options)
    index = merge_manifest(read_index(reader, store), manifest)
    return Opened(store, fmt, reader, manifest, index)


def read_index(reader: Reader, store: Store) -> CheckpointIndex:
    """``reader.read_index(store)``; when it fails where a pickle was refused (an ``args``
    that is a call of ``os.system`` is no Namespace), the refused pickle is the error."""
    try:
        with paused_gc():  # millions of acyclic objects for a large .metadata
            return reader.read_index(store)
    except CkptoolError:
        found = [] if trusted() else reader.unsafe_pickles()
        if found:
            raise found[0].error() from None
        raise
