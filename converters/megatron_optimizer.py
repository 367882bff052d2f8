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
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from ckptool.core.errors import UnreadableInput

KINDS = ("exp_avg", "exp_avg_sq", "fp32_param")
PREFIX = "optimizer.state."


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


def build(params: list[tuple[str, int]], layout: Layout, pending) -> dict:
    """The optimizer entry of a target rank file.

    ``params`` is ``(local name, ndim)`` in the target model's named_parameters order;
    ``pending(kind, name)`` gives the tensor placeholder for that parameter's state.
    """
    import torch

    grouped = groups(params)
    hyper = layout.hyper if len(layout.hyper) >= 2 else layout.hyper + [dict(layout.hyper[0])]
    state, param_groups, index = {}, [], 0
    masters = []
    for gi, names in enumerate(grouped):
        ids = []
        group_masters = []
        for name in names:
            entry = {"exp_avg": pending("exp_avg", name), "exp_avg_sq": pending("exp_avg_sq", name)}
            if layout.step is not None:
                entry = {"step": torch.tensor(float(layout.step)), **entry}
            state[index] = entry
            ids.append(index)
            index += 1
            if layout.fp16:
                group_masters.append(pending("fp32_param", name))
        param_groups.append({**copy.deepcopy(hyper[min(gi, len(hyper) - 1)]), "params": ids})
        masters.append(group_masters)
    inner = {"state": state, "param_groups": param_groups}
    if not layout.fp16:
        return inner
    return {"optimizer": inner, **copy.deepcopy(layout.extra), "fp32_from_fp16_params": masters}
