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
"""

from __future__ import annotations

import torch

from ckptool.core.errors import UsageError
from ckptool.core.optimizer import state_key
from ckptool.core.regions import Region, Shard
from converters.deepspeed.zero import (
    parameter_alignment,
    zero3_partition,
    zero_partition,
)
from training.state import Sharded

ADAM_KINDS = ("exp_avg", "exp_avg_sq")


def sharded_state(engine) -> dict:
    """``{"model", "optimizer", "engine"}`` for this rank of a DeepSpeed ZeRO-1/2/3 engine."""
    import torch.distributed as dist  # lazy: only a multi-rank engine needs it

    stage = engine.zero_optimization_stage()
    opt = engine.optimizer
    if stage not in (1, 2, 3):
        raise UsageError(f"training.deepspeed describes ZeRO-1/2/3 engines, not stage {stage}")
    if stage < 3 and not hasattr(opt, "single_partition_of_fp32_groups"):
        raise UsageError(f"the {type(opt).__name__} optimizer is not supported yet",
                         hint="ZeRO-1/2 with DeepSpeedZeroOptimizer (fp32 or bf16 without "
                              "grad_accum_dtype=fp32) is")
    if getattr(engine, "mp_world_size", 1) != 1:
        raise UsageError("model-parallel DeepSpeed engines (mp > 1) are not supported yet")
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
        state = _adam_state(opt.optimizer, flat)
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


def _adam_state(optimizer: torch.optim.Optimizer, flat: torch.Tensor) -> dict:
    """The torch Adam state of one flat partition, created (zero) if it has not stepped."""
    state = optimizer.state[flat]
    if not state:
        state["step"] = torch.zeros((), dtype=torch.float32)
        for kind in ADAM_KINDS:
            state[kind] = torch.zeros_like(flat, memory_format=torch.preserve_format)
    missing = [k for k in ("step", *ADAM_KINDS) if k not in state]
    if missing:
        raise UsageError(f"the optimizer {type(optimizer).__name__} has no {', '.join(missing)} "
                         "state", hint="training.deepspeed describes Adam/AdamW state")
    if not isinstance(state["step"], torch.Tensor):
        state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32)
    return state


def _engine_objects(engine) -> dict:
    scheduler = getattr(engine, "lr_scheduler", None)
    return {
        "global_steps": int(engine.global_steps),
        "global_samples": int(engine.global_samples),
        "lr_scheduler": scheduler.state_dict() if scheduler is not None else None,
        "param_groups": [{k: v for k, v in g.items() if k != "params"}
                         for g in engine.optimizer.optimizer.param_groups],
    }


def restore(engine, state: dict) -> None:
    """Put the loaded ``engine`` objects of ``state`` (after ``load_latest``) back into
    ``engine``: step counters, LR scheduler, param-group hyperparameters (the LR in use)."""
    objects = state.get("engine") or {}
    if "global_steps" in objects:
        engine.global_steps = objects["global_steps"]
    if "global_samples" in objects:
        engine.global_samples = objects["global_samples"]
    scheduler = getattr(engine, "lr_scheduler", None)
    if scheduler is not None and objects.get("lr_scheduler") is not None:
        scheduler.load_state_dict(objects["lr_scheduler"])
    for group, saved in zip(engine.optimizer.optimizer.param_groups, objects.get("param_groups") or ()):
        group.update(saved)


__all__ = ["sharded_state", "restore"]
