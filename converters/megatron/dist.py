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
pieces. The older ``zarr`` backend is read by :mod:`converters.megatron.zarr` (not written).

The non-distributed optimizer (``FP32Optimizer``, ``Float16OptimizerWithFloat16Params``)
saves its state the model's way: ``optimizer.state.{exp_avg,exp_avg_sq,fp32_param}.<model
key>`` ShardedTensors (stacked like the model's, so the same per-layer split gives the
canonical keys), and its step, param groups and grad scaler in ``common.pt["optimizer"]``
(see :mod:`converters.megatron.optimizer`). The distributed optimizer's state
(``dp_reshardable`` buckets or ``fully_reshardable`` model-shaped tensors) is mapped to the
same canonical keys, and written ``fully_reshardable`` (:mod:`converters.megatron.dist_distopt`).
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, replace

from ckptool.core import optimizer as canon
from ckptool.core import torchfile
from ckptool.core.dcpfile import METADATA, DcpContainerReader
from ckptool.core.dcpwrite import DcpFileWriter, RecordedFiles, write_metadata
from ckptool.core.engine import TargetFile, TargetTensor
from ckptool.core.errors import BadCheckpoint, UnsupportedFormat
from ckptool.core.index import CheckpointIndex, Piece, TensorInfo, Writer
from ckptool.core.layout import VOCAB, ModelSpec, layout
from ckptool.core.lazy import lazy
from ckptool.core.regions import Shard
from ckptool.core.storage import Store
from ckptool.core.topology import Topology
from converters.megatron import dist_distopt as dist_distopt
from converters.megatron import distopt
from converters.megatron import optimizer as optim
from converters.megatron.common import (
    CANONICAL_COMMON,
    COMMON,
    METADATA_JSON,
    OPTIMIZER,
    STACK_TAG,
    STACKED,
    adopt_dcp_common,
    checkpoint_dir,
    is_stacked,
    metadata,
    read_common,
    split_layers,
)
from converters.schemas.megatron import TRACKER, iteration_dir, params_by_key
from converters.schemas.megatron_args import (
    UnevenStages,
    feature_notes,
    refuse_per_layer_keys,
    refuse_unrunnable_gelu,
    source_dtype,
    update_args,
)

torch = lazy("torch", globals())

EXTRA_STATE_MODULES = ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1",
                       "mlp.linear_fc2")

NAME = "megatron-dist"


def _extra_state_keys(spec: ModelSpec) -> list[str]:
    """The ``_extra_state`` objects Megatron-Core's torch_dist holds (each linear module's, per
    layer; a MoE layer's experts' per layer and global expert)."""
    n, keys = spec.num_layers, []
    for g in range(n):
        for module in EXTRA_STATE_MODULES:
            if spec.num_experts and module.startswith("mlp."):
                keys += [f"{STACKED}mlp.experts.experts.{module[4:]}._extra_state/"
                         f"shard_{g}.{e}_{n}.{spec.num_experts}" for e in range(spec.num_experts)]
            else:
                keys.append(f"{STACKED}{module}._extra_state/shard_{g}_{n}")
    return keys


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
        meta = metadata(store, base)
        if meta.get("sharded_backend") != "torch_dist":
            backend = meta.get("sharded_backend")
            raise UnsupportedFormat(f"the {backend!r} backend of Megatron-Core checkpoints is not "
                                    "read as megatron-dist (only torch_dist)", path=store.url,
                                    hint="Read it as megatron-zarr" if backend == "zarr" else None)
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
            if is_stacked(key) and len(info.shape) >= 1:
                split_layers(index, key, info, pieces)
            else:
                index.tensors[key] = TensorInfo(key, info.shape, info.dtype, pieces)
        read_common(self, store, prefix + COMMON, index, lambda value, index_, source: dist_distopt.read(
            value, index_, source, lambda obj: self.read_object(store, obj)))
        return index

    def read_piece(self, store: Store, piece: Piece, dtype: torch.dtype) -> torch.Tensor:
        detail = piece.location.detail
        if isinstance(detail, tuple) and detail and detail[0] == dist_distopt.FLAT_TAG:
            return dist_distopt.read_flat_slice(lambda p: self.read_piece(store, p, dtype), piece)
        if not (isinstance(detail, tuple) and detail and detail[0] == STACK_TAG):
            return super().read_piece(store, piece, dtype)
        _, layer, chunk_region, inner = detail
        chunk = super().read_piece(store, Piece(chunk_region, replace(piece.location, detail=inner)),
                                   dtype)
        return chunk[layer].contiguous()


# ----------------------------------------------------------------------------- writing


@dataclass(frozen=True, slots=True)
class DistFile:
    """One writer rank's ``.distcp`` file in ``it_dir`` (rank 0 also the extra state)."""

    rank: int
    it_dir: str
    spec: ModelSpec
    topo: Topology


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
        self._distributed = None
        self._schedule: dict | None = None
        self._from_deepspeed: optim.FromDeepSpeed | None = None

    def configure(self, *, megatron_lr_schedule: str | None = None, **options) -> None:
        super().configure(**options)
        self._schedule = optim.parse_schedule(megatron_lr_schedule) if megatron_lr_schedule else None

    def bind(self, opened) -> None:
        distopt.adopt_hook_state(opened)  # a save-hook checkpoint of a distributed-optimizer job
        adopt_dcp_common(opened)  # its opt_param_scheduler, stored one object per field

    def notes(self, index) -> list[str]:
        notes = ["torch_dist outputs hold no RNG state: their args say no_save_rng, so Megatron-LM's "
                 "loader starts the RNG from the job's seed without --no-load-rng", *feature_notes(index)]
        if self._from_deepspeed:
            notes.append(self._from_deepspeed.note)
        if self._distributed is not None:
            source = index.layout(distopt.Meta).sharding
            was = {None: "distrib_optim.pt in the source", distopt.HOOK_SHARDING: "the save hook's "
                   "per-rank ranges in the source"}.get(source, f"'{source}' in the source")
            notes.append(f"the distributed optimizer's state is written in Megatron-Core's "
                         f"'{dist_distopt.WRITTEN}' form ({was}): model-shaped, so megatron-core "
                         "loads it at any TP/PP/DP; common.pt's content_metadata says "
                         f"distrib_optim_sharding_type='{dist_distopt.WRITTEN}' for loaders "
                         "that build their state dict from dist_checkpointing.load_content_metadata "
                         "(Megatron-LM's); a loader that asks for another sharding type must be "
                         "told this one")
        return notes

    def unsupported_state(self, index) -> str | None:
        if index.unmapped or not any(k.startswith(canon.PREFIX) for k in index.tensors):
            return index.unmapped
        if index.layout(distopt.Meta) is not None:
            return None
        if index.layout(optim.Layout) is None and optim.deepspeed_groups(index) is None:
            return (f"the {index.format} source's optimizer state is not a Megatron optimizer's "
                    "(no param groups and step to write into common.pt)")
        return None

    def source_schema(self, opened) -> str:
        return "mcore-te"

    def plan(self, index, topo: Topology, spec: ModelSpec, schema: str = "mcore-te",
             with_optimizer: bool = True) -> list[TargetFile]:
        refuse_unrunnable_gelu(spec, "mcore")
        refuse_per_layer_keys(index)
        it_dir = iteration_dir(index.iteration if index.iteration is not None else 0)
        params = params_by_key(spec)
        padded = spec.padded_vocab(topo.tp)
        files = []
        self._shapes = {}
        self._target = (spec, topo)
        optimizer = index.layout(optim.Layout) if with_optimizer else None
        self._from_deepspeed = optim.deepspeed_state(index, self._schedule, with_optimizer)
        self._optimizer = optimizer if optimizer else \
            self._from_deepspeed.layout if self._from_deepspeed else None
        self._distributed = index.layout(distopt.Meta) if with_optimizer else None
        self._chained = bool(spec.num_experts) and topo.ep > 1  # Megatron's ChainedOptimizer
        kinds = optim.state_kinds(self._optimizer) if self._optimizer else ()
        state_name = canon.state_key
        if self._distributed is not None:  # every parameter has an fp32 master
            kinds, state_name = canon.KINDS, dist_distopt.file_key
        for rank in layout(spec, topo):
            rank_id = (rank.pp_rank * topo.tp + rank.tp_rank) * topo.ep + rank.ep_rank
            target = TargetFile(f"{it_dir}/__{rank_id}_0.distcp",
                                context=DistFile(rank_id, it_dir, spec, topo))
            for t in rank.tensors:
                if t.replica:
                    continue
                for shard, key, offsets, lengths, shape in _chunks(t, params, spec, padded, rank.tp_rank):
                    # the optimizer's state tensors are chunked exactly like their parameter
                    master = optim.master_is_weight(index, self._optimizer, _first_key(t))
                    for kind in (None, *kinds):
                        name = key if kind is None else state_name(kind, key)
                        read = "fp32_param" if kind is None and master else kind
                        dtype = source_dtype(index, _first_key(t) if read is None else
                                             canon.state_key(read, _first_key(t)))
                        self._shapes[name] = (shape, dtype)
                        target.tensors.append(TargetTensor(
                            (name, offsets, lengths),
                            shard if read is None else canon.state_shard(read, shard), dtype))
            files.append(target)
        return files

    def write_file(self, store: Store, target: TargetFile, produce, index, true_vocab_size):
        ctx: DistFile = target.context
        sub = store.child(ctx.it_dir)
        sub.fs.makedirs(sub.root, exist_ok=True)
        with DcpFileWriter(sub, target.path.rsplit("/", 1)[1]) as w:
            for t in target.tensors:
                key, offsets, lengths = t.name
                w.add_chunk(key, offsets, lengths, produce(t).reshape(lengths))
            if ctx.rank == 0:
                for key in _extra_state_keys(ctx.spec):
                    w.add_object(key, [None])  # mcore stores each ShardedObject as the list of its local values
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
        if self._from_deepspeed is not None:
            common[optim.SCHEDULER_KEY] = self._from_deepspeed.scheduler
        if self._distributed is not None:
            common[OPTIMIZER] = dist_distopt.common_entry(self._distributed, self._chained)
            common[dist_distopt.CONTENT_METADATA] = dist_distopt.content_metadata(
                common.get(dist_distopt.CONTENT_METADATA))
        args = index.objects.get("args")
        spec, topo = self._target
        common["args"] = update_args(args.value if args else None, spec, topo, index.true_vocab_size, index)
        # no RNG state is written; Megatron-LM's torch_dist loader skips the RNG of a checkpoint
        # whose args say so (else, at an unchanged TP/PP, it asks for rng_state and fails)
        common["args"].no_save_rng = True
        buf = io.BytesIO()
        torchfile.save(common, buf)  # records under their own names
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
