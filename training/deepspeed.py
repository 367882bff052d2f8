"""DeepSpeed ZeRO engines to the hook's global description, by the offline reader's rules.

A rank of a ZeRO-1/2/3 engine (mp=1, no pipeline) holds, per optimizer param group, a flat
partition of the fp32 masters and of the Adam moments. :func:`sharded_state` describes them
with the layout rules and global keys of ``converters.deepspeed.zero`` (:func:`zero_partition`,
:func:`zero3_partition`, ``param_shapes`` order as DeepSpeed's ``_get_zero_param_shapes``
builds it), so a checkpoint saved at DP=2 loads at DP=3, or converts offline:

* ``model``: every module entry by its name, tied aliases once under the owner (ZeRO-1/2:
  the full module tensors, written by DP rank 0). At ZeRO-3 parameters are partitioned:
  each rank's slice (``ds_tensor``) is described by the ZeRO-3 rule; trainable ones are
  replicas of the fp32 masters (a load fills them from the masters), frozen ones are the
  primary copy.
* ``optimizer``: ``optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.<name>`` for trainable
  parameters, one leaf per parameter that this rank's partition holds (a view into the flat
  partition; padding is not described). At ZeRO-3 the fp32 masters *are* the weights (key
  ``<name>``), as in the offline reader. ``optimizer.state.step.<name>`` is the group's step
  (a scalar, written by DP rank 0).
* ``engine``: replicated objects (global steps and samples, the LR scheduler's state, the
  param groups' hyperparameters). A load replaces them in the dict; :func:`restore` puts
  them back into the engine.

Adam state is created (zero) if the engine has not stepped yet, so a load fills it in place.

Pipeline engines (Megatron-DeepSpeed's ``PipelineEngine`` over a ``GPTModelPipe``, with
Megatron tensor parallelism on the topology's ``model`` axis) are described by the offline
pipeline reader's rules (``converters.deepspeed.pipe``), from the job's Megatron ``args``:
each ``PipelineModule`` parameter (``{idx}.{local}``, ``tied_modules.embed.{local}``) is
placed by :func:`~converters.deepspeed.pipe.place_parameter` (spec index to layer, legacy
name to canonical key, the TP split of its layout rule), and each DP rank's ZeRO-1 or
``BF16_Optimizer`` partition of the stage's param groups is cut into those TP shards'
regions (:func:`~ckptool.core.regions.flat_regions`). The keys are the canonical ones
the reader gives a DeepSpeed pipeline checkpoint of the same job, so a job saved at
TP2/PP2/DP1 resumes at TP1/PP2/DP2 or TP2/PP1/DP2. The last stage's copy of the tied word
embeddings is a replica; its dead copy of the position embeddings is not described.
"""

from __future__ import annotations

import argparse

import torch

from ckptool.core.errors import UsageError
from ckptool.core.optimizer import state_key
from ckptool.core.regions import Region, Shard
from converters.deepspeed.pipe import pipe_layers, place_parameter
from converters.deepspeed.zero import (
    DYNAMIC_SCALER,
    parameter_alignment,
    zero3_partition,
    zero_partition,
)
from training.state import ADAM_KINDS, Sharded, adam_state, flat_entry



def sharded_state(engine, args=None) -> dict:
    """``{"model", "optimizer", "engine"}`` for this rank of a DeepSpeed ZeRO-1/2/3 engine,
    or of a pipeline engine (``args``: the job's Megatron args, a Namespace or a dict, which
    say which layer is which and how TP splits it)."""
    import torch.distributed as dist  # lazy: only a multi-rank engine needs it

    if _is_pipeline(engine):
        return _pipeline_state(engine, args)
    stage = engine.zero_optimization_stage()
    opt = engine.optimizer
    if stage not in (1, 2, 3):
        raise UsageError(f"training.deepspeed describes ZeRO-1/2/3 engines, not stage {stage}")
    if stage < 3 and not hasattr(opt, "single_partition_of_fp32_groups"):
        raise UsageError(f"the {type(opt).__name__} optimizer is not supported yet",
                         hint="ZeRO-1/2 with DeepSpeedZeroOptimizer (fp32 or bf16 without "
                              "grad_accum_dtype=fp32) is")
    if getattr(engine, "mp_world_size", 1) != 1:
        raise UsageError("model-parallel DeepSpeed engines (mp > 1) are described as pipeline "
                         "engines only", hint="Build the model as a deepspeed.pipe.PipelineModule "
                                              "(Megatron-DeepSpeed's GPTModelPipe)")
    group = engine.data_parallel_group
    dp = dist.get_world_size(group) if dist.is_initialized() else 1
    dp_rank = dist.get_rank(group) if dist.is_initialized() else 0
    groups = [[(n, tuple(s)) for n, s in g.items()] for g in engine._get_zero_param_shapes()]
    trainable = {n for g in groups for n, _ in g}
    masters = opt.fp32_partitioned_groups_flat if stage == 3 else opt.single_partition_of_fp32_groups
    if len(masters) != len(groups):
        raise UsageError(f"{len(masters)} fp32 partitions for {len(groups)} param groups")

    model_state, seen = {}, set()
    for name, tensor in engine.module.state_dict(keep_vars=True).items():
        if id(tensor) in seen:  # a tied alias: stored once, under its owner
            continue
        seen.add(id(tensor))
        if stage == 3 and hasattr(tensor, "ds_id"):
            local = tensor.ds_tensor
            shard = zero3_partition([(name, tuple(tensor.ds_shape))], dp, dp_rank)
            if local.numel() != shard.shape[0]:
                raise UsageError(f"ZeRO-3 slice of {name!r} has {local.numel()} elements, the "
                                 f"rule at DP{dp} says {shard.shape[0]}")
            model_state[name] = Sharded(local.data.view(-1), shard, replica=name in trainable)
        else:
            model_state[name] = Sharded(tensor.data, Shard.of(Region.whole(name, tensor.shape)),
                                        replica=dp_rank > 0)

    optim_state = {}
    for g, (params, flat) in enumerate(zip(groups, masters)):
        if stage == 3:
            shard, pad = zero3_partition(params, dp, dp_rank), 0
        else:
            align = parameter_alignment(bool(getattr(opt, "parameter_alignment", False)),
                                        next(iter(engine.module.parameters())).dtype)
            shard, pad = zero_partition(params, dp, dp_rank, align=align)
        if flat.numel() not in (shard.shape[0], shard.shape[0] - pad):
            raise UsageError(f"fp32 partition of param group {g} has {flat.numel()} elements, the "
                             f"ZeRO-{stage} rule at DP{dp} says {shard.shape[0]}")
        state = adam_state(opt.optimizer, flat, "training.deepspeed")
        vectors = [("fp32_param" if stage < 3 else None, flat.data)]
        vectors += [(kind, state[kind]) for kind in ADAM_KINDS]
        for kind, buffer in vectors:
            flat_buffer = buffer.view(-1)
            for offset, region in shard.parts:
                key = state_key(kind, region.key) if kind else region.key
                local = flat_buffer[offset:offset + region.numel]
                optim_state[state_key(kind or "fp32_param", region.key)] = Sharded(
                    local, Shard.of(Region(key, region.global_shape, region.offsets,
                                           region.lengths, region.flat)))
        for name, _ in params:  # every rank holds the group's step; DP rank 0 writes it
            key = state_key("step", name)
            optim_state[key] = Sharded(state["step"], Shard.of(Region.whole(key, ())),
                                       replica=dp_rank > 0)

    return {"model": model_state, "optimizer": optim_state, "engine": _engine_objects(engine)}


def _is_pipeline(engine) -> bool:
    return hasattr(engine, "grid") and hasattr(engine.module, "_layer_specs")


def _pipeline_state(engine, args) -> dict:
    """:func:`sharded_state` of a ``PipelineEngine`` rank (see the module docstring)."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    from ckptool.core.layout import check
    from ckptool.core.topology import Topology
    from converters.schemas.megatron import params_by_key
    from converters.schemas.megatron_args import spec_from_args

    if args is None:
        raise UsageError("a pipeline engine is described from the job's Megatron args (which "
                         "layer is which, how TP splits it)",
                         hint="Pass args=megatron.get_args(), or a dict of the model's Megatron "
                              "arguments")
    spec, _, _ = spec_from_args(args if isinstance(args, argparse.Namespace)
                                else argparse.Namespace(**args), model="megatron-deepspeed")
    grid, module, opt = engine.grid, engine.module, engine.optimizer
    stage = engine.zero_optimization_stage()
    tp, tp_rank = grid.get_slice_parallel_world_size(), grid.get_slice_parallel_rank()
    pp, pp_rank = grid.get_pipe_parallel_world_size(), grid.get_stage_id()
    dp, dp_rank = grid.get_data_parallel_world_size(), grid.get_data_parallel_rank()
    topo = Topology(tp=tp, pp=pp, dp=dp, zero=stage)
    check(spec, topo)
    where = f"pipeline stage {pp_rank}, TP rank {tp_rank}"
    stateful = [i for i, s in enumerate(module._layer_specs) if isinstance(s, LayerSpec)
                and not (isinstance(s, TiedLayerSpec) and s.forward_fn is not None)]
    layers = pipe_layers(stateful, spec, where)
    params, padded = params_by_key(spec), spec.padded_vocab(tp)

    model_state, placed = {}, {}
    named = dict(module.named_parameters())
    extra = [k for k in module.state_dict() if k not in named]
    if extra:
        raise UsageError(f"the pipeline module holds state that is not a parameter: {extra[:3]}",
                         hint="training.deepspeed describes GPTModelPipe's parameters")
    for name, p in named.items():
        placed[name] = place_parameter(name, p.shape, layers, pp_rank, tp_rank, params, padded,
                                       topo, where)
        if placed[name] is None:  # the last stage's dead copy of the position embeddings
            continue
        canonical, replica, tshard = placed[name]
        model_state[canonical] = Sharded(p.data, tshard, replica or dp_rank > 0)

    if hasattr(opt, "single_partition_of_fp32_groups") and stage == 1:  # ZeRO-1
        masters, keeps_padding = opt.single_partition_of_fp32_groups, False
        groups = [[(n, tuple(s)) for n, s in g.items()] for g in engine._get_zero_param_shapes()]
        align = parameter_alignment(bool(getattr(opt, "parameter_alignment", False)),
                                    next(iter(named.values())).dtype)
    elif hasattr(opt, "fp32_groups_flat_partition") and stage == 0:  # BF16_Optimizer
        masters, keeps_padding, align = opt.fp32_groups_flat_partition, True, 1
        names = {id(p): n for n, p in named.items()}
        groups = [[(names[id(p)], tuple(p.shape)) for p in g] for g in opt.bf16_groups]
    else:
        raise UsageError(f"a pipeline engine with {type(opt).__name__} at ZeRO-{stage} is not "
                         "supported", hint="ZeRO-1 (fp32, bf16) and BF16_Optimizer are")
    if len(masters) != len(groups):
        raise UsageError(f"{len(masters)} fp32 partitions for {len(groups)} param groups")

    optim_state = {}
    for g, (group, flat) in enumerate(zip(groups, masters)):
        shard, pad = zero_partition(group, dp, dp_rank, align=align)
        if flat.numel() != shard.shape[0] - (0 if keeps_padding else pad):
            raise UsageError(f"fp32 partition of param group {g} has {flat.numel()} elements, the "
                             f"ZeRO rule at DP{dp} says {shard.shape[0]}", hint=where)
        state = adam_state(opt.optimizer, flat, "training.deepspeed")
        for kind, buffer in [("fp32_param", flat.data)] + [(k, state[k]) for k in ADAM_KINDS]:
            flat_buffer = buffer.view(-1)
            for offset, region in shard.parts:
                if placed[region.key] is None:
                    continue
                canonical, replica, tshard = placed[region.key]
                lo, hi = region.flat
                key = state_key(kind, canonical)
                optim_state[key] = flat_entry(flat_buffer[offset:offset + hi - lo], tshard.parts,
                                              lo, hi, key, replica)
        for name, _ in group:  # every rank holds the group's step; one writes each
            if placed[name] is None:
                continue
            canonical, replica, _ = placed[name]
            key = state_key("step", canonical)
            optim_state[key] = Sharded(state["step"], Shard.of(Region.whole(key, ())),
                                       replica or dp_rank > 0 or tp_rank > 0)

    objects = _engine_objects(engine)
    record = _pipeline_record(engine, layers, groups, pp_rank * tp + tp_rank, dp_rank,
                              bf16_optimizer=stage == 0)
    plain = (int, float, str, bool, type(None), list, tuple)  # what the files carry of the args
    given = vars(args) if isinstance(args, argparse.Namespace) else dict(args)
    live = {"hyper": objects["param_groups"],
            "args": {k: v for k, v in given.items() if isinstance(v, plain)},
            **{k: objects[k] for k in ("global_steps", "global_samples", "skipped_steps", "lr_scheduler",
                                       "loss_scaler")}}
    return {"model": model_state, "optimizer": optim_state, "engine": objects,
            "deepspeed": {"pipeline": [{**record, **live}]}}


PIPELINE_OBJECT = "deepspeed.pipeline"
"""The hook's record of a pipeline engine's structure (one list of one dict): what DeepSpeed's
own checkpoint of the job holds beside the tensors (the layer files' entries, each
model-parallel rank's param groups in flat order, the spec indices, the config), so
``ckptool convert STEP --to deepspeed`` writes files DeepSpeed's ``load_checkpoint`` reads
(:func:`converters.deepspeed.pipe.adopt_hook_state`)."""


def _pipeline_record(engine, layers, groups, mp: int, dp_rank: int, bf16_optimizer: bool) -> dict:
    """The static part of :data:`PIPELINE_OBJECT`, gathered from every rank on the first
    call (collective: every rank describes its engine at the same point) and kept on the
    engine."""
    import deepspeed
    import torch.distributed as dist

    cached = getattr(engine, "_ckptool_pipeline", None)
    if cached is not None:
        return cached
    module = engine.module
    local = {"mp": mp, "groups": groups if dp_rank == 0 else None,
             "entries": {module._local_start + i: list(f.state_dict())
                         for i, f in enumerate(module.forward_funcs)
                         if isinstance(f, torch.nn.Module)} if dp_rank == 0 else {}}
    gathered = [local]
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
    entries, by_mp = {}, {}
    for part in gathered:
        entries.update(part["entries"])
        if part["groups"] is not None:
            by_mp[part["mp"]] = part["groups"]
    config = getattr(engine, "config", None)
    record = {"layers": [layers.embedding, layers.num_layers, layers.head],
              "entries": dict(sorted(entries.items())), "groups": dict(sorted(by_mp.items())),
              "bf16_files": bool(engine.bfloat16_enabled()), "bf16_optimizer": bf16_optimizer,
              "gradient_clipping": float(engine.gradient_clipping() or 0.0),
              "ds_config": config if isinstance(config, dict) else None,
              "ds_version": deepspeed.__version__}
    engine._ckptool_pipeline = record
    return record


_SCALER = (*DYNAMIC_SCALER, "dynamic")
"""A loss scaler's state: DeepSpeed's DynamicLossScaler attributes (a static one has cur_scale)."""


def _engine_objects(engine) -> dict:
    scheduler = getattr(engine, "lr_scheduler", None)
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    return {
        "global_steps": int(engine.global_steps),
        "global_samples": int(engine.global_samples),
        "skipped_steps": int(getattr(engine, "skipped_steps", 0)),
        "loss_scaler": {k: _plain(getattr(scaler, k)) for k in _SCALER if hasattr(scaler, k)}
        if scaler is not None else None,
        "lr_scheduler": scheduler.state_dict() if scheduler is not None else None,
        "param_groups": [{k: v for k, v in g.items() if k != "params"}
                         for g in engine.optimizer.optimizer.param_groups],
    }


def _plain(value):
    """A scaler attribute as a plain number (some DeepSpeed versions keep tensors)."""
    return value.item() if isinstance(value, torch.Tensor) else value


def restore(engine, state: dict) -> None:
    """Put the loaded ``engine`` objects of ``state`` (after ``load_latest``) back into
    ``engine``: step counters, LR scheduler, the loss scaler (fp16: the dynamic scale and
    its counters), param-group hyperparameters (the LR in use)."""
    objects = state.get("engine") or {}
    if "global_steps" in objects:
        engine.global_steps = objects["global_steps"]
    if "global_samples" in objects:
        engine.global_samples = objects["global_samples"]
    if "skipped_steps" in objects:
        engine.skipped_steps = objects["skipped_steps"]
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    for name, value in (objects.get("loss_scaler") or {}).items():
        if scaler is not None and hasattr(scaler, name):
            current = getattr(scaler, name)
            setattr(scaler, name, torch.tensor(value, dtype=current.dtype, device=current.device)
                    if isinstance(current, torch.Tensor) else value)
    scheduler = getattr(engine, "lr_scheduler", None)
    if scheduler is not None and objects.get("lr_scheduler") is not None:
        scheduler.load_state_dict(objects["lr_scheduler"])
    for group, saved in zip(engine.optimizer.optimizer.param_groups, objects.get("param_groups") or ()):
        group.update(saved)


__all__ = ["sharded_state", "restore"]
