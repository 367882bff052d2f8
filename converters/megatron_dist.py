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

The non-distributed optimizer (``FP32Optimizer``, ``Float16OptimizerWithFloat16Params``)
saves its state the model's way: ``optimizer.state.{exp_avg,exp_avg_sq,fp32_param}.<model
key>`` ShardedTensors (stacked like the model's, so the same per-layer split gives the
canonical keys), and its step, param groups and grad scaler in ``common.pt["optimizer"]``
(see :mod:`converters.megatron_optimizer`). The distributed optimizer's flat buffers are
refused with the reason.
"""

from __future__ import annotations

import argparse
import io
import json
from dataclasses import asdict, replace

import torch

from ckptool.core.dcpfile import METADATA, DcpContainerReader
from ckptool.core.dcpwrite import DcpFileWriter, RecordedFiles, write_metadata
from ckptool.core.engine import TargetFile, TargetTensor
from ckptool.core.layout import VOCAB, ModelSpec, layout
from ckptool.core.regions import Shard
from ckptool.core.topology import Topology
from ckptool.core.errors import BadCheckpoint, UnreadableInput, UnsupportedFormat
from ckptool.core.index import CheckpointIndex, Location, ObjectInfo, Piece, TensorInfo, Writer
from ckptool.core.regions import Region
from ckptool.core.storage import Store
from ckptool.core.torchfile import TorchFile
from converters import megatron_optimizer as optim
from converters.megatron_common import (TRACKER, iteration_dir, params_by_key, source_dtype,
                                        spec_from_args, tracked_dir, update_args, UnevenStages)

EXTRA_STATE_MODULES = ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1",
                       "mlp.linear_fc2")

NAME = "megatron-dist"
METADATA_JSON = "metadata.json"
COMMON = "common.pt"
STACKED = "decoder.layers."
STACK_TAG = "stacked-layer"
OPTIMIZER = "optimizer"
OPTIMIZER_COMMON = "megatron.optimizer.common"
"""A common.pt optimizer entry ckptool cannot map (shown by inspect, not carried)."""
CANONICAL_COMMON = ("args", "iteration", "checkpoint_version", "opt_param_scheduler",
                    "num_floating_point_operations_so_far")
"""common.pt entries that mean the same as the legacy rank files' keys of the same name."""


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
        layout_ = index.objects.get(optim.LAYOUT_KEY)
        if index.unmapped is None:
            index.unmapped = optim.check_tensors(index, layout_.value if layout_ else None,
                                                 store.display(prefix + COMMON))
        if index.unmapped is not None:
            index.objects.pop(optim.LAYOUT_KEY, None)
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
            if key == OPTIMIZER:
                self._read_optimizer(value, index, store.display(rel))
                continue
            name = key if key in CANONICAL_COMMON else f"common.{key}"
            index.objects[name] = ObjectInfo(key, value=value)
        if isinstance(common.get("iteration"), int):
            index.iteration = common["iteration"]
        args = common.get("args")
        if isinstance(args, argparse.Namespace):
            spec, topo, known = spec_from_args(args)
            index.topology, index.model_config = topo, asdict(spec)
            index.true_vocab_size = spec.vocab_size if known else None

    @staticmethod
    def _read_optimizer(value, index: CheckpointIndex, source: str) -> None:
        """The optimizer's step, param groups and grad scaler: the same canonical object
        as the legacy reader's; or, when they are not the non-distributed optimizer's,
        the reason (kept raw under ``OPTIMIZER_COMMON`` for inspect, never written back)."""
        try:
            index.objects[optim.LAYOUT_KEY] = ObjectInfo(
                optim.LAYOUT_KEY, value=optim.read_sharded_common(value, source))
        except UnreadableInput as exc:
            index.unmapped = exc.message
            index.objects[OPTIMIZER_COMMON] = ObjectInfo(OPTIMIZER, value=value)

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


# ----------------------------------------------------------------------------- writing


class MegatronDistWriter(UnevenStages, RecordedFiles, Writer):
    """Writes a Megatron-Core ``torch_dist`` run root: tracker + ``iter_*/`` with
    ``metadata.json``, ``common.pt`` and a DCP container whose per-layer tensors are stacked.

    Each target rank's file holds the chunks that rank owns (its TP shard of every tensor of
    its pipeline stage; replicas once), so a job at that topology reads one file per rank.
    """

    name = NAME

    def __init__(self):
        self._target = None
        self._shapes: dict[str, tuple] = {}
        self._optimizer: optim.Layout | None = None

    def notes(self, index) -> list[str]:
        return ["RNG state is not written to torch_dist outputs yet: resume with Megatron's "
                "--no-load-rng"]

    def unsupported_state(self, index) -> str | None:
        if index.unmapped or not any(k.startswith(optim.PREFIX) for k in index.tensors):
            return index.unmapped
        if optim.DISTRIBUTED_KEY in index.objects:
            return ("the source holds Megatron's distributed-optimizer state (distrib_optim.pt); "
                    "writing it to torch_dist is not implemented (only the non-distributed "
                    "optimizer's)")
        if optim.LAYOUT_KEY not in index.objects:
            return (f"the {index.format} source's optimizer state is not a Megatron optimizer's "
                    "(no param groups and step to write into common.pt)")
        return None

    def source_schema(self, opened) -> str:
        return "mcore-te"

    def plan(self, index, topo: Topology, spec: ModelSpec, schema: str = "mcore-te",
             with_optimizer: bool = True) -> list[TargetFile]:
        it_dir = iteration_dir(index.iteration if index.iteration is not None else 0)
        params = params_by_key(spec)
        padded = spec.padded_vocab(topo.tp)
        files = []
        self._shapes = {}
        self._target = (spec, topo)
        optimizer = index.objects.get(optim.LAYOUT_KEY) if with_optimizer else None
        self._optimizer = optimizer.value if optimizer else None
        kinds = optim.state_kinds(self._optimizer) if self._optimizer else ()
        for rank in layout(spec, topo):
            rank_id = rank.pp_rank * topo.tp + rank.tp_rank
            target = TargetFile(f"{it_dir}/__{rank_id}_0.distcp",
                                context={"rank": rank_id, "it_dir": it_dir, "spec": spec, "topo": topo})
            for t in rank.tensors:
                if t.replica:
                    continue
                for shard, key, offsets, lengths, shape in _chunks(t, params, spec, padded, rank.tp_rank):
                    # the optimizer's state tensors are chunked exactly like their parameter
                    for kind in (None, *kinds):
                        name = key if kind is None else optim.state_key(kind, key)
                        dtype = source_dtype(index, _first_key(t) if kind is None else
                                             optim.state_key(kind, _first_key(t)))
                        self._shapes[name] = (shape, dtype)
                        target.tensors.append(TargetTensor(
                            (name, offsets, lengths),
                            shard if kind is None else optim.state_shard(kind, shard), dtype))
            files.append(target)
        return files

    def write_file(self, store: Store, target: TargetFile, produce, index, true_vocab_size):
        ctx = target.context
        sub = store.child(ctx["it_dir"])
        sub.fs.makedirs(sub.root, exist_ok=True)
        with DcpFileWriter(sub, target.path.rsplit("/", 1)[1]) as w:
            for t in target.tensors:
                key, offsets, lengths = t.name
                w.add_chunk(key, offsets, lengths, produce(t).reshape(lengths))
            if ctx["rank"] == 0:
                spec = ctx["spec"]
                for g in range(spec.num_layers):
                    for module in EXTRA_STATE_MODULES:
                        # mcore stores each ShardedObject as the list of its local values
                        w.add_object(f"{STACKED}{module}._extra_state/shard_{g}_{spec.num_layers}",
                                     [None])
        self._remember(target.path, w)
        return w.digest

    def finalize(self, store: Store, index) -> list[str]:
        it_dir = next(iter(self.records())).rsplit("/", 1)[0]
        sub = store.child(it_dir)
        write_metadata(sub, self._shapes, self.recorded())
        sub.write_bytes(METADATA_JSON, json.dumps({
            "sharded_backend": "torch_dist", "sharded_backend_version": 1,
            "common_backend": "torch", "common_backend_version": 1}).encode())
        common = {k.removeprefix("common."): v.value for k, v in index.objects.items()
                  if k.startswith("common.")}
        for key in CANONICAL_COMMON:
            if key in index.objects:
                common[key] = index.objects[key].value
        common.setdefault("iteration", index.iteration or 0)
        common.setdefault("checkpoint_version", 3.0)
        if self._optimizer is not None:
            common[OPTIMIZER] = optim.sharded_common(self._optimizer)
        args = index.objects.get("args")
        spec, topo = self._target
        common["args"] = update_args(args.value if args else None, spec, topo, index.true_vocab_size)
        buf = io.BytesIO()
        torch.save(common, buf)
        sub.write_bytes(COMMON, buf.getvalue())
        store.write_bytes(TRACKER, str(common["iteration"]).encode())
        return [f"{it_dir}/{METADATA}", f"{it_dir}/{METADATA_JSON}", f"{it_dir}/{COMMON}", TRACKER]


def _first_key(t) -> str:
    return t.shard.regions[0].key if t.shard.regions else t.name


def _chunks(t, params, spec: ModelSpec, padded: int, tp_rank: int):
    """The DCP chunks of one layout tensor: (shard, key, chunk offsets, lengths, global shape)."""
    regions = t.shard.regions
    param = params.get(regions[0].key) if regions else params.get(t.name)
    if param is not None and param.rule == VOCAB:
        rows = t.shard.shape[0]
        yield (t.shard, param.key, (tp_rank * rows, *(0,) * (len(t.shard.shape) - 1)),
               t.shard.shape, (padded, *param.shape[1:]))
        return
    for _, region in t.shard.parts:
        key, layer = _stacked_key(region.key)
        if layer is None:
            yield Shard.of(region), key, region.offsets, region.lengths, region.global_shape
        else:
            yield (Shard.of(region), key, (layer, *region.offsets), (1, *region.lengths),
                   (spec.num_layers, *region.global_shape))


def _stacked_key(key: str) -> tuple[str, int | None]:
    """``decoder.layers.3.x`` -> (``decoder.layers.x``, 3); other keys unchanged."""
    if STACKED not in key:
        return key, None
    head, rest = key.split(STACKED, 1)
    index, _, tail = rest.partition(".")
    return (f"{head}{STACKED}{tail}", int(index)) if index.isdigit() else (key, None)
