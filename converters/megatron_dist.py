"""Megatron-Core distributed checkpoints: ``metadata.json`` + ``common.pt`` + a backend.

The ``torch_dist`` backend is a DCP container. Homogeneous models stack their layers on a
leading axis: ``decoder.layers.self_attention.linear_qkv.weight`` has global shape
``[L, (nh + 2 ng) d, h]``; fc1 is ``[gate; up]``; norms use the Transformer Engine names
(``linear_qkv.layer_norm_weight``) whatever the layer spec; ``_extra_state/shard_i_n``
entries are bytes. ``common.pt`` holds the non-sharded state (``args``, ``iteration``,
``checkpoint_version``...). A run root holds ``latest_checkpointed_iteration.txt`` and
``iter_*`` directories, as in legacy Megatron.

The reader presents the canonical view: one global tensor per layer
(``decoder.layers.{i}.…``), each stored chunk of a stacked tensor split into per-layer
pieces. The older ``zarr`` backend is detected but not read yet.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace

import torch

from ckptool.core.dcpfile import DcpContainerReader
from ckptool.core.errors import BadCheckpoint, UnsupportedFormat
from ckptool.core.index import CheckpointIndex, Location, ObjectInfo, Piece, TensorInfo
from ckptool.core.regions import Region
from ckptool.core.storage import Store
from ckptool.core.torchfile import TorchFile
from converters.megatron_common import spec_from_args, tracked_dir

NAME = "megatron-dist"
METADATA_JSON = "metadata.json"
COMMON = "common.pt"
STACKED = "decoder.layers."
STACK_TAG = "stacked-layer"


def _metadata(store: Store, rel: str = "") -> dict | None:
    path = f"{rel}/{METADATA_JSON}" if rel else METADATA_JSON
    if not store.exists(path):
        return None
    try:
        meta = json.loads(store.read_bytes(path))
    except ValueError:
        return None
    return meta if isinstance(meta, dict) and "sharded_backend" in meta else None


def checkpoint_dir(store: Store) -> str:
    """The directory (relative) holding metadata.json: the store itself or the tracked one."""
    if _metadata(store) is not None:
        return ""
    tracked = tracked_dir(store)
    if tracked is not None and _metadata(store, tracked) is not None:
        return tracked
    raise BadCheckpoint("no Megatron-Core metadata.json found", path=store.url)


def _is_stacked(key: str) -> bool:
    if STACKED not in key:
        return False
    rest = key.split(STACKED, 1)[1]
    return not rest.split(".", 1)[0].isdigit()


class MegatronDistReader(DcpContainerReader):
    name = NAME

    @classmethod
    def detect(cls, store: Store) -> bool:
        try:
            checkpoint_dir(store)
            return True
        except BadCheckpoint:
            return False

    def read_index(self, store: Store) -> CheckpointIndex:
        base = checkpoint_dir(store)
        meta = _metadata(store, base)
        if meta.get("sharded_backend") != "torch_dist":
            raise UnsupportedFormat(f"the {meta.get('sharded_backend')!r} backend of Megatron-Core "
                                    "checkpoints is not read yet (only torch_dist)", path=store.url)
        sub = store.child(base) if base else store
        raw = super().read_index(sub)
        prefix = f"{base}/" if base else ""
        index = CheckpointIndex(format=self.name, url=store.url, format_version=str(
            meta.get("sharded_backend_version")), written_by_ckptool=raw.written_by_ckptool)
        index.files = {prefix + f: n for f, n in raw.files.items()}
        index.files[prefix + METADATA_JSON] = 1
        for key, obj in raw.objects.items():
            loc = obj.location
            index.objects[key] = replace(obj, location=replace(loc, file=prefix + loc.file) if loc else None)
        for key, info in raw.tensors.items():
            pieces = [replace(p, location=replace(p.location, file=prefix + p.location.file))
                      for p in info.pieces]
            if _is_stacked(key) and len(info.shape) >= 1:
                _split_layers(index, key, info, pieces)
            else:
                index.tensors[key] = TensorInfo(key, info.shape, info.dtype, pieces)
        self._read_common(store, prefix + COMMON, index)
        return index

    def _read_common(self, store: Store, rel: str, index: CheckpointIndex) -> None:
        if not store.exists(rel):
            raise BadCheckpoint("common.pt is missing", path=store.display(rel))
        reader = store.range_reader(rel)
        try:
            archive = TorchFile(reader, reader.size, store.display(rel))
            common = archive.materialize(archive.obj)
        finally:
            reader.close()
        index.files[rel] = 1
        if not isinstance(common, dict):
            return
        for key, value in common.items():
            index.objects[f"common.{key}"] = ObjectInfo(key, value=value)
        if isinstance(common.get("iteration"), int):
            index.iteration = common["iteration"]
        args = common.get("args")
        if isinstance(args, argparse.Namespace):
            spec, topo, known = spec_from_args(args)
            index.topology, index.model_config = topo, asdict(spec)
            index.true_vocab_size = spec.vocab_size if known else None

    def read_piece(self, store: Store, piece: Piece, dtype: torch.dtype) -> torch.Tensor:
        detail = piece.location.detail
        if not (isinstance(detail, tuple) and detail and detail[0] == STACK_TAG):
            return super().read_piece(store, piece, dtype)
        _, layer, chunk_region, inner = detail
        chunk = super().read_piece(store, Piece(chunk_region, replace(piece.location, detail=inner)),
                                   dtype)
        return chunk[layer].contiguous()


def _split_layers(index: CheckpointIndex, key: str, info: TensorInfo, pieces: list[Piece]) -> None:
    """A stacked ``[L, ...]`` tensor becomes L per-layer tensors; each chunk, per-layer pieces."""
    head, rest = key.split(STACKED, 1)
    shape = info.shape[1:]
    for l in range(info.shape[0]):
        name = f"{head}{STACKED}{l}.{rest}"
        index.tensors[name] = TensorInfo(name, shape, info.dtype)
    for p in pieces:
        l0, n = p.region.offsets[0], p.region.lengths[0]
        if p.region.flat is not None:
            raise BadCheckpoint("flat-sharded stacked tensors are not supported", key=key)
        for i in range(n):
            name = f"{head}{STACKED}{l0 + i}.{rest}"
            region = Region(name, shape, p.region.offsets[1:], p.region.lengths[1:])
            loc = Location(p.location.file, p.location.offset, p.location.length,
                           (STACK_TAG, i, p.region, p.location.detail))
            index.tensors[name].pieces.append(Piece(region, loc))
