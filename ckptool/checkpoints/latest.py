"""``ckptool latest``: the newest checkpoint under a run root that passes verify.

The choice itself is a pure policy over (candidate, verdict) pairs; the I/O is in
:func:`latest`. Newer candidates that were skipped are reported with the reason, so a
restart script can log why it went back.
"""

from __future__ import annotations

import converters
from ckptool.checkpoints.open import (
    Candidate,
    abandoned,
    candidates,
    is_checkpoint,
    iteration_from_name,
    tracker_of,
)
from ckptool.checkpoints.reports import LatestResult, Skipped
from ckptool.checkpoints.verify import verify
from ckptool.core.errors import CkptoolError, NoCheckpoint, UnreadableInput, UsageError
from ckptool.core.manifest import read_manifest
from ckptool.core.storage import Store, is_temporary


UNFINISHED = "not committed: temporary output of an unfinished write"
"""Why a ``NAME.tmp-*`` directory is skipped: a save that never committed (no save at all, to a
restart)."""


def latest(root: str, *, verify_checkpoints: bool = True) -> LatestResult:
    """The newest valid checkpoint under ``root``; raises NoCheckpoint when there is none."""
    store = Store.open(root)
    if not store.exists():
        bucket = store.bucket
        if bucket is not None and not store.fs.exists(bucket):  # a typo, not a first start
            raise UnreadableInput(f"the bucket {bucket!r} does not exist or cannot be read",
                                  path=store.url, hint="Check the URL, the endpoint and the credentials")
        raise NoCheckpoint("run root does not exist", path=store.url)
    if not store.isdir():
        raise UsageError("is a file, not a run root or a checkpoint directory", path=store.url)
    for _ in range(_RELISTS):
        listed = store.ls()
        result, found, skipped = _newest(store, verify_checkpoints)
        # the root changed while its candidates were judged (the job committed a newer save and
        # its keep_last removed the one judged): list again
        if result is not None or store.ls() == listed:
            break
    if result is not None:
        return result
    hint = f"{len(skipped)} candidate(s) skipped, see above" if skipped else \
        "The directory holds no checkpoint"
    if len(found) == 1 and found[0].store is store:
        hint = _older_tracked(store, verify_checkpoints) or hint
    error = NoCheckpoint("no valid checkpoint found", path=store.url, hint=hint)
    error.skipped = skipped
    raise error


_RELISTS = 50


def _newest(store: Store, verify_checkpoints: bool) -> tuple[LatestResult | None, list, list[Skipped]]:
    """One pass over ``store``'s candidates: the newest valid one (or None), the candidates
    and those skipped, with why."""
    if is_checkpoint(store):  # ROOT is itself a checkpoint
        found = [Candidate(store, is_temporary(store.name), (0, True, store.name))]
    else:
        found = candidates(store)
    skipped: list[Skipped] = []
    left = abandoned(found)
    for cand in found:
        if cand.temporary:
            skipped.append(Skipped(cand.store.url, UNFINISHED))
            continue
        if cand.refused is not None:
            skipped.append(Skipped(cand.store.url, cand.refused))
            continue
        if cand.store.url in left:
            later = left[cand.store.url]
            skipped.append(Skipped(cand.store.url, f"abandoned: the run went back to an earlier step "
                                   f"and saved {later.store.name} after it"))
            continue
        reason, fmt, iteration = _judge(cand.store, verify_checkpoints, named=cand.store is not store)
        if reason is None:
            return LatestResult(cand.store.url, fmt, iteration, verify_checkpoints, skipped), found, skipped
        skipped.append(Skipped(cand.store.url, reason))
    return None, found, skipped


def _older_tracked(store: Store, full: bool) -> str | None:
    """For a run root whose tracker (Megatron's, DeepSpeed's) names a bad checkpoint: the newest
    older one of its own that passes, as what to do (``latest`` prints the root, which is what
    Megatron's and DeepSpeed's --load take, so it cannot print that one instead)."""
    tracker = tracker_of(store)
    if tracker is None:
        return None
    for cand in candidates(store):
        saved = iteration_from_name(cand.store.name) is not None
        if saved and not cand.temporary and cand.refused is None and _judge(cand.store, full)[0] is None:
            return (f"The checkpoint its {tracker} names is bad; {cand.store.name} passes: make "
                    f"{tracker} name it to resume from there")
    return None


def _judge(store: Store, full: bool, named: bool = True) -> tuple[str | None, str, int | None]:
    """(reason to skip or None, format, iteration). ``named``: a save under a run root, whose
    name may say its step (a root's own name, a job id, says none)."""
    try:
        if full:
            report = verify(store.url)
            if not report.ok:
                return report.problems[0].one_line(), report.format, None
        fmt = converters.require_format(store)
        manifest = read_manifest(store)
        if manifest is None and not full:
            index = converters.reader(fmt).read_index(store)
            if index.written_by_ckptool:
                return "not committed: ckptool.json is missing", fmt, None
        if manifest is not None and not full:  # no hashing, but every file there, whole
            problem = manifest.size_problem(store.files())
            if problem is not None:
                return f"{problem} (sizes checked, not hashes: --no-verify)", fmt, None
        iteration = manifest.iteration if manifest and manifest.iteration is not None else \
            iteration_from_name(store.name) if named else None
        return None, fmt, iteration
    except CkptoolError as exc:
        return exc.one_line(), "?", None
