"""Megatron-style models to the hook's global description, by the shared layout rules.

A rank of a TP x PP x DP job holds local parameters under local names (``decoder.layers.0...``
counts from the stage's first layer). :func:`sharded_state` maps each one to the regions of
the global, topology-independent tensors it holds, using :func:`ckptool.core.layout.layout`:
the same rules the offline reader, writer and reshard use (grouped QKV, SwiGLU
``[gate_r; up_r]``, vocab padding, PP layer offsets, VPP chunks, tied embeddings). The
checkpoint keys are the canonical global names, so a checkpoint saved at TP2/PP2 loads at
TP1/PP4 or converts offline with ``ckptool convert``.

Mixture-of-Experts ranks: the local experts ``...mlp.experts.local_experts.{j}`` of EP rank
e are the global experts ``e·E/EP + j`` of the stacked tensors
``...mlp.experts.experts.linear_fc1.weight`` ``[E, ...]`` (split inside by the rank's expert TP
rank), by the same rule, so a job saved at EP2 resumes at EP1 or EP4. A rank's EP and
expert-DP ranks follow from its TP and DP ranks (:func:`ckptool.core.layout.expert_ranks`).

Adam state (``exp_avg``, ``exp_avg_sq``, ``step``) of a ``torch.optim.Adam``/``AdamW`` over
the same parameters goes under ``optimizer.state.<kind>.<key>``, the names the Megatron
converters use, so it reshards with the weights.

Megatron-Core's ``DistributedOptimizer`` (alone or in a ``ChainedOptimizer``, bf16 weights
with fp32 main params or fp32): each DP rank holds, per parameter, the contiguous range
``[start, end)`` of its TP shard's flat elements that mcore's buffer gives it
(``_get_model_param_range_map``), as a 1-D fp32 main param with its Adam moments. That range
is cut into the TP shard's regions (:func:`~ckptool.core.regions.flat_regions`, the rule
ZeRO partitions use), under ``optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.<key>``, the
canonical names ckptool's distributed-optimizer readers give, so the state reshards to any
TP, PP and DP. The DP rank holding a parameter's first element writes its step.

Two ways in, one description out:

* :func:`sharded_state` places each parameter by ckptool's layout rules from a
  :class:`~ckptool.core.layout.ModelSpec`;
* :func:`from_sharded_state_dict` takes Megatron-Core's own ``model.sharded_state_dict()``
  (each ``ShardedTensor``'s key, global shape and offset, factories built in place), so any
  model Megatron-Core describes is saved without a spec. Its stacked layer keys are unstacked
  by the readers' one rule (:func:`converters.megatron.common.layer_key`), so both give the
  same checkpoint keys: a job saved through one resumes through the other.
"""

from __future__ import annotations

from typing import Iterable, Mapping

import torch

from ckptool.core.errors import UsageError
from ckptool.core.layout import ModelSpec, expert_name, expert_of, expert_ranks, layout
from ckptool.core.optimizer import state_key, state_shard
from ckptool.core.regions import Region, Shard
from ckptool.core.topology import Topology
from converters.megatron.common import is_stacked, layer_key
from converters.schemas.megatron import SCHEMAS, detect_schema
from training.state import ADAM_KINDS, Owned, Sharded, adam_state, flat_entry



def sharded_state(model, spec: ModelSpec, topo: Topology, *, tp_rank: int, pp_rank: int,
                  dp_rank: int = 0, ep_rank: int | None = None,
                  optimizer: torch.optim.Optimizer | None = None,
                  schema: str | None = None) -> dict:
    """``{"model": {key: Sharded}, "optimizer": {key: Sharded}}`` for this rank.

    ``model`` is a module, a list of modules (virtual pipeline chunks), or a mapping of
    local names to tensors. ``schema`` is the naming (``mcore-local``, ``mcore-te``,
    ``legacy``); by default it is inferred from the names. ``ep_rank`` (MoE), when given,
    is checked against the one Megatron-Core's rank order gives this TP and DP rank.
    """
    chunks = _named_chunks(model)
    names = [n for chunk in chunks for n in chunk]
    schema = schema or detect_schema(names)
    if schema not in SCHEMAS:
        raise UsageError(f"unknown Megatron naming {schema!r}", hint=f"Use one of {', '.join(SCHEMAS)}")
    _, derived_ep, expert_dp_rank = expert_ranks(topo, tp_rank, dp_rank)
    if ep_rank is not None and ep_rank != derived_ep:
        raise UsageError(f"TP rank {tp_rank} / DP rank {dp_rank} of {topo} is EP rank {derived_ep} in "
                         f"Megatron-Core's rank order (tp-cp-ep-dp-pp), not {ep_rank}",
                         hint="ckptool lays out the default order only")
    rank = next((r for r in layout(spec, topo)
                 if (r.pp_rank, r.tp_rank, r.ep_rank) == (pp_rank, tp_rank, derived_ep)), None)
    if rank is None:
        raise UsageError(f"TP rank {tp_rank} / PP rank {pp_rank} is not a rank of {topo}",
                         hint="Pass this process's ranks in the Topology given to sharded_state")
    expected = {(t.chunk, t.name): t for t in rank.tensors}
    tied = spec.tied_embeddings and pp_rank == topo.pp - 1 and pp_rank > 0
    distributed = _distributed_optimizers(optimizer)

    model_state, optim_state, seen = {}, {}, set()
    for c, params in enumerate(chunks):
        for name, tensor in params.items():
            canonical, _, _ = SCHEMAS[schema].to_canonical(name, tied)
            if canonical is None:  # _extra_state
                continue
            local = expected.get((c, canonical))
            if local is None:
                raise UsageError(f"parameter {name!r} (chunk {c}) is not in the layout of PP rank "
                                 f"{pp_rank} / TP rank {tp_rank} of {topo}",
                                 hint="Check the ModelSpec and Topology given to sharded_state")
            seen.add((c, canonical))
            region_key = local.shard.regions[0].key if local.shard.parts else canonical
            expert = local_expert(local)
            if expert is None:
                replica, key = local.replica or dp_rank > 0, region_key
                step_replica = replica or tp_rank > 0
            else:  # one entry per expert; the layer's experts share one step (written once)
                replica, key = local.replica or expert_dp_rank > 0, expert_name(region_key, expert)
                step_replica = replica or expert > 0 or tp_rank > 0
            entry = Sharded(tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor,
                            local.shard, replica)
            model_state[key] = entry
            if distributed is not None:  # DP ranks hold disjoint ranges: no DP replicas
                first_only = local.replica or tp_rank > 0 or (expert or 0) > 0
                optim_state.update(_distributed_state(distributed, tensor, key, local.shard,
                                                      local.replica, region_key, first_only, name))
            elif optimizer is not None:
                optim_state.update(_adam_state(optimizer, tensor, key, local.shard, replica,
                                               region_key, step_replica))
    missing = [f"{n} (chunk {c})" for (c, n) in expected if (c, n) not in seen]
    if missing:
        raise UsageError(f"the model lacks {len(missing)} tensors the layout expects, e.g. "
                         f"{', '.join(missing[:3])}", hint="Check the ModelSpec given to sharded_state")
    state = {"model": model_state}
    if optimizer is not None:
        state["optimizer"] = optim_state
    if distributed is not None:
        state["megatron"] = {"distributed_optimizer": distributed_common(distributed)}
    return state


def from_sharded_state_dict(model_sd, *, optimizer=None) -> dict:
    """``{"model": ..., "optimizer": ..., "megatron": ...}`` for this rank, from Megatron-Core's
    own description of the model: ``model.sharded_state_dict()`` of each chunk (a dict, or a
    list of them with virtual pipelining), as Megatron-LM's ``generate_state_dict`` builds it.

    Each ``ShardedTensor`` is the box ``global_offset + local shape`` of the global tensor
    ``key``; a stacked key (``decoder.layers.x``, the layer on a prepended axis) is layer
    ``global_offset[0]``'s canonical tensor. A ``ShardedTensorFactory`` (SwiGLU's fc1 halves,
    grouped experts) is built, and each built tensor must be a view of the parameter: the
    parameter is then one local tensor holding all their regions, loaded in place. The main
    replica (``replica_id`` all zero) writes. ``ShardedObject``s holding a value (Transformer
    Engine's ``_extra_state``) are kept by the rank of their main replica; empty ones (the
    local spec's) carry nothing and are left out.

    ``optimizer`` is described as :func:`sharded_state` does (a DistributedOptimizer or
    ChainedOptimizer, or a torch Adam over the parameters), each parameter's state cut by the
    same regions. The distributed optimizer's own ``sharded_state_dict`` is not used: in
    Megatron-Core 0.16 its per-rank model-space form is gone (``flattened_range`` is refused),
    ``dp_reshardable`` is bucket space (fixed TP/PP) and ``fully_reshardable`` gathers every
    DP rank's state on DP rank 0 at save, which would stall training.
    """
    chunks = model_sd if isinstance(model_sd, (list, tuple)) else [model_sd]
    params: dict[int, list] = {}  # id(base) -> [base, parts, replica_id, name]
    objects = {}
    for chunk in chunks:
        for name, leaf in _sharded_leaves(chunk):
            kind = _mcore_kind(leaf)
            if kind == "object":
                if leaf.data is not None:
                    objects[leaf.unique_key] = Owned(leaf.data, not _is_main(leaf.replica_id))
                continue
            if kind is None:
                raise UsageError(f"the sharded state dict holds {type(leaf).__name__} at {name!r}",
                                 hint="Pass model.sharded_state_dict() of each model chunk")
            base = leaf.data
            built = [leaf] if kind == "tensor" else _built(leaf, name)
            entry = params.setdefault(id(base), [base, [], leaf.replica_id, name])
            for t in built:
                entry[1].append((_offset_in(base, t, name), _unstacked_region(t, name)))
    model_state, optim_state = {}, {}
    distributed = _distributed_optimizers(optimizer)
    for base, parts, replica_id, name in params.values():
        shard = Shard(tuple(base.shape), tuple(sorted(parts, key=lambda p: p[0])))
        first = shard.regions[0]
        key = first.key if first.key not in model_state else f"{first.key}@{first.offsets}"
        replica = not _is_main(replica_id)
        model_state[key] = Sharded(base.data if isinstance(base, torch.nn.Parameter) else base,
                                   shard, replica)
        if optimizer is None:
            continue
        # the step is one scalar per global tensor: the rank holding its first element writes it
        holds_first = any(not any(r.offsets) for r in shard.regions)
        if distributed is not None:  # DP ranks hold disjoint ranges of the same shard
            replica = any(replica_id[:-1]) if isinstance(replica_id, tuple) else replica
            optim_state.update(_distributed_state(distributed, base, key, shard, replica,
                                                  first.key, replica or not holds_first, name))
        else:
            optim_state.update(_adam_state(optimizer, base, key, shard, replica, first.key,
                                           replica or not holds_first))
    state = {"model": {**model_state, **objects}}
    if optimizer is not None:
        state["optimizer"] = optim_state
    if distributed is not None:
        state["megatron"] = {"distributed_optimizer": distributed_common(distributed)}
    return state


def _sharded_leaves(tree, path: str = ""):
    """``(path, leaf)`` of a sharded state dict's nested dicts and lists."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _sharded_leaves(v, f"{path}.{k}" if path else str(k))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _sharded_leaves(v, f"{path}[{i}]")
    else:
        yield path, tree


def _mcore_kind(leaf) -> str | None:
    from megatron.core.dist_checkpointing.mapping import (
        ShardedObject,
        ShardedTensor,
        ShardedTensorFactory,
    )

    if isinstance(leaf, ShardedTensor):
        return "tensor"
    if isinstance(leaf, ShardedTensorFactory):
        return "factory"
    if isinstance(leaf, ShardedObject):
        return "object"
    return None


def _built(factory, name: str) -> list:
    """The ShardedTensors a factory builds (SwiGLU halves, grouped experts...)."""
    out = []
    for path, leaf in _sharded_leaves(factory.build(), name):
        kind = _mcore_kind(leaf)
        if kind == "factory":
            out += _built(leaf, path)
        elif kind == "tensor":
            out.append(leaf)
        else:
            raise UsageError(f"the factory at {name!r} builds {type(leaf).__name__}, not tensors")
    return out


def _is_main(replica_id) -> bool:
    return all(r == 0 for r in replica_id) if isinstance(replica_id, tuple) else replica_id == 0


def _offset_in(base: torch.Tensor, t, name: str) -> int:
    """Element offset of the ShardedTensor ``t``'s data in the parameter ``base``: its data
    must be a contiguous piece of the parameter's storage, so a load fills it in place."""
    data = t.data
    if getattr(t, "flattened_range", None) is not None:
        raise UsageError(f"{t.key!r} at {name!r} is a flattened range (an old Megatron-Core "
                         "distributed-optimizer form)", hint="Pass the model's sharded_state_dict()")
    inside = (data.is_contiguous() and base.is_contiguous() and data.dtype == base.dtype
              and data.untyped_storage().data_ptr() == base.untyped_storage().data_ptr())
    offset = (data.data_ptr() - base.data_ptr()) // max(base.element_size(), 1) if inside else -1
    if not inside or offset < 0 or offset + data.numel() > base.numel():
        raise UsageError(f"{t.key!r} at {name!r} is not a contiguous view of its parameter, "
                         "so it could not be loaded in place",
                         hint="Describe this model with training.megatron.sharded_state and a ModelSpec")
    return offset


def _unstacked_region(t, name: str) -> Region:
    """The canonical region of a ShardedTensor: a stacked key's layer axis (the first
    prepended one) becomes the key's layer index; other prepended axes (experts) stay, with
    length 1."""
    shape, offsets, pre = tuple(t.global_shape), tuple(t.global_offset), t.prepend_axis_num
    lengths = (1,) * pre + tuple(t.data.shape)
    if len(lengths) != len(shape):
        raise UsageError(f"{t.key!r} at {name!r}: data of shape {tuple(t.data.shape)} and "
                         f"{pre} prepended axes do not make its global shape {shape}")
    if pre and is_stacked(t.key):
        return Region(layer_key(t.key, offsets[0]), shape[1:], offsets[1:], lengths[1:])
    return Region(t.key, shape, offsets, lengths)


def distributed_common(inners: list) -> dict:
    """What Megatron-LM keeps of a DistributedOptimizer beside its parameter state (its
    ``state_dict()``: param groups with the step, the grad scaler), for each optimizer of a
    ChainedOptimizer (``[dense, expert]``), and each grad buffer's ``(param dtype, grad
    dtype)``: what ``ckptool convert --to megatron/megatron-dist`` writes the optimizer's
    common state from (:func:`converters.megatron.distopt.hook_meta`)."""
    return {"states": [o.state_dict() for o in inners],
            "buffer_dtypes": sorted({(b.param_dtype, b.grad_dtype) for o in inners for b in o.buffers},
                                    key=str)}


def _named_chunks(model) -> list[Mapping[str, torch.Tensor]]:
    """Each chunk's parameters by local name, without the wrappers' ``module.`` prefixes
    (``DistributedDataParallel``, ``Float16Module``: what Megatron-LM's ``unwrap_model``
    takes off)."""
    if isinstance(model, Mapping):
        return [model]
    modules: Iterable = model if isinstance(model, (list, tuple)) else [model]
    return [{_unwrapped(n): p for n, p in m.named_parameters()} for m in modules]


def _unwrapped(name: str) -> str:
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def _distributed_optimizers(optimizer) -> list | None:
    """The Megatron-Core DistributedOptimizers of ``optimizer`` (itself, or those a
    ChainedOptimizer chains), or None when it is not one."""
    if optimizer is None:
        return None
    inners = list(getattr(optimizer, "chained_optimizers", None) or [optimizer])
    found = [o for o in inners if hasattr(o, "_get_model_param_range_map")]
    if not found:
        return None
    if len(found) != len(inners):
        raise UsageError("a ChainedOptimizer that mixes Megatron-Core's DistributedOptimizer with "
                         "other optimizers is not supported")
    for o in found:
        if getattr(o.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False):
            raise UsageError("Megatron-Core's precision-aware optimizer (TE FusedAdam keeping "
                             "master params itself) is not supported yet",
                             hint="Run without --use-precision-aware-optimizer")
    return found


def _distributed_state(inners: list, param: torch.Tensor, key: str, shard: Shard, replica: bool,
                       canonical: str, step_replica: bool, name: str) -> dict[str, Sharded]:
    """The fp32 main param, Adam moments and step of this DP rank's range of ``param`` in a
    DistributedOptimizer (nothing if the range is empty on this rank), under state dict keys
    made from ``key`` and regions of the global tensors of ``canonical`` (a local expert's
    ``key`` names it, its regions are the stacked experts'). The moments and the step are
    created (zero) if the optimizer has not stepped yet, so a load fills them."""
    inner = next((o for o in inners if param in o.model_param_group_index_map), None)
    if inner is None:
        return {}
    span = inner._get_model_param_range_map(param)["param"]
    group, order = inner.model_param_group_index_map[param]
    main = inner.optimizer.param_groups[group]["params"][order]
    if main.numel() != span.end - span.start:
        raise UsageError(f"the distributed optimizer's main param of {name!r} has {main.numel()} "
                         f"elements, its range [{span.start}, {span.end}) "
                         f"{span.end - span.start}")
    state = adam_state(inner.optimizer, main, "training.megatron")
    out = {}
    for kind, buffer in (("fp32_param", main), *((k, state[k]) for k in ADAM_KINDS)):
        out[state_key(kind, key)] = flat_entry(buffer.detach().view(-1), shard.parts, span.start,
                                               span.end, state_key(kind, canonical), replica)
    out[state_key("step", key)] = Sharded(state["step"], Shard.of(Region.whole(state_key("step", canonical), ())),
                                          step_replica or span.start > 0)
    return out


def local_expert(t) -> int | None:
    """The global expert a layout tensor holds (a stacked expert tensor's region), or None."""
    parts = t.shard.parts
    if not parts or expert_of(t.name) is None:
        return None
    return parts[0][1].offsets[0]


def _adam_state(optimizer: torch.optim.Optimizer, param: torch.Tensor, key: str, shard: Shard,
                replica: bool, step_key: str, step_replica: bool) -> dict[str, Sharded]:
    """The Adam moments and step of ``param``, created (zero) if the optimizer has not
    stepped yet, so that a load can fill them in place. The step is the global tensor
    ``optimizer.state.step.<step_key>``: one per parameter, whatever its TP shards."""
    state = adam_state(optimizer, param, "training.megatron")
    out = {}
    for kind in ADAM_KINDS:
        out[state_key(kind, key)] = Sharded(state[kind], state_shard(kind, shard), replica)
    out[state_key("step", key)] = Sharded(state["step"], Shard.of(Region.whole(state_key("step", step_key), ())),
                                          step_replica)
    return out


__all__ = ["from_sharded_state_dict", "sharded_state"]
