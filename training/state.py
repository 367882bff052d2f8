"""What a rank's training state *is*, in global terms: the one description the hook saves
from and loads into.

A state dict's leaves are:

* :class:`Sharded`: a local tensor and the :class:`~ckptool.core.regions.Shard` that says
  which regions of which global tensors it holds (built by ``training.megatron`` from the
  shared layout rules: fused QKV, SwiGLU halves, vocab padding, PP layer offsets);
* a ``DTensor``: its placements give one box of the global tensor;
* a plain tensor: the whole global tensor, replicated (rank 0 writes it);
* :class:`Owned`: an object several ranks hold, written by the one whose copy is primary;
* anything else: a replicated object (rank 0 writes it).

:func:`describe` turns each leaf into :class:`Entry` records (global key, global shape,
and the local views of each box), so saving and loading are one loop over boxes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ckptool.core.regions import Region, Shard, flat_regions


@dataclass
class Sharded:
    """A local tensor holding the regions of ``shard`` (in the shard's flat order)."""

    local: torch.Tensor
    shard: Shard
    replica: bool = False
    """Another rank writes the same regions (TP-replicated norms, DP replicas, tied copies)."""

    def __post_init__(self):
        if tuple(self.local.shape) != tuple(self.shard.shape):
            raise ValueError(f"local tensor has shape {tuple(self.local.shape)}, its shard "
                             f"{tuple(self.shard.shape)} ({self.shard.regions[0].key if self.shard.parts else '?'})")


@dataclass
class Owned:
    """A non-tensor value held by several ranks (a Megatron-Core ``ShardedObject``, such as
    Transformer Engine's ``_extra_state`` of a layer on another pipeline stage): the rank whose
    copy is primary writes it, every rank loads it (the leaf becomes the value)."""

    value: Any
    replica: bool = False


@dataclass
class Entry:
    """One tensor leaf: where its local data sits in global tensors."""

    path: tuple[str, ...]
    """Keys from the state dict's root to the leaf."""
    local: torch.Tensor
    shard: Shard
    writes: bool
    """This rank writes it (the primary copy of its regions)."""
    boxes: list[tuple[str, tuple, tuple, tuple, torch.Tensor]] = field(default_factory=list)


def flatten(tree: Any, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    """Leaves of nested dicts with their key paths (DCP joins them with dots). Two leaves whose
    paths join to one key (``{"a.b": x}`` beside ``{"a": {"b": y}}``) are refused: one would be
    saved over the other (committed, then failing verify)."""
    if not isinstance(tree, dict):
        return [(path, tree)]
    out = []
    for k, v in tree.items():
        out += flatten(v, (*path, str(k)))
    if not path:
        seen: dict[str, tuple] = {}  # every leaf's own key path is distinct: a repeat is a collision
        for p, _ in out:
            key = dotted(p)
            if key in seen:  # {"a.b": x, "a": {"b": y}}, or {1: x, "1": y}
                raise ValueError(f"state keys {list(seen[key])} and {list(p)} are both {key!r} in a "
                                 "checkpoint (DCP joins nested keys with dots, as strings)")
            seen[key] = p
    return out


def dotted(path: tuple[str, ...]) -> str:
    return ".".join(path)


def describe(state: dict, rank: int) -> tuple[list[Entry], dict[str, tuple[tuple[str, ...], Any]]]:
    """(tensor entries, {key: (path, value)} of the other leaves) of ``state`` on ``rank``."""
    entries, objects = [], {}
    for path, value in flatten(state):
        if isinstance(value, Sharded):
            entries.append(Entry(path, value.local, value.shard, not value.replica))
        elif is_dtensor(value):
            entries.append(dtensor_entry(path, value))
        elif isinstance(value, torch.Tensor):
            key = dotted(path)
            entries.append(Entry(path, value, Shard.of(Region.whole(key, value.shape)), rank == 0))
        else:
            objects[dotted(path)] = (path, value)
    return entries, objects


ADAM_KINDS = ("exp_avg", "exp_avg_sq")
"""The Adam moments every adapter describes (with the step)."""


def adam_state(optimizer: torch.optim.Optimizer, param: torch.Tensor, who: str) -> dict:
    """The torch Adam state of ``param`` (a parameter, or a flat partition / main param),
    created (zero, step 0) if the optimizer has not stepped yet, so that a load fills it in
    place; the step as a tensor. ``who`` names the adapter in the error for other optimizers."""
    from ckptool.core.errors import UsageError

    state = optimizer.state[param]
    if not state:
        state["step"] = torch.zeros((), dtype=torch.float32)
        for kind in ADAM_KINDS:
            state[kind] = torch.zeros_like(param, memory_format=torch.preserve_format)
    missing = [k for k in ("step", *ADAM_KINDS) if k not in state]
    if missing:
        raise UsageError(f"the optimizer {type(optimizer).__name__} has no {', '.join(missing)} "
                         "state", hint=f"{who} describes Adam/AdamW state")
    if not isinstance(state["step"], torch.Tensor):
        state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32)
    return state


def flat_entry(buffer: torch.Tensor, parts, start: int, stop: int, key: str,
               replica: bool) -> Sharded:
    """Elements ``[start, stop)`` of a TP shard whose ``parts`` are its regions, held in the
    1-D ``buffer`` (a ZeRO partition's or distributed optimizer's slice), as the regions of
    global tensor ``key`` they are (:func:`~ckptool.core.regions.flat_regions`)."""
    return Sharded(buffer, Shard((stop - start,), tuple(flat_regions(parts, start, stop, key))),
                   replica)


def boxes(shard: Shard, buffer: torch.Tensor):
    """``(key, global_shape, offsets, lengths, view)`` for every box of ``shard`` in ``buffer``.

    A region cut by a flat range (ZeRO, distributed optimizer) is several boxes.
    """
    for region, view in shard.views(buffer):
        found = region.boxes()
        if not found and region.flat is None and 0 in region.global_shape:
            found = [region.box]  # a tensor with no elements is still a tensor DCP lists, one empty chunk
        for box in found:
            yield region.key, region.global_shape, box[0], box[1], region.view(view, box)


def set_leaf(state: dict, path: tuple[str, ...], value: Any) -> None:
    """Put ``value`` at ``path`` (:func:`flatten`'s, whose keys are strings) in ``state``, under
    the keys the state has (an optimizer's ``{0: {...}}`` keeps its int keys)."""
    node = state
    for k in path[:-1]:
        node = node[_own_key(node, k)]
    node[_own_key(node, path[-1])] = value


def _own_key(node: dict, key: str):
    if key in node:
        return key
    return next((k for k in node if str(k) == key), key)


_DTENSOR: list = []


def is_dtensor(value) -> bool:
    if not _DTENSOR:
        try:
            from torch.distributed.tensor import (
                DTensor,  # lazy: its module moved between torch versions
            )
        except ImportError:  # older torch
            from torch.distributed._tensor import DTensor
        _DTENSOR.append(DTensor)
    return isinstance(value, _DTENSOR[0])


def dtensor_entry(path: tuple[str, ...], value) -> Entry:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = value.to_local()
    _, offsets = compute_local_shape_and_global_offset(value.shape, value.device_mesh,
                                                       value.placements)
    coord = value.device_mesh.get_coordinate() or []
    # Among ranks holding the same replica, only the one at coordinate 0 of every
    # replicated mesh dimension writes.
    writes = all(c == 0 for c, p in zip(coord, value.placements) if p.is_replicate())
    region = Region(dotted(path), tuple(value.shape), tuple(offsets), tuple(local.shape))
    return Entry(path, local, Shard.of(region), writes)
