"""``ckptool inspect``: what a checkpoint holds, without reading tensor data."""

from __future__ import annotations

from dataclasses import dataclass, field

from ckptool.checkpoints.open import open_checkpoint, unsafe_pickles
from ckptool.core.optimizer import PREFIX
from ckptool.core.safe_pickle import trusted
from converters.schemas.hf import HfModel


@dataclass(frozen=True, slots=True)
class TensorSummary:
    key: str
    shape: list[int]
    dtype: str
    bytes: int
    pieces: int


@dataclass(frozen=True, slots=True)
class InspectResult:
    path: str
    format: str
    format_version: str | None
    committed: bool | None
    """True with a manifest; False when ckptool wrote it without committing; None if foreign."""
    topology: dict | None
    iteration: int | None
    model_config: dict | None
    true_vocab_size: int | None
    tensor_count: int
    object_count: int
    total_bytes: int
    bytes_by_dtype: dict[str, int]
    largest: list[TensorSummary] = field(default_factory=list)
    objects: list[str] = field(default_factory=list)
    optimizer: str | None = None
    """The optimizer state it holds, mapped to parameters, or why it cannot be (then no
    writer carries it); None when it holds none."""
    warnings: list[str] = field(default_factory=list)
    """What every other command refuses: pickles that name globals outside the allowlist."""


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")




def _optimizer(index) -> str | None:
    """One line on the optimizer state: the kinds held per parameter, or why they cannot be
    mapped (the reason every writer would give)."""
    if index.unmapped:
        return f"not mapped to parameters: {index.unmapped} (reshard/convert need --drop-optimizer)"
    kinds: dict[str, int] = {}
    for key in index.tensors:
        if key.startswith(PREFIX):
            kind = key[len(PREFIX):].partition(".")[0]
            kinds[kind] = kinds.get(kind, 0) + 1
    if not kinds:
        return None
    return ", ".join(f"{kind} of {n} parameters" for kind, n in sorted(kinds.items()))


def inspect(url: str, *, top: int = 10) -> InspectResult:
    """Summarize the checkpoint at ``url`` (a checkpoint directory or a run root)."""
    opened = open_checkpoint(url)
    index = opened.index
    by_dtype: dict[str, int] = {}
    for t in index.tensors.values():
        by_dtype[_dtype_name(t.dtype)] = by_dtype.get(_dtype_name(t.dtype), 0) + t.nbytes
    largest = sorted(index.tensors.values(), key=lambda t: (-t.nbytes, t.key))[:top]
    committed = True if opened.manifest else (False if index.written_by_ckptool else None)
    warnings = [] if trusted() else [f.error().one_line() for f in unsafe_pickles(opened)]
    if index.contradicts:  # read and resharded as it is; conversions refuse it
        warnings.append(f"{index.contradicts}; conversions refuse it")
    model = index.layout(HfModel)
    if model is not None and model.unplaced:
        warnings.append(f"{model.unplaced_words()}; conversions refuse it")
    return InspectResult(
        path=opened.store.url, format=opened.format, format_version=index.format_version,
        committed=committed, topology=index.topology.to_dict() if index.topology else None,
        iteration=index.iteration, model_config=index.model_config,
        true_vocab_size=index.true_vocab_size, tensor_count=len(index.tensors),
        object_count=len(index.objects), total_bytes=sum(by_dtype.values()),
        bytes_by_dtype=dict(sorted(by_dtype.items(), key=lambda kv: -kv[1])),
        largest=[TensorSummary(t.key, list(t.shape), _dtype_name(t.dtype), t.nbytes, len(t.pieces))
                 for t in largest],
        objects=sorted(index.objects), optimizer=_optimizer(index), warnings=warnings)
