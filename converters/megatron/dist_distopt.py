"""Megatron-Core's distributed optimizer in ``torch_dist`` checkpoints, mapped to parameters.

Not a format: what :mod:`converters.megatron.dist` reads and writes for it, written once.

``DistributedOptimizer.sharded_state_dict`` (megatron-core 0.16) saves the state in the
form ``metadata["distrib_optim_sharding_type"]`` names, and says which in ``common.pt``
(``optimizer.param_state_sharding_type``; Megatron-LM also keeps the metadata as
``common.pt["content_metadata"]``, which ``dist_checkpointing.load_content_metadata``
returns to a loader to build the matching state dict):

* ``dp_reshardable`` (Megatron-LM's default): the buffers as they are. One 1-D tensor per
  (TP/PP rank, grad buffer, bucket, kind): ``optimizer.distributed.dp_group_idx_{g}.
  gbuf_idx_{i}.dtype_({param dtype}, {grad dtype}).bucket_idx_{b}.{param,exp_avg,exp_avg_sq}``,
  of the bucket's length without its tail padding (so any DP size loads it), each DP rank's
  parameter slices and the 64-alignment gaps as separate chunks. ``g`` is the rank in the
  model-parallel group (``pp_rank * TP + tp_rank``). The elements follow Megatron's buffer
  rule (:mod:`converters.megatron.distopt`): the same offsets as ``distrib_optim.pt``, cut
  at the bucket boundaries, which the rule gives from args and the tensors' lengths check.
  The param groups (with the step) and grad scaler are pickled objects per ``g``
  (``optimizer.distributed.dp_group_idx_{g}.optimizer``...).
* ``fully_reshardable``: model-shaped, like the non-distributed optimizer's, but the fp32
  master is ``optimizer.state.param.<key>``; the param groups are in ``common.pt``. mcore
  0.16 saves a parameter's slice of the buffer by its offset in the *padded* buffer
  (``param_index_map``) from a buffer whose bucket tails it cut: past the first bucket
  boundary the tensors hold other elements (it warns "param range exceeds unpadded buffer
  ... can lead to data corruption"). So a grad buffer of several buckets is refused; its
  loader is exact (it slices the model-shaped tensors), so ckptool writes this form.
* ``fully_sharded_model_space`` (deprecated; flattened ShardedTensors, which mcore 0.16 can
  neither save nor load), ``dp_zero_gather_scatter`` (deprecated) and ``fsdp_dtensor``
  (Megatron FSDP) are refused with the reason.
"""

from __future__ import annotations

import copy
import re
from dataclasses import replace

from ckptool.core import optimizer as canon
from ckptool.core.errors import UnreadableInput
from ckptool.core.index import CheckpointIndex, Location, Piece, TensorInfo
from ckptool.core.layout import ModelSpec
from ckptool.core.lazy import lazy
from ckptool.core.regions import Region
from converters.megatron import distopt
from converters.schemas.megatron_args import source_dtype

torch = lazy("torch", globals())

DP_RESHARDABLE, FULLY_RESHARDABLE = "dp_reshardable", "fully_reshardable"
WRITTEN = FULLY_RESHARDABLE
"""The form ckptool writes: model-shaped, so mcore loads it at any TP/PP/DP."""
CONTENT_METADATA = "content_metadata"
SHARDING_FIELD = "distrib_optim_sharding_type"
FLAT_TAG = "flat-slice"
"""First item of the location detail of a piece that is a slice of a stored 1-D chunk:
``(FLAT_TAG, first element in the chunk, the chunk's region, the chunk's own detail)``."""
_REFUSED = {
    "fully_sharded_model_space": "Megatron-Core's deprecated 'fully_sharded_model_space' "
    "distributed-optimizer state (flattened ShardedTensors, which megatron-core 0.16 itself "
    "neither saves nor loads) is not read",
    "dp_zero_gather_scatter": "Megatron-Core's deprecated 'dp_zero_gather_scatter' "
    "distributed-optimizer state (whole buffers pickled per TP/PP rank) is not read",
    "fsdp_dtensor": "Megatron FSDP's 'fsdp_dtensor' optimizer state is not read",
}
_BUCKET = re.compile(r"^(?:chained_(\d+)\.)?optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\."
                     r"dtype_\(torch\.(\w+), torch\.(\w+)\)\.bucket_idx_(\d+)\.(\w+)$")
_DISTRIBUTED = "optimizer.distributed."
_DISTRIBUTED_KEY = re.compile(r"^(chained_\d+\.)?optimizer\.distributed\.")
"""A dp_reshardable entry: of the one optimizer, or of a ChainedOptimizer's dense (``chained_0.``)
or expert (``chained_1.``) optimizer."""
_SCHEMA = {"local": "mcore-local", "transformer_engine": "mcore-te"}


def file_key(kind: str, canonical: str) -> str:
    """The torch_dist key of a parameter's state in the model-shaped forms."""
    return canon.state_key(distopt.FILE_KEYS[kind], canonical)


def read(value: dict, index: CheckpointIndex, source: str, read_object) -> None:
    """Map the distributed optimizer's tensors of ``index`` to the canonical
    ``optimizer.state.<kind>.<param>`` and record its :class:`distopt.Meta`; ``value`` is
    common.pt's optimizer entry, ``read_object(name)`` reads a stored object."""
    chained = sorted(value) == [0, 1]  # ChainedOptimizer [dense, expert]: a MoE model at EP > 1
    parts = [value[0], value[1]] if chained else [value]
    sharding = parts[0]["param_state_sharding_type"]
    if any(p["param_state_sharding_type"] != sharding for p in parts):
        raise UnreadableInput("the dense and the expert optimizer are saved in different forms",
                              path=source)
    if sharding not in (DP_RESHARDABLE, FULLY_RESHARDABLE):
        raise UnreadableInput(_REFUSED.get(sharding, f"unknown distributed-optimizer sharding "
                                                     f"{sharding!r}"), path=source)
    args = index.objects.get("args")
    if args is None or index.model_config is None:
        raise UnreadableInput("common.pt has no Megatron args to lay out the distributed "
                              "optimizer's buffers by", path=source)
    args, spec = args.value, ModelSpec(**index.model_config)
    if chained != (bool(spec.num_experts) and index.topology.ep > 1):
        raise UnreadableInput(f"common.pt holds {'two optimizers' if chained else 'one optimizer'}; "
                              f"a model {'with experts at EP > 1' if not chained else 'without experts at EP > 1'} "
                              f"has {'two' if not chained else 'one'} (Megatron's ChainedOptimizer)", path=source)
    expert_state = None
    if sharding == FULLY_RESHARDABLE:
        state, grads = _read_model_shaped(parts[0], index, spec, args, source, chained), _grad_dtype(args)
        expert_state = _state(parts[1], source) if chained else None
        keys = {d: (d, grads or d) for d in {i.dtype for k, i in index.tensors.items()
                                             if not k.startswith("optimizer.")}}
        if grads is None:
            keys = {}  # unknown: a writer that needs it (distrib_optim.pt) says so
    else:
        state, keys, expert_state = _read_buckets(index, spec, args, source, read_object, chained)
    index.set_layout(distopt.Meta(keys, state, sharding, expert_state))


def common_entry(meta: distopt.Meta, chained: bool = False) -> dict:
    """common.pt's optimizer entry for the state ckptool writes (:data:`WRITTEN`): one
    optimizer's, or a ChainedOptimizer's ``{0: dense, 1: expert}`` (a MoE target at EP > 1),
    the param groups as Megatron-Core matches them (:func:`distopt.target_state`)."""
    states = distopt.target_state(meta, chained)
    if not chained:
        return {**copy.deepcopy(states), "param_state_sharding_type": WRITTEN}
    return {i: {**copy.deepcopy(s), "param_state_sharding_type": WRITTEN} for i, s in enumerate(states)}


def content_metadata(source: dict | None) -> dict:
    """The source's content metadata, saying the sharding type ckptool writes and that a
    ChainedOptimizer's state keys carry no ``chained_{i}.`` prefix (Megatron-LM's default,
    which the model-shaped keys need: the dense and the expert optimizer share them)."""
    return {**copy.deepcopy(source or {}), SHARDING_FIELD: WRITTEN, "chained_optim_avoid_prefix": True}


def read_flat_slice(read_chunk, piece: Piece) -> torch.Tensor:
    """A :data:`FLAT_TAG` piece, given ``read_chunk(chunk piece)``."""
    _, start, chunk_region, inner = piece.location.detail
    chunk = read_chunk(Piece(chunk_region, replace(piece.location, detail=inner)))
    n = piece.region.numel
    return chunk.reshape(-1)[start:start + n].reshape(piece.region.local_shape)


# ------------------------------------------------------------------------------ reading


def _schema(args) -> str:
    impl = getattr(args, "transformer_impl", None)
    if impl not in _SCHEMA:
        raise UnreadableInput(f"Megatron args say transformer_impl={impl!r}; the order of the "
                              "parameters in the distributed optimizer's buffers is known only "
                              "for 'local' and 'transformer_engine'")
    return _SCHEMA[impl]


def _grad_dtype(args) -> torch.dtype | None:
    fp32 = getattr(args, "accumulate_allreduce_grads_in_fp32", None)
    if fp32 is None:
        return None
    return torch.float32 if fp32 else getattr(args, "params_dtype", None)


def _ranks(index, spec, args):
    topo = index.topology
    return distopt.rank_params(spec, topo, _schema(args),
                               lambda t: source_dtype(index, t.shard.regions[0].key
                                                      if t.shard.regions else t.name))


def _state(value: dict, source: str) -> dict:
    """``DistributedOptimizer.state_dict()``: param groups (with the step), grad scaler."""
    state = {k: v for k, v in value.items()
             if k not in ("param_state_sharding_type", "param_state")}
    inner = state.get("optimizer")
    if not (isinstance(inner, dict) and isinstance(inner.get("param_groups"), list)):
        raise UnreadableInput("the distributed optimizer's param groups are missing", path=source)
    return state


def _read_model_shaped(value, index, spec, args, source, chained: bool = False) -> dict:
    if not index.written_by_ckptool:
        try:
            distopt.bucket_size(args, index.topology.dp, 0, 0)
        except UnreadableInput as exc:
            raise UnreadableInput(f"{exc.message.split(',')[0]}, which decides whether "
                                  "megatron-core saved 'fully_reshardable' state exactly",
                                  path=source) from None
        for rank in _ranks(index, spec, args):
            groups = rank.optimizer_chunks(chained)  # the expert optimizer's buffers are its own
            for buffer in (b for g in groups for b in distopt.layout(g, args, index.topology.dp, rank.pp)):
                if len(buffer.buckets) > 1:
                    raise UnreadableInput(
                        f"TP rank {rank.tp} / PP rank {rank.pp} has a grad buffer of "
                        f"{len(buffer.buckets)} buckets: megatron-core 0.16 saves "
                        "'fully_reshardable' state past a bucket boundary shifted by the "
                        "bucket padding (\"param range exceeds unpadded buffer\"), so it is "
                        "not the parameters' state", path=source,
                        hint="Save with dp_reshardable, or with one DDP bucket")
    for key in [k for k in index.tensors if k.startswith(canon.PREFIX + "param.")]:
        canonical = canon.state_key("fp32_param", key[len(canon.PREFIX + "param."):])
        info = index.tensors.pop(key)
        index.tensors[canonical] = TensorInfo(
            canonical, info.shape, info.dtype,
            [Piece(replace(p.region, key=canonical), p.location) for p in info.pieces],
            [Piece(replace(p.region, key=canonical), p.location) for p in info.replicas])
    return _state(value, source)


def _read_buckets(index, spec, args, source, read_object, chained: bool = False) -> tuple[dict, dict, dict | None]:
    """The ``dp_reshardable`` bucket tensors as per-parameter pieces; the optimizer state (and
    the expert optimizer's, ``chained``).

    All or nothing: the index changes only once every rank has mapped, so a refusal leaves
    the stored bucket tensors in place (``verify`` still checks them as stored)."""
    stored: dict[tuple, dict[int, dict[str, TensorInfo]]] = {}
    dtypes: dict[tuple, tuple] = {}
    bucket_keys = [k for k in index.tensors if _DISTRIBUTED_KEY.match(k)]
    added: dict[str, TensorInfo] = {}
    for key in bucket_keys:
        m = _BUCKET.match(key)
        if m is None or m.group(7) not in distopt.FILE_KEYS.values() or (m.group(1) is not None) != chained:
            raise UnreadableInput(f"distributed-optimizer tensor {key} is not a bucket of "
                                  "Megatron's buffers", path=source)
        c = None if m.group(1) is None else int(m.group(1))
        g, i, b = int(m.group(2)), int(m.group(3)), int(m.group(6))
        dtypes[(c, g, i)] = (getattr(torch, m.group(4)), getattr(torch, m.group(5)))
        stored.setdefault((c, g, i), {}).setdefault(b, {})[m.group(7)] = index.tensors[key]
    keys: dict[torch.dtype, tuple] = {}
    states: dict = {}
    for c, g, rank, chunks in _optimizers(index, spec, args, chained):
        try:
            buffers = distopt.layout(chunks, args, index.topology.dp, rank.pp)
        except UnreadableInput as exc:
            raise UnreadableInput(exc.message.replace("distrib_optim.pt", "the distributed optimizer's buckets"),
                                  path=source) from None
        for i, buffer in enumerate(buffers):
            buckets = stored.pop((c, g, i), None)
            where = f"{_chain(c)}dp_group_idx_{g} gbuf_idx_{i}"
            if buckets is None or dtypes[(c, g, i)][0] != buffer.dtype:
                raise UnreadableInput(f"{where}: no {buffer.dtype} grad buffer of the "
                                      "parameters args describe", path=source)
            lengths = _lengths(buckets, where, source)
            if lengths != buffer.buckets:
                raise UnreadableInput(
                    f"{where} holds buckets of {list(lengths)} elements, Megatron's layout "
                    f"rule gives {list(buffer.buckets)} (bucket size {buffer.bucket_size}); "
                    "ckptool cannot map it to parameters", path=source)
            keys[buffer.dtype] = dtypes[(c, g, i)]
            _add_pieces(added, rank, buffer, buckets, source)
        states.setdefault(c, []).append(_group_state(index, c, g, source, read_object))
    if stored:
        c, g, i = min(stored, key=lambda k: (k[0] or 0, k[1], k[2]))
        raise UnreadableInput(f"{_chain(c)}dp_group_idx_{g} gbuf_idx_{i} holds optimizer state of no "
                              "parameter args describe", path=source)
    for group in states.values():  # per optimizer: its groups' steps, the same on every rank
        steps = {repr(_steps(s)) for s in group}
        if len(steps) > 1:
            raise UnreadableInput(f"model-parallel ranks disagree on the optimizer step: "
                                  f"{sorted(steps)}", path=source)
    if len({repr(sorted(set(map(repr, _steps(g[0]))))) for g in states.values()}) > 1:
        raise UnreadableInput("the dense and the expert optimizer are at different steps", path=source)
    for key in bucket_keys:
        del index.tensors[key]
    index.tensors.update(added)
    for key in [k for k in index.objects if _DISTRIBUTED_KEY.match(k)]:
        del index.objects[key]
    if chained:
        return states[0][0], keys, states[1][0]
    return states[None][0], keys, None


def _chain(c: int | None) -> str:
    return "" if c is None else f"chained_{c}."


def _optimizers(index, spec, args, chained: bool):
    """``(sub-optimizer, dp_group_idx, rank, its grad buffers' chunks)`` of every distributed
    optimizer, as Megatron-Core numbers them: one per (TP, PP) rank (``dp_group_idx`` its rank
    in the TP x PP group); at EP > 1 (``chained``) the dense one (``chained_0.``) per (TP, PP)
    rank and the expert one (``chained_1.``) per (expert TP, EP, PP) rank, ``dp_group_idx`` its
    rank in the ETP x EP x PP group (``etp + ETP·(ep + EP·pp)``)."""
    topo = index.topology
    for rank in _ranks(index, spec, args):
        if not chained:
            yield None, rank.pp * topo.tp + rank.tp, rank, rank.chunks
            continue
        dense, experts = rank.optimizer_chunks(chained)
        if rank.ep == 0:
            yield 0, rank.pp * topo.tp + rank.tp, rank, dense
        if rank.tp < topo.expert_tp:
            yield 1, rank.tp + topo.expert_tp * (rank.ep + topo.ep * rank.pp), rank, experts


def _lengths(buckets: dict, where: str, source: str) -> tuple[int, ...]:
    if sorted(buckets) != list(range(len(buckets))):
        raise UnreadableInput(f"{where} has buckets {sorted(buckets)}", path=source)
    out = []
    for b in range(len(buckets)):
        kinds = buckets[b]
        shapes = {k: tuple(v.shape) for k, v in kinds.items()}
        if set(kinds) != set(distopt.FILE_KEYS.values()) or len(set(shapes.values())) != 1 or \
                any(v.dtype != torch.float32 or len(v.shape) != 1 for v in kinds.values()):
            raise UnreadableInput(f"{where} bucket {b} is not three float32 vectors of one "
                                  f"length: {shapes}", path=source)
        out.append(shapes["param"][0])
    return tuple(out)


def _add_pieces(tensors: dict, rank, buffer, buckets, source: str) -> None:
    starts = [sum(buffer.buckets[:b]) for b in range(len(buffer.buckets))]
    for uname, offset in buffer.offsets.items():
        b = max(j for j, s in enumerate(starts) if s <= offset)
        t = rank.tensors[uname]
        for kind, fkey in distopt.FILE_KEYS.items():
            bucket = buckets[b][fkey]
            for off, region in t.shard.parts:
                key = canon.state_key(kind, region.key)
                info = tensors.get(key)
                if info is None:
                    info = tensors[key] = TensorInfo(key, region.global_shape, bucket.dtype)
                copies = info.replicas if t.replica else info.pieces
                copies.extend(_slices(bucket, offset - starts[b] + off, replace(region, key=key), source))


def _slices(bucket: TensorInfo, start: int, region: Region, source: str) -> list[Piece]:
    """Pieces of ``region`` stored as elements ``start...`` of the 1-D ``bucket`` tensor."""
    out = []
    stop = start + region.numel
    for chunk in bucket.pieces:
        lo = chunk.region.offsets[0]
        a, b = max(start, lo), min(stop, lo + chunk.region.lengths[0])
        if a >= b:
            continue
        flat = None if (a, b) == (start, stop) else (a - start, b - start)
        loc = chunk.location
        out.append(Piece(replace(region, flat=flat),
                         Location(loc.file, loc.offset, loc.length,
                                  (FLAT_TAG, a - lo, chunk.region, loc.detail))))
    if sum(p.region.numel for p in out) != region.numel:
        raise UnreadableInput(f"the chunks of {bucket.key} do not cover elements {start}.."
                              f"{stop}", path=source)
    return out


def _group_state(index, c: int | None, g: int, source: str, read_object) -> dict:
    """``DistributedOptimizer.state_dict()`` of model-parallel rank ``g`` (of sub-optimizer
    ``c`` of a ChainedOptimizer; pickled objects, each the list of one rank's value)."""
    state = {}
    prefix = f"{_chain(c)}{_DISTRIBUTED}dp_group_idx_{g}."
    for key, obj in index.objects.items():
        if key.startswith(prefix) and key.endswith("/shard_0_1"):
            name = key[len(prefix):-len("/shard_0_1")]
            if name not in ("per_bucket_numel", "per_bucket_numel_unpadded"):
                value = read_object(obj)
                if not (isinstance(value, list) and len(value) == 1):
                    raise UnreadableInput(f"{key} is not one rank's object", path=source)
                state[name] = value[0]
    return _state(state, source)


def _steps(state: dict) -> list:
    return [g.get("step") for g in state["optimizer"]["param_groups"]]
