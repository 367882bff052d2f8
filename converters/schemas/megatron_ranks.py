"""How a Megatron rank's local tensors land in the global view, shared by every reader of
Megatron rank files: the legacy ``mp_rank_*`` files and Megatron-DeepSpeed's pipeline
layer files (which are the same tensors, cut one file per pipeline layer).

Not a format. A local tensor is the TP shard of a canonical parameter given by the layout
rule of :mod:`ckptool.core.layout` (column, row, replicated, gated, vocab); its regions
are recorded as pieces (or replicas) of the global tensor, read from the element range of
the stored tensor.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace

from ckptool.core.errors import BadCheckpoint, UnreadableInput, UnsupportedFormat
from ckptool.core.index import Location, Piece, TensorInfo
from ckptool.core.layout import ModelSpec, expert_tp_rank, split
from ckptool.core.torchfile import TensorRef


def add_piece(index, params, canonical, replica, f, path, value, padded, topo, store, key=None,
              file=None, base=None, expert=None):
    """Record ``value`` (at ``path`` in ``file``, default the rank file ``f.rel``) as the TP
    shard of ``canonical`` that TP rank ``f.tp`` holds (of global expert ``expert`` for a
    stacked expert tensor, split by its expert TP rank); with ``base``, the shard is the flat slice of ``value`` that
    starts there (distributed optimizer vectors)."""
    file = file or f.rel
    param = params.get(canonical) if canonical else None
    if param is None:
        name = f"{canonical or ''} {path[-1]}"
        feature = next((what for pattern, what in _NOT_LAID_OUT if pattern.search(name)), None)
        if feature is not None and any(p.endswith(".mlp.router.weight") for p in params):
            raise UnsupportedFormat(f"tensor {path[-1]!r} is {feature}, which ckptool does not lay "
                                    "out yet", path=store.display(file),
                                    hint="Nothing was written; see docs/megatron.md (Mixture of Experts)")
        raise BadCheckpoint(f"tensor {path[-1]!r} does not fit the model described by args",
                            path=store.display(file), key=canonical)
    if not isinstance(value, TensorRef):
        raise BadCheckpoint("expected a tensor", path=store.display(file), key=str(path[-1]))
    shard = split(param, f.tp, topo.tp, padded) if expert is None else \
        split(param, expert_tp_rank(topo, f.tp), topo.expert_tp, expert=expert)
    if base is None and tuple(value.shape) != shard.shape:
        raise BadCheckpoint(f"local tensor is {list(value.shape)}, the layout from args says "
                            f"{list(shard.shape)}", path=store.display(file), key=str(path[-1]))
    if base is not None and base + math.prod(shard.shape) > value.numel:
        raise BadCheckpoint(f"the slice of {canonical} ends past the stored vector",
                            path=store.display(file), key=str(path[-1]))
    key = key or canonical
    info = index.tensors.get(key)
    if info is None:
        info = index.tensors[key] = TensorInfo(key, param.shape, value.dtype)
    elif str(info.dtype) != str(value.dtype):  # one tensor's shards: never silently cast
        raise BadCheckpoint(f"the shards of {key} disagree on the dtype: {info.dtype} and {value.dtype}",
                            path=store.display(file), key=str(path[-1]))
    copies = info.replicas if replica or (param.rule == "replicated" and f.tp > 0) else info.pieces
    for offset, region in shard.parts:
        if key != canonical:
            region = replace(region, key=key)
        copies.append(Piece(region, Location(file, detail=(path, (base or 0) + offset))))


_NOT_LAID_OUT = (
    (re.compile(r"\.mlp\.router\.expert_bias\b"), "the router's expert bias (moe_router_enable_expert_bias)"),
    (re.compile(r"\.mlp\.router\.bias\b"), "a router bias (add_bias_linear in a MoE model)"),
    (re.compile(r"\.mlp\.experts\.linear_fc[12]\.(weight|bias)\d+\b"),
     "Transformer Engine's grouped-GEMM expert weight (moe_grouped_gemm)"),
    (re.compile(r"\.mlp\.linear_fc[12]\.|\.mlp\.dense_h_to_4h\.|\.mlp\.dense_4h_to_h\."),
     "a dense MLP in a MoE model (dense and MoE layers mixed: moe_layer_freq)"),
)
"""Valid Megatron-Core MoE features the expert layout rule does not hold yet: refused by name
(exit 2), not taken for damage."""


def check_legacy_schema(schema: str, spec: ModelSpec, version, source: str) -> None:
    """Refuse what pre-mcore (legacy) names cannot hold as ckptool reads them."""
    if schema != "legacy":
        return
    if version is not None and float(version) < 2.0:
        raise UnreadableInput(f"checkpoint_version {version} stores QKV in an order ckptool does not "
                              "read yet (only >= 2.0)", path=source)
    if spec.groups != spec.num_attention_heads:
        raise UnreadableInput("grouped-query attention under pre-mcore names is not supported yet",
                              path=source)
