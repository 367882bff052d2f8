"""What Megatron-Core's ``torch_dist`` and ``zarr`` checkpoints share: ``metadata.json``,
``common.pt`` (args, iteration, the optimizer's common state), stacked layers.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from ckptool.core.errors import BadCheckpoint, UnreadableInput
from ckptool.core.layout import SIZE_BOUNDS
from ckptool.core.index import (
    CheckpointIndex,
    Location,
    ObjectInfo,
    Piece,
    Reader,
    TensorInfo,
)
from ckptool.core.regions import Region
from ckptool.core.storage import Store
from converters.megatron import distopt
from converters.megatron import optimizer as optim
from converters.schemas.megatron import tracked_dir
from converters.schemas.megatron_args import spec_from_args

METADATA_JSON = "metadata.json"
COMMON = "common.pt"
STACKED = "decoder.layers."
STACK_TAG = "stacked-layer"
"""First item of the location detail of a per-layer piece cut from a stacked chunk:
``(STACK_TAG, layer within the chunk, the chunk's region, the chunk's own detail)``."""
OPTIMIZER = "optimizer"
OPTIMIZER_COMMON = "megatron.optimizer.common"
"""A common.pt optimizer entry ckptool cannot map (shown by inspect, not carried)."""
CANONICAL_COMMON = ("args", "iteration", "checkpoint_version", "opt_param_scheduler",
                    "num_floating_point_operations_so_far")
"""common.pt entries that mean the same as the legacy rank files' keys of the same name."""


def metadata(store: Store, rel: str = "") -> dict | None:
    """``metadata.json`` of the checkpoint in ``rel``, or None when there is none."""
    path = f"{rel}/{METADATA_JSON}" if rel else METADATA_JSON
    if not store.exists(path):
        return None
    try:
        meta = json.loads(store.read_small(path))
    except (ValueError, RecursionError):
        return None
    return meta if isinstance(meta, dict) and "sharded_backend" in meta else None


def checkpoint_dir(store: Store) -> str:
    """The directory (relative) holding metadata.json: the store itself or the tracked one."""
    if metadata(store) is not None:
        return ""
    tracked = tracked_dir(store)
    if tracked is not None and metadata(store, tracked) is not None:
        return tracked
    raise BadCheckpoint("no Megatron-Core metadata.json found", path=store.url)


def is_stacked(key: str) -> bool:
    """``decoder.layers.<name>`` (all layers on a leading axis), not ``decoder.layers.3.<name>``."""
    if STACKED not in key:
        return False
    rest = key.split(STACKED, 1)[1]
    return not rest.split(".", 1)[0].isdigit()


def layer_key(key: str, layer: int) -> str:
    """The canonical key of layer ``layer`` of the stacked tensor ``key``:
    ``decoder.layers.x`` -> ``decoder.layers.{layer}.x`` (the one unstacking rule: the
    readers of stacked checkpoints and the hook's Megatron-Core adapter use it)."""
    head, rest = key.split(STACKED, 1)
    return f"{head}{STACKED}{layer}.{rest}"


def split_layers(index: CheckpointIndex, key: str, info: TensorInfo, pieces: list[Piece]) -> None:
    """A stacked ``[L, ...]`` tensor becomes L per-layer tensors; each chunk, per-layer pieces.
    L is what ``.metadata`` claims (untrusted): at most the args' layer count."""
    layers = (index.model_config or {}).get("num_layers")
    known = isinstance(layers, int) and layers > 0
    most = layers if known else SIZE_BOUNDS["num_layers"]
    if not info.shape or not 0 < info.shape[0] <= most:
        raise BadCheckpoint(f"the stacked tensor claims {info.shape[0] if info.shape else 0} layers, "
                            f"more than {most} ({'the model' if known else 'any model'} has)", key=key)
    shape = info.shape[1:]
    for l in range(info.shape[0]):
        name = layer_key(key, l)
        index.tensors[name] = TensorInfo(name, shape, info.dtype)
    for p in pieces:
        l0, n = p.region.offsets[0], p.region.lengths[0]
        if p.region.flat is not None:
            raise BadCheckpoint("flat-sharded stacked tensors are not supported", key=key)
        for i in range(n):
            name = layer_key(key, l0 + i)
            region = Region(name, shape, p.region.offsets[1:], p.region.lengths[1:])
            loc = Location(p.location.file, p.location.offset, p.location.length,
                           (STACK_TAG, i, p.region, p.location.detail))
            index.tensors[name].pieces.append(Piece(region, loc))


def adopt_dcp_common(opened) -> None:
    """Megatron's common entries (:data:`CANONICAL_COMMON`: ``opt_param_scheduler``...) of a
    DCP source (the save hook's, torch DCP's), which stores a dict one object per leaf
    (``opt_param_scheduler.max_lr``...), become the one entry each that the Megatron writers
    carry, as a Megatron source's reader gives it. Without it Megatron-LM's loader finds no
    ``opt_param_scheduler`` and exits. Nothing happens for other sources."""
    index, reader, store = opened.index, opened.reader, opened.store
    if index.format != "dcp":
        return
    for key in CANONICAL_COMMON:
        whole = index.objects.get(key)
        if whole is not None:
            if whole.value is None and whole.location is not None:
                index.objects[key] = ObjectInfo(key, value=reader.read_object(store, whole))
            continue
        prefix = f"{key}."
        tree: dict = {}
        for name in sorted(k for k in index.objects if k.startswith(prefix)):
            *parents, leaf = name[len(prefix):].split(".")
            node = tree
            for part in parents:
                node = node.setdefault(part, {})
                if not isinstance(node, dict):
                    raise UnreadableInput(f"the source's {key} entries nest under a value "
                                          f"({name[:100]})", path=store.url)
            if leaf in node:
                raise UnreadableInput(f"the source's {key} entry {name[:100]} is given twice",
                                      path=store.url)
            node[leaf] = reader.read_object(store, index.objects[name])
        if tree:
            index.objects[key] = ObjectInfo(key, value=tree)


def read_common(reader: Reader, store: Store, rel: str, index: CheckpointIndex,
                distributed=None) -> None:
    """``common.pt`` (the same in both backends) into ``index``: ``args`` -> topology and
    model, the canonical entries, the rest as ``common.*`` objects; then the optimizer.

    Call it after the tensors are indexed: the non-distributed optimizer's step and param
    groups (common.pt's ``optimizer``) become the :class:`optim.Layout` record only when
    the ``optimizer.*`` tensors are exactly its model-shaped state; otherwise
    ``index.unmapped`` says why, and every writer refuses the state unless it is dropped.
    A distributed optimizer's entry (it says ``param_state_sharding_type``) goes to
    ``distributed(entry, index, source)``, when the backend maps one, which turns the
    ``optimizer.*`` tensors into the same canonical state (every parameter with an fp32
    master) or raises UnreadableInput with the reason.
    """
    source = store.display(rel)
    if not store.exists(rel):
        raise BadCheckpoint("common.pt is missing", path=source)
    archive = reader.open_archive(store, rel)
    common = archive.materialize(archive.obj)
    index.files[rel] = 1
    if isinstance(common, dict):
        _read_common_entries(common, index, source)
        if OPTIMIZER in common:  # after args: a distributed optimizer's layout needs them
            _read_optimizer(common[OPTIMIZER], index, source, distributed)
    layout_ = index.layout(optim.Layout)
    if index.layout(distopt.Meta) is not None:
        layout_ = _EVERY_KIND
    if index.unmapped is None:
        index.unmapped = optim.check_tensors(index, layout_, source)
    if index.unmapped is not None:
        index.drop_layout(optim.Layout)
        index.drop_layout(distopt.Meta)


_EVERY_KIND = optim.Layout(True, {}, None, [], {})
"""For checking a distributed optimizer's tensors: it keeps an fp32 master of every
parameter (whatever the parameter's dtype), as a 16-bit Float16 optimizer does."""


def _read_common_entries(common: dict, index: CheckpointIndex, source: str) -> None:
    for key, value in common.items():
        if key == OPTIMIZER:
            continue
        name = key if key in CANONICAL_COMMON else f"common.{key}"
        index.objects[name] = ObjectInfo(key, value=value)
    if isinstance(common.get("iteration"), int):
        index.iteration = common["iteration"]
    args = common.get("args")
    if isinstance(args, argparse.Namespace):
        spec, topo, known = spec_from_args(args, model="mcore")  # torch_dist: Megatron-Core's
        index.topology, index.model_config = topo, asdict(spec)
        index.true_vocab_size = spec.vocab_size if known else None


def distopt_chained(value) -> bool:
    """common.pt's optimizer entry of a ChainedOptimizer of distributed optimizers (a MoE
    model at EP > 1): ``{0: dense entry, 1: expert entry}``, each naming its sharding type."""
    return isinstance(value, dict) and sorted(value) == [0, 1] and all(
        isinstance(v, dict) and "param_state_sharding_type" in v for v in value.values())


def _read_optimizer(value, index: CheckpointIndex, source: str, distributed=None) -> None:
    """The optimizer's step, param groups and grad scaler: the same canonical object
    as the legacy reader's; or, when they cannot be mapped, the reason (kept raw under
    ``OPTIMIZER_COMMON`` for inspect, never written back)."""
    try:
        if distributed is not None and isinstance(value, dict) and (
                "param_state_sharding_type" in value or distopt_chained(value)):
            distributed(value, index, source)
            return
        index.set_layout(optim.read_sharded_common(value, source))
    except UnreadableInput as exc:
        index.unmapped = exc.message
        index.objects[OPTIMIZER_COMMON] = ObjectInfo(OPTIMIZER, value=value)
