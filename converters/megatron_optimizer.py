"""Megatron's non-distributed optimizer state in legacy checkpoints, mapped to parameters.

Not a format: the rules shared by the Megatron reader and writer, written once.

``model_optim_rng.pt["optimizer"]`` is either ``FP32Optimizer.state_dict()`` (a plain
torch optimizer state dict) or ``Float16OptimizerWithFloat16Params.state_dict()``
(``{"optimizer": ..., "grad_scaler": ..., "fp32_from_fp16_params": [[master, ...], ...]}``).
A torch optimizer state dict numbers parameters by position across its param groups, so
mapping a number to a parameter needs Megatron's grouping rule, which is:

* parameters in ``named_parameters()`` order over the model chunks (module registration
  order: the order of the model's state dict, without ``_extra_state``);
* group 0: everything else; group 1 (weight decay 0): biases and 1-D parameters.

Every mapping is checked against the stored shapes and group sizes; a checkpoint that
does not fit the rule is refused with the reason, never mapped by guess.

Megatron-Core's ``torch_dist`` form of the same optimizer (``sharded_state_dict``) needs no
grouping rule: each state tensor is a ShardedTensor keyed like its parameter
(``optimizer.state.exp_avg.<model sharded key>``; ``optimizer.state.fp32_param.<key>`` for
the fp32 masters), and ``common.pt`` holds the rest (:func:`read_sharded_common`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Any

import torch

from ckptool.core.errors import UnreadableInput

KINDS = ("exp_avg", "exp_avg_sq", "fp32_param")
PREFIX = "optimizer.state."
LAYOUT_KEY = "megatron.optimizer.layout"
"""Canonical object of both Megatron formats: the optimizer's non-tensor state, a
:class:`Layout` without tensors."""
DISTRIBUTED_KEY = "megatron.optimizer.distributed"
"""The legacy reader's object for a distributed optimizer (``distrib_optim.pt``)."""
COMMON_STEP = "common_step"
"""Where ``sharded_state_dict`` keeps the step shared by every parameter."""


def state_key(kind: str, canonical: str) -> str:
    """Canonical key of one optimizer tensor: ``optimizer.state.exp_avg.<param key>``."""
    return f"{PREFIX}{kind}.{canonical}"


def no_decay(name: str, ndim: int) -> bool:
    return name.endswith(".bias") or ndim == 1


def groups(params: list[tuple[str, int]]) -> list[list[str]]:
    """Megatron's two param groups for ``(name, ndim)`` in named_parameters order."""
    return [[n for n, d in params if not no_decay(n, d)], [n for n, d in params if no_decay(n, d)]]


@dataclass
class Layout:
    """What one rank file's optimizer state holds, by local parameter name."""

    fp16: bool
    """Float16OptimizerWithFloat16Params (fp32 masters stored separately)."""
    tensors: dict[str, dict[str, tuple]]
    """local param name -> kind -> path of the tensor in the rank file's object tree."""
    step: Any
    hyper: list[dict]
    """Param group hyperparameters (without ``params``), in group order."""
    extra: dict
    """Everything else (grad scaler...), carried as it is."""


def read(optimizer: Any, params: list[tuple[str, int, tuple]], source: str,
         materialize=lambda x: x) -> Layout:
    """Map the optimizer state of one rank file to its parameters.

    ``params`` is ``(local name, ndim, shape)`` in named_parameters order; shapes of the
    stored moments must equal the parameters'. ``materialize`` reads small stored tensors
    (the step counters).
    """
    if isinstance(optimizer, dict) and "fp32_from_fp16_params" in optimizer:
        fp16, inner, base = True, optimizer.get("optimizer"), ("optimizer", "optimizer")
    else:
        fp16, inner, base = False, optimizer, ("optimizer",)
    if not (isinstance(inner, dict) and "state" in inner and "param_groups" in inner):
        raise UnreadableInput("optimizer state is not a Megatron FP32/Float16 optimizer state dict",
                              path=source)
    by_name = {n: (d, s) for n, d, s in params}
    expected = groups([(n, d) for n, d, _ in params])
    stored = [list(g.get("params", [])) for g in inner["param_groups"]]
    sizes = [len(g) for g in stored]
    if [len(g) for g in expected if g] != [n for n in sizes if n]:
        raise UnreadableInput(
            f"optimizer param groups hold {sizes} parameters, Megatron's grouping rule gives "
            f"{[len(g) for g in expected]}; ckptool cannot map this optimizer state to parameters",
            path=source, hint="Pass --drop-optimizer to carry the weights only")
    names = iter([n for g in expected for n in g])
    tensors: dict[str, dict[str, tuple]] = {}
    steps = set()
    masters = optimizer.get("fp32_from_fp16_params") if fp16 else None
    for gi, group in enumerate(stored):
        for pos, index in enumerate(group):
            name = next(names)
            shape = by_name[name][1]
            entry = inner["state"].get(index, {})
            paths = {}
            for kind in ("exp_avg", "exp_avg_sq"):
                ref = entry.get(kind)
                if ref is None:
                    raise UnreadableInput(f"optimizer state {index} has no {kind}", path=source)
                if tuple(ref.shape) != tuple(shape):
                    raise UnreadableInput(
                        f"optimizer state {index} ({kind} {list(ref.shape)}) does not match parameter "
                        f"{name} {list(shape)}; ckptool cannot map this optimizer state",
                        path=source, hint="Pass --drop-optimizer to carry the weights only")
                paths[kind] = (*base, "state", index, kind)
            if masters is not None:
                if tuple(masters[gi][pos].shape) != tuple(shape):
                    raise UnreadableInput(f"fp32 master of {name} has the wrong shape", path=source)
                paths["fp32_param"] = ("optimizer", "fp32_from_fp16_params", gi, pos)
            if "step" in entry:
                steps.add(_scalar(materialize(entry["step"])))
            tensors[name] = paths
    if len(steps) > 1:
        raise UnreadableInput(f"parameters have different optimizer steps {sorted(steps)}", path=source)
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in inner["param_groups"]]
    extra = {k: v for k, v in optimizer.items() if k not in ("optimizer", "fp32_from_fp16_params")} \
        if fp16 else {}
    return Layout(fp16, tensors, steps.pop() if steps else None, hyper, extra)


def _scalar(value):
    try:
        return float(value)
    except TypeError:
        return value


def torch_state_dict(groups: list[list[str]], hyper: list[dict], entry) -> dict:
    """A torch optimizer's ``state_dict()``: parameters numbered across ``groups`` in order
    (the numbering every reader of such a dict must undo), group ``g`` with ``hyper[g]``,
    each parameter's state ``entry(g, name)``."""
    state, param_groups, index = {}, [], 0
    for g, names in enumerate(groups):
        param_groups.append({**copy.deepcopy(hyper[g]), "params": list(range(index, index + len(names)))})
        for name in names:
            state[index] = entry(g, name)
            index += 1
    return {"state": state, "param_groups": param_groups}


def build(params: list[tuple[str, int]], layout: Layout, pending) -> dict:
    """The optimizer entry of a target rank file.

    ``params`` is ``(local name, ndim)`` in the target model's named_parameters order;
    ``pending(kind, name)`` gives the tensor placeholder for that parameter's state.
    """
    import torch

    grouped = groups(params)
    hyper = layout.hyper if len(layout.hyper) >= 2 else layout.hyper + [dict(layout.hyper[0])]

    def entry(g, name):
        moments = {"exp_avg": pending("exp_avg", name), "exp_avg_sq": pending("exp_avg_sq", name)}
        if layout.step is None:
            return moments
        return {"step": torch.tensor(float(layout.step)), **moments}

    inner = torch_state_dict(grouped, [hyper[min(g, len(hyper) - 1)] for g in range(len(grouped))],
                             entry)
    if not layout.fp16:
        return inner
    masters = [[pending("fp32_param", name) for name in names] for names in grouped]
    return {"optimizer": inner, **copy.deepcopy(layout.extra), "fp32_from_fp16_params": masters}


# ------------------------------------------------------ Megatron-Core sharded (torch_dist) form


def read_sharded_common(optimizer: Any, source: str) -> Layout:
    """The optimizer's non-tensor state from a torch_dist ``common.pt``.

    ``FP32Optimizer.sharded_state_dict`` saves ``{"state": {"common_step": step},
    "param_groups": [hyperparameters...]}`` there (``params`` are local, not saved);
    ``Float16OptimizerWithFloat16Params`` nests that under ``"optimizer"`` beside
    ``grad_scaler`` (its ``fp32_from_fp16_params`` are all ShardedTensors). The
    distributed optimizer says ``param_state_sharding_type``: not this form.
    """
    if not isinstance(optimizer, dict):
        raise UnreadableInput("common.pt's optimizer entry is not a dict", path=source)
    if "param_state_sharding_type" in optimizer:
        raise UnreadableInput(
            f"Megatron-Core distributed-optimizer state ({optimizer['param_state_sharding_type']!r} "
            "sharding) is not read yet; only the non-distributed optimizer's model-shaped state is",
            path=source)
    fp16 = isinstance(optimizer.get("optimizer"), dict)
    inner = optimizer["optimizer"] if fp16 else optimizer
    if not isinstance(inner.get("param_groups"), list) or not isinstance(inner.get("state", {}), dict):
        raise UnreadableInput("common.pt's optimizer entry is not a Megatron-Core FP32/Float16 "
                              "optimizer sharded state dict", path=source)
    state = inner.get("state", {})
    other = sorted(str(k) for k in state if k != COMMON_STEP)
    if other:
        raise UnreadableInput(f"common.pt holds optimizer state {other} outside ShardedTensors; "
                              "ckptool maps only the common step", path=source)
    step = state.get(COMMON_STEP)
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in inner["param_groups"]]
    extra = {k: v for k, v in optimizer.items() if k not in ("optimizer", "fp32_from_fp16_params")} \
        if fp16 else {}
    return Layout(fp16, {}, None if step is None else _scalar(step), hyper, extra)


def sharded_common(layout: Layout) -> dict:
    """What ``dist_checkpointing.save`` puts in common.pt for this optimizer: the inverse of
    :func:`read_sharded_common` (mcore keeps the step only when it is non-zero)."""
    import torch

    inner = {"state": {}, "param_groups": copy.deepcopy(layout.hyper)}
    if layout.step:
        inner["state"][COMMON_STEP] = torch.tensor(float(layout.step))
    return {"optimizer": inner, **copy.deepcopy(layout.extra)} if layout.fp16 else inner


def state_kinds(layout: Layout) -> tuple[str, ...]:
    """The state tensors each parameter has: Adam's moments, and the fp32 master when the
    optimizer keeps one apart from a 16-bit parameter."""
    return KINDS if layout.fp16 else KINDS[:2]


def split_key(key: str) -> tuple[str, str] | None:
    """``optimizer.state.exp_avg.<param key>`` -> (``exp_avg``, ``<param key>``); None for a
    key that is not a state tensor of a known kind."""
    if not key.startswith(PREFIX):
        return None
    kind, _, param = key[len(PREFIX):].partition(".")
    return (kind, param) if kind in KINDS and param else None


def check_tensors(index, layout: Layout | None, source: str) -> str | None:
    """Why the ``optimizer.*`` tensors of ``index`` are not the model-shaped state that
    ``layout`` describes (each parameter: one tensor of each kind, of its shape), or None."""
    keys = [k for k in index.tensors if k.startswith("optimizer.")]
    if not keys:
        return None if layout is None else \
            f"{source} describes an optimizer but holds no optimizer state tensors"
    if layout is None:
        return f"optimizer tensors (e.g. {keys[0]}) without the optimizer's common state in {source}"
    found: dict[str, set[str]] = {}
    for key in keys:
        parts = split_key(key)
        if parts is None:
            what = "Megatron-Core distributed-optimizer buffers (flat, not model-shaped)" \
                if key.startswith("optimizer.distributed.") else \
                "optimizer state of a kind ckptool does not map"
            return f"{what}: {key}"
        kind, param = parts
        info = index.tensors.get(param)
        if info is None or tuple(info.shape) != tuple(index.tensors[key].shape):
            return f"{key} does not match a parameter of the same shape"
        found.setdefault(param, set()).add(kind)
    want = set(state_kinds(layout))
    for param, kinds in found.items():
        if kinds != want:
            return f"parameter {param} has optimizer state {sorted(kinds)}, expected {sorted(want)}"
    missing = [k for k in index.tensors if not k.startswith("optimizer.") and k not in found]
    if missing:
        return f"parameter {missing[0]} (and {len(missing) - 1} more) has no optimizer state"
    return None


def state_shard(kind: str, shard):
    """The shard of a parameter's ``kind`` state: the parameter's regions under the state's
    key (a state tensor is laid out exactly like its parameter)."""
    from dataclasses import replace

    from ckptool.core.regions import Shard

    parts = tuple((off, replace(r, key=state_key(kind, r.key))) for off, r in shard.parts)
    return Shard(shard.shape, parts, shard.dtype)


# ----------------------------------------------------------- a fresh state (--init-optimizer)

FRESH_STEP = "optimizer.fresh_step"
"""Object of an index given a fresh state: the step every param group starts at (0)."""
_ZEROS = "zeros"


def with_fresh_state(opened):
    """``opened`` (a weights-only source) with a fresh Adam state for every tensor, the
    state a torch Adam/AdamW has before its first step: an fp32 master equal to the weight,
    both moments zero, step 0. Only ``convert --init-optimizer`` asks for it."""
    from ckptool.checkpoint import Opened
    from ckptool.core.index import Location, ObjectInfo, Piece, TensorInfo
    from ckptool.core.regions import Region

    index = replace(opened.index, tensors=dict(opened.index.tensors),
                    objects=dict(opened.index.objects))
    for key, info in opened.index.tensors.items():
        master = state_key("fp32_param", key)
        index.tensors[master] = TensorInfo(master, info.shape, torch.float32, [
            Piece(replace(p.region, key=master), p.location) for p in info.pieces])
        for kind in ("exp_avg", "exp_avg_sq"):
            k = state_key(kind, key)
            index.tensors[k] = TensorInfo(k, info.shape, torch.float32, [
                Piece(Region.whole(k, info.shape), Location("", detail=_ZEROS))])
    index.objects[FRESH_STEP] = ObjectInfo(FRESH_STEP, value=0)
    return Opened(opened.store, opened.format, _FreshReader(opened.reader), opened.manifest, index)


class _FreshReader:
    """The source's reader, with zeros for the fresh moments (which no file holds)."""

    def __init__(self, inner):
        self.inner, self.name = inner, inner.name

    def read_box_into(self, store, piece, dtype, box, out) -> None:
        if piece.location.detail == _ZEROS and not piece.location.file:
            out.zero_()
        else:
            self.inner.read_box_into(store, piece, dtype, box, out)

    def __getattr__(self, name):
        return getattr(self.inner, name)
