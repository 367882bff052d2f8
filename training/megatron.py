"""Megatron-style models to the hook's global description, by the shared layout rules.

A rank of a TP x PP x DP job holds local parameters under local names (``decoder.layers.0...``
counts from the stage's first layer). :func:`sharded_state` maps each one to the regions of
the global, topology-independent tensors it holds, using :func:`ckptool.core.layout.layout`:
the same rules the offline reader, writer and reshard use (grouped QKV, SwiGLU
``[gate_r; up_r]``, vocab padding, PP layer offsets, VPP chunks, tied embeddings). The
checkpoint keys are the canonical global names, so a checkpoint saved at TP2/PP2 loads at
TP1/PP4 or converts offline with ``ckptool convert``.

Adam state (``exp_avg``, ``exp_avg_sq``, ``step``) of a ``torch.optim.Adam``/``AdamW`` over
the same parameters goes under ``optimizer.state.<kind>.<key>``, the names the Megatron
converters use, so it reshards with the weights.
"""

from __future__ import annotations

from typing import Iterable, Mapping

import torch

from ckptool.core.errors import UsageError
from ckptool.core.layout import ModelSpec, layout
from ckptool.core.optimizer import state_key, state_shard
from ckptool.core.regions import Region, Shard
from ckptool.core.topology import Topology
from converters.schemas.megatron import SCHEMAS, detect_schema
from training.state import Sharded

ADAM_KINDS = ("exp_avg", "exp_avg_sq")


def sharded_state(model, spec: ModelSpec, topo: Topology, *, tp_rank: int, pp_rank: int,
                  dp_rank: int = 0, optimizer: torch.optim.Optimizer | None = None,
                  schema: str | None = None) -> dict:
    """``{"model": {key: Sharded}, "optimizer": {key: Sharded}}`` for this rank.

    ``model`` is a module, a list of modules (virtual pipeline chunks), or a mapping of
    local names to tensors. ``schema`` is the naming (``mcore-local``, ``mcore-te``,
    ``legacy``); by default it is inferred from the names.
    """
    chunks = _named_chunks(model)
    names = [n for chunk in chunks for n in chunk]
    schema = schema or detect_schema(names)
    if schema not in SCHEMAS:
        raise UsageError(f"unknown Megatron naming {schema!r}", hint=f"Use one of {', '.join(SCHEMAS)}")
    rank = layout(spec, topo)[pp_rank * topo.tp + tp_rank]
    expected = {(t.chunk, t.name): t for t in rank.tensors}
    tied = spec.tied_embeddings and pp_rank == topo.pp - 1 and pp_rank > 0

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
            replica = local.replica or dp_rank > 0
            key = local.shard.regions[0].key if local.shard.parts else canonical
            entry = Sharded(tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor,
                            local.shard, replica)
            model_state[key] = entry
            if optimizer is not None:
                optim_state.update(_adam_state(optimizer, tensor, key, local.shard, replica,
                                               tp_rank))
    missing = [f"{n} (chunk {c})" for (c, n) in expected if (c, n) not in seen]
    if missing:
        raise UsageError(f"the model lacks {len(missing)} tensors the layout expects, e.g. "
                         f"{', '.join(missing[:3])}", hint="Check the ModelSpec given to sharded_state")
    state = {"model": model_state}
    if optimizer is not None:
        state["optimizer"] = optim_state
    return state


def _named_chunks(model) -> list[Mapping[str, torch.Tensor]]:
    if isinstance(model, Mapping):
        return [model]
    modules: Iterable = model if isinstance(model, (list, tuple)) else [model]
    return [dict(m.named_parameters()) for m in modules]


def _adam_state(optimizer: torch.optim.Optimizer, param: torch.Tensor, key: str, shard: Shard,
                replica: bool, tp_rank: int) -> dict[str, Sharded]:
    """The Adam moments and step of ``param``, created (zero) if the optimizer has not
    stepped yet, so that a load can fill them in place."""
    state = optimizer.state[param]
    if not state:
        state["step"] = torch.zeros((), dtype=torch.float32)
        for kind in ADAM_KINDS:
            state[kind] = torch.zeros_like(param, memory_format=torch.preserve_format)
    out = {}
    for kind in ADAM_KINDS:
        out[state_key(kind, key)] = Sharded(state[kind], state_shard(kind, shard), replica)
    step = state["step"]
    if not isinstance(step, torch.Tensor):
        step = state["step"] = torch.tensor(float(step))
    # One copy per parameter: the TP shards of a parameter share one step.
    out[state_key("step", key)] = Sharded(step, Shard.of(Region.whole(state_key("step", key), ())),
                                          replica or tp_rank > 0)
    return out


__all__ = ["sharded_state"]
