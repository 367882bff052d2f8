"""The canonical optimizer state: what every format's optimizer tensors are called in the
global view, and the rules more than one framework needs.

An Adam state tensor is laid out exactly like its parameter and keyed
``optimizer.state.<kind>.<param key>``, kind one of :data:`KINDS` (``fp32_param`` is a
mixed-precision optimizer's fp32 master). Megatron's legacy files, Megatron-Core's
``torch_dist``, DeepSpeed's ZeRO partitions, the hook's DCP files and Hugging Face weights
(taken from the masters where there are some) all read and write through these keys.

Also here, because several frameworks follow them:

* the weight-decay split of the HF Trainer and Megatron (group 1, no weight decay: biases
  and 1-D parameters), and the parameter numbering of a torch optimizer's ``state_dict``;
* a fresh state for a weights-only source (``convert --init-optimizer``).
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, replace

from ckptool.core.index import (
    CheckpointIndex,
    Location,
    Piece,
    TensorInfo,
    WrappingReader,
)
from ckptool.core.lazy import lazy
from ckptool.core.regions import Region, Shard
from ckptool.core.storage import Store

torch = lazy("torch", globals())

KINDS = ("exp_avg", "exp_avg_sq", "fp32_param")
PREFIX = "optimizer.state."
OPTIMIZER_PREFIX = "optimizer."
"""Every optimizer entry of an index (state tensors and the rest) starts with it, or with a
sub-optimizer's prefix and it (:func:`is_optimizer_key`)."""
_SUB_OPTIMIZER = re.compile(r"^chained_\d+\.optimizer\.")
"""A ChainedOptimizer's sub-optimizer entries as Megatron-Core stores them unmapped
(``chained_{i}.optimizer.distributed...``)."""


def is_optimizer_key(key: str) -> bool:
    """Whether a global tensor of an index is optimizer state (mapped or not): what
    ``--drop-optimizer`` drops."""
    return key.startswith(OPTIMIZER_PREFIX) or _SUB_OPTIMIZER.match(key) is not None


def state_key(kind: str, canonical: str) -> str:
    """Canonical key of one optimizer tensor: ``optimizer.state.exp_avg.<param key>``."""
    return f"{PREFIX}{kind}.{canonical}"


def split_key(key: str) -> tuple[str, str] | None:
    """``optimizer.state.exp_avg.<param key>`` -> (``exp_avg``, ``<param key>``); None for a
    key that is not a state tensor of a known kind."""
    if not key.startswith(PREFIX):
        return None
    kind, _, param = key[len(PREFIX):].partition(".")
    return (kind, param) if kind in KINDS and param else None


def state_shard(kind: str, shard: Shard) -> Shard:
    """The shard of a parameter's ``kind`` state: the parameter's regions under the state's
    key (a state tensor is laid out exactly like its parameter)."""
    parts = tuple((off, replace(r, key=state_key(kind, r.key))) for off, r in shard.parts)
    return Shard(shard.shape, parts, shard.dtype)


def no_decay(name: str, ndim: int) -> bool:
    """The weight-decay rule of Megatron and the HF Trainer: no decay for biases and 1-D
    parameters (norms)."""
    return name.endswith(".bias") or ndim == 1


def decay_groups(params: list[tuple[str, int]]) -> list[list[str]]:
    """The two param groups (decay, no decay) of ``(name, ndim)`` in named_parameters order."""
    return [[n for n, d in params if not no_decay(n, d)], [n for n, d in params if no_decay(n, d)]]


def torch_state_dict(groups: list[list[str]], hyper: list[dict], entry) -> dict:
    """A torch optimizer's ``state_dict()``: parameters numbered across ``groups`` in order
    (the numbering every reader of such a dict must undo), group ``g`` with ``hyper[g]``,
    each parameter's state ``entry(g, name)``."""
    state, param_groups, index = {}, [], 0
    for g, names in enumerate(groups):
        param_groups.append({**copy.deepcopy(hyper[g]), "params": list(range(index, index + len(names)))})
        for name in names:
            state[index] = entry(g, name)
            index += 1
    return {"state": state, "param_groups": param_groups}


# ----------------------------------------------------------- a fresh state (--init-optimizer)

@dataclass(frozen=True)
class ParamGroups:
    """The layout record of a source's optimizer param groups as the framework that saved
    them held them, for a writer of another framework that rebuilds its own groups from
    them (Megatron's optimizer from a DeepSpeed one)."""

    ranks: dict[int, list[list[tuple[str, tuple[int, ...]]]]]
    """Model-parallel rank -> its param groups, each the (name, shape) of its parameters in
    the group's order."""
    hyper: list[dict]
    """Each group's hyperparameters (``lr``, ``betas``, ``weight_decay``...)."""
    steps: list
    """Each group's optimizer step."""


@dataclass(frozen=True)
class FreshState:
    """The layout record of an index given a fresh state (:func:`fresh_state`): the step
    every param group starts at."""

    step: int = 0

_ZEROS = "zeros"


def fresh_state(index: CheckpointIndex) -> CheckpointIndex:
    """``index`` (a weights-only source) with a fresh Adam state for every tensor, the state
    a torch Adam/AdamW has before its first step: an fp32 master equal to the weight, both
    moments zero, step 0. Read it through :class:`FreshReader`. Only ``convert
    --init-optimizer`` asks for it."""
    out = index.copy()
    for key, info in index.tensors.items():
        master = state_key("fp32_param", key)
        out.tensors[master] = TensorInfo(master, info.shape, torch.float32, [
            Piece(replace(p.region, key=master), p.location) for p in info.pieces])
        for kind in ("exp_avg", "exp_avg_sq"):
            k = state_key(kind, key)
            out.tensors[k] = TensorInfo(k, info.shape, torch.float32, [
                Piece(Region.whole(k, info.shape), Location("", detail=_ZEROS))])
    out.set_layout(FreshState())
    return out


def _zeros(piece: Piece) -> bool:
    return piece.location.detail == _ZEROS and not piece.location.file


class FreshReader(WrappingReader):
    """The source's reader, with zeros for the fresh moments (which no file holds)."""

    def read_box_into(self, store: Store, piece: Piece, dtype, box, out) -> None:
        if _zeros(piece):
            out.zero_()
        else:
            self.inner.read_box_into(store, piece, dtype, box, out)

    def file_span(self, store: Store, piece: Piece, dtype, box):
        return None if _zeros(piece) else self.inner.file_span(store, piece, dtype, box)
