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
from dataclasses import dataclass
from typing import Any

from ckptool.core.errors import UnreadableInput, UsageError
from ckptool.core.layout import expert_of
from ckptool.core.lazy import lazy
from ckptool.core.optimizer import (
    KINDS,
    PREFIX,
    ParamGroups,
    no_decay,
    split_key,
    state_key,
    torch_state_dict,
)

torch = lazy("torch", globals())

COMMON_STEP = "common_step"
"""Where ``sharded_state_dict`` keeps the step shared by every parameter."""


@dataclass
class Layout:
    """What one rank file's optimizer state holds, by local parameter name; without tensors,
    the layout record of both Megatron formats' sources: the optimizer's non-tensor state."""

    fp16: bool
    """Float16OptimizerWithFloat16Params (fp32 masters stored separately)."""
    tensors: dict[str, dict[str, tuple]]
    """local param name -> kind -> path of the tensor in the rank file's object tree."""
    step: Any
    hyper: list[dict]
    """Param group hyperparameters (without ``params``), in group order."""
    extra: dict
    """Everything else (grad scaler...), carried as it is."""
    kinds: list[str] | None = None
    """The kind of each group of ``hyper`` (:func:`megatron_groups`); None: decay, no decay."""
    expert_extra: dict | None = None
    """The expert optimizer's non-tensor state (grad scaler...) of a ChainedOptimizer source."""


def megatron_groups(params: list[tuple[str, int]], ep: int = 1) -> list[tuple[str, list[str]]]:
    """Megatron-Core's param groups of ``(local name, ndim)`` in named_parameters order, each
    ``(kind, names)``: weight decay, then at EP > 1 the expert parameters with weight decay
    (``is_expert_parallel``: their grads reduce over the expert-DP group), then no weight
    decay (biases, 1-D), then at EP > 1 the experts' without. At EP 1 experts are not
    expert-parallel and sit with the dense parameters in their order."""
    def expert(name):
        return ep > 1 and expert_of(name) is not None
    groups = [("decay", [n for n, d in params if not no_decay(n, d) and not expert(n)])]
    if ep > 1:
        groups.append(("expert_decay", [n for n, d in params if not no_decay(n, d) and expert(n)]))
    groups.append(("nodecay", [n for n, d in params if no_decay(n, d) and not expert(n)]))
    if ep > 1 and any(no_decay(n, d) and expert(n) for n, d in params):
        groups.append(("expert_nodecay", [n for n, d in params if no_decay(n, d) and expert(n)]))
    return groups


def _hyper_of(layout: "Layout", kind: str) -> dict:
    """The source's hyperparameters for a group ``kind`` (an expert group takes its dense
    counterpart's, marked expert-parallel, and the other way round)."""
    kinds = layout.kinds or ["decay", "nodecay"][:len(layout.hyper)]
    hyper = dict(zip(kinds, layout.hyper))
    if kind in hyper:
        return copy.deepcopy(hyper[kind])
    other = kind.removeprefix("expert_") if kind.startswith("expert_") else "expert_" + kind
    base = copy.deepcopy(hyper.get(other) or layout.hyper[-1])
    if "is_expert_parallel" in base:
        base["is_expert_parallel"] = kind.startswith("expert_")
    return base


def chained(params: list[tuple[str, int]], ep: int) -> bool:
    """Megatron-Core builds a ``ChainedOptimizer`` of a dense and an expert optimizer when
    some parameters are expert-parallel (experts at EP > 1); its state dict is then the list
    of the two optimizers' state dicts."""
    return any(k.startswith("expert_") for k, _ in megatron_groups(params, ep))


def read(optimizer: Any, params: list[tuple[str, int, tuple]], source: str,
         materialize=lambda x: x, ep: int = 1) -> Layout:
    """Map the optimizer state of one rank file to its parameters.

    ``params`` is ``(local name, ndim, shape)`` in named_parameters order; shapes of the
    stored moments must equal the parameters'. ``materialize`` reads small stored tensors
    (the step counters). At EP > 1 a model with experts has Megatron-Core's
    ``ChainedOptimizer`` state ``[dense, expert]`` (:func:`chained`), each over its own
    groups of :func:`megatron_groups`; a single state dict over all of them is read too.
    """
    grouped = megatron_groups([(n, d) for n, d, _ in params], ep)
    if not isinstance(optimizer, list):
        return _read_one(optimizer, params, grouped, source, materialize, ("optimizer",))
    if not (chained([(n, d) for n, d, _ in params], ep) and len(optimizer) == 2):
        raise UnreadableInput(f"optimizer state is a list of {len(optimizer)} optimizers' states; "
                              "Megatron's ChainedOptimizer holds two, a dense and an expert one, "
                              "only for a model with experts at EP > 1", path=source)
    parts = [_read_one(sub, params, [g for g in grouped if g[0].startswith("expert_") == expert],
                       source, materialize, ("optimizer", i))
             for i, (sub, expert) in enumerate(zip(optimizer, (False, True)))]
    dense, experts = parts
    if dense.fp16 != experts.fp16 or None not in (dense.step, experts.step) and dense.step != experts.step:
        raise UnreadableInput("the dense and the expert optimizer differ in kind or step", path=source)
    return Layout(dense.fp16, {**dense.tensors, **experts.tensors},
                  dense.step if dense.step is not None else experts.step,
                  dense.hyper + experts.hyper, dense.extra,
                  None if None in (dense.kinds, experts.kinds) else dense.kinds + experts.kinds,
                  expert_extra=experts.extra)


def _read_one(optimizer: Any, params: list[tuple[str, int, tuple]], grouped: list[tuple[str, list[str]]],
              source: str, materialize, root: tuple) -> Layout:
    """:func:`read` of one optimizer's state dict (at ``root`` in the rank file) over the
    param groups ``grouped``."""
    if isinstance(optimizer, dict) and "fp32_from_fp16_params" in optimizer:
        fp16, inner, base = True, optimizer.get("optimizer"), (*root, "optimizer")
    else:
        fp16, inner, base = False, optimizer, root
    if not (isinstance(inner, dict) and "state" in inner and "param_groups" in inner):
        raise UnreadableInput("optimizer state is not a Megatron FP32/Float16 optimizer state dict",
                              path=source)
    by_name = {n: (d, s) for n, d, s in params}
    expected = [g for _, g in grouped]
    stored = [list(g.get("params", [])) for g in inner["param_groups"]]
    sizes = [len(g) for g in stored]
    if [len(g) for g in expected if g] != [n for n in sizes if n]:
        raise UnreadableInput(
            f"optimizer param groups hold {sizes} parameters, Megatron's grouping rule gives "
            f"{[len(g) for g in expected]}; ckptool cannot map this optimizer state to parameters",
            path=source, hint="Pass --drop-optimizer to carry the weights only")
    kinds = [k for k, _ in grouped] if len(sizes) == len(grouped) else None
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
                paths["fp32_param"] = (*root, "fp32_from_fp16_params", gi, pos)
            if "step" in entry:
                steps.add(_scalar(materialize(entry["step"])))
            tensors[name] = paths
    if len(steps) > 1:
        raise UnreadableInput(f"parameters have different optimizer steps {sorted(steps)}", path=source)
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in inner["param_groups"]]
    extra = {k: v for k, v in optimizer.items() if k not in ("optimizer", "fp32_from_fp16_params")} \
        if fp16 else {}
    return Layout(fp16, tensors, steps.pop() if steps else None, hyper, extra, kinds)


def _scalar(value):
    try:
        return float(value)
    except TypeError:
        return value


def build(params: list[tuple[str, int]], layout: Layout, pending, ep: int = 1) -> Any:
    """The optimizer entry of a target rank file.

    ``params`` is ``(local name, ndim)`` in the target model's named_parameters order;
    ``pending(kind, name)`` gives the tensor placeholder for that parameter's state; the
    groups are Megatron-Core's at the target's EP (:func:`megatron_groups`), in one state
    dict, or in the two of a ChainedOptimizer where Megatron-Core builds one (:func:`chained`).
    """
    grouped = megatron_groups(params, ep)
    if not chained(params, ep):
        return _build_one(grouped, layout, pending, layout.extra)
    return [_build_one([g for g in grouped if g[0].startswith("expert_") == expert], layout, pending,
                       layout.expert_extra if expert and layout.expert_extra is not None else layout.extra)
            for expert in (False, True)]


def _build_one(kinds_and_groups: list[tuple[str, list[str]]], layout: Layout, pending, extra: dict) -> dict:
    """One optimizer's state dict over the param groups ``kinds_and_groups``."""
    grouped = [g for _, g in kinds_and_groups]
    hyper = [_hyper_of(layout, k) for k, _ in kinds_and_groups]

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
    return {"optimizer": inner, **copy.deepcopy(extra), "fp32_from_fp16_params": masters}


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
            "sharding) is read from torch_dist checkpoints only, not from this backend",
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

    inner = {"state": {}, "param_groups": copy.deepcopy(layout.hyper)}
    if layout.step:
        inner["state"][COMMON_STEP] = torch.tensor(float(layout.step))
    return {"optimizer": inner, **copy.deepcopy(layout.extra)} if layout.fp16 else inner


def state_kinds(layout: Layout) -> tuple[str, ...]:
    """The state tensors each parameter has: Adam's moments, and the fp32 master when the
    optimizer keeps one apart from a 16-bit parameter."""
    return KINDS if layout.fp16 else KINDS[:2]


def check_tensors(index, layout: Layout | None, source: str, kinds: tuple[str, ...] | None = None
                  ) -> str | None:
    """Why the ``optimizer.*`` tensors of ``index`` are not the model-shaped state that
    ``layout`` describes (each parameter: one tensor of each kind, of its shape; ``kinds``
    when they are not :func:`state_kinds`), or None."""
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
    want = set(kinds or state_kinds(layout))
    for param, held in found.items():
        if held != want:
            return f"parameter {param} has optimizer state {sorted(held)}, expected {sorted(want)}"
    missing = [k for k in index.tensors if not k.startswith("optimizer.") and k not in found]
    if missing:
        return f"parameter {missing[0]} (and {len(missing) - 1} more) has no optimizer state"
    return None


# ------------------------------------------------------- a DeepSpeed source's state, as Megatron's

SCHEDULE_FLAG = "--megatron-lr-schedule"
SCHEDULER_KEY = "opt_param_scheduler"
"""Where Megatron-LM keeps ``OptimizerParamScheduler.state_dict()``; its loader reads it with
the optimizer (a KeyError without it)."""
SCHEDULE = {"max_lr": float, "min_lr": float, "lr_warmup_steps": int, "lr_decay_steps": int,
            "lr_decay_style": str, "start_wd": float, "end_wd": float, "wd_incr_steps": int,
            "wd_incr_style": str}
"""The scheduler's state the job compares with its own args (``--lr``, ``--min-lr``, the
warmup and decay iterations times ``--global-batch-size``, ``--start/end-weight-decay``...)."""
_STYLES = {"lr_decay_style": ("constant", "linear", "cosine", "inverse-square-root", "WSD"),
           "wd_incr_style": ("constant", "linear", "cosine")}
_SCHEDULE_HINT = (f"Pass {SCHEDULE_FLAG} " + ",".join(f"{k}=..." for k in SCHEDULE)
                  + " (the OptimizerParamScheduler values of the Megatron job that resumes, "
                    "steps in samples), or --drop-optimizer")
MEGATRON_GROUP = {"is_expert_parallel": False, "default_config": True, "lr_mult": 1.0,
                  "is_decoupled_lr": False}
"""What Megatron-Core 0.16's ``_get_param_groups`` puts in each group of a dense model
without overrides (``wd_mult``, ``max_lr``, ``min_lr`` besides); its
``_filter_and_reorder_param_groups`` matches loaded groups by ``(wd_mult, lr_mult,
is_expert_parallel, is_decoupled_lr)``, a KeyError when a group lacks one."""


def parse_schedule(text: str) -> dict:
    """``max_lr=3e-4,min_lr=3e-5,...`` (every :data:`SCHEDULE` key; ``num_steps`` optional) as
    typed values, checked as Megatron's OptimizerParamScheduler asserts them."""
    given = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = item.partition("=")
        kind = SCHEDULE.get(key.strip(), int if key.strip() == "num_steps" else None)
        if not sep or kind is None:
            raise UsageError(f"{SCHEDULE_FLAG}: {item!r} is not KEY=VALUE with KEY one of "
                             f"{', '.join([*SCHEDULE, 'num_steps'])}")
        try:
            given[key.strip()] = kind(value.strip())
        except ValueError:
            raise UsageError(f"{SCHEDULE_FLAG}: {key.strip()}={value.strip()!r} is not "
                             f"{'a number' if kind is float else 'an integer'}") from None
    missing = [k for k in SCHEDULE if k not in given]
    if missing:
        raise UsageError(f"{SCHEDULE_FLAG} lacks {', '.join(missing)}", hint=_SCHEDULE_HINT)
    for key, styles in _STYLES.items():
        if given[key] not in styles:
            raise UsageError(f"{SCHEDULE_FLAG}: {key} must be one of {', '.join(styles)}")
    if not (0 <= given["min_lr"] <= given["max_lr"] and 0 <= given["lr_warmup_steps"]
            < given["lr_decay_steps"] and 0 <= given["start_wd"] <= given["end_wd"]) or \
            (given["wd_incr_style"] == "constant" and given["start_wd"] != given["end_wd"]):
        raise UsageError(f"{SCHEDULE_FLAG}: Megatron's OptimizerParamScheduler refuses these "
                         "values (it needs 0 <= min_lr <= max_lr, 0 <= lr_warmup_steps < "
                         "lr_decay_steps, 0 <= start_wd <= end_wd, equal for wd_incr_style=constant)")
    return given


@dataclass(frozen=True)
class FromDeepSpeed:
    """A DeepSpeed source's optimizer as Megatron's: the :class:`Layout` and the scheduler
    state Megatron-LM's loader needs with it, and what the user must know."""

    layout: Layout
    scheduler: dict
    note: str


def deepspeed_groups(index) -> tuple[list[list[tuple[str, tuple]]], list[dict], list] | None:
    """The source's DeepSpeed param groups (every model-parallel rank's), hyperparameters and
    steps per group; None when the index holds no DeepSpeed optimizer."""
    found = index.layout(ParamGroups)  # what the DeepSpeed readers record
    if found is None:
        return None
    if any(len(g) != len(found.hyper) for g in found.ranks.values()):
        raise UsageError("model-parallel ranks of the DeepSpeed source have different numbers "
                         "of param groups", path=index.url)
    members = [[p for g in found.ranks.values() for p in g[i]] for i in range(len(found.hyper))]
    return members, list(found.hyper), list(found.steps)


def deepspeed_state(index, schedule: dict | None, with_optimizer: bool) -> FromDeepSpeed | None:
    """What a Megatron writer writes for a DeepSpeed source's optimizer (None: not one, or
    the optimizer is dropped); ``schedule`` is the parsed :data:`SCHEDULE_FLAG`."""
    deepspeed = deepspeed_groups(index) is not None
    if not deepspeed and schedule is not None:
        raise UsageError(f"{SCHEDULE_FLAG} applies only to a DeepSpeed source's optimizer state",
                         path=index.url, hint=f"Drop {SCHEDULE_FLAG}")
    return from_deepspeed(index, schedule) if with_optimizer and deepspeed else None


def master_is_weight(index, layout: Layout | None, key: str) -> bool:
    """Whether the target's weight ``key`` is written from the source's fp32 master: the
    FP32Optimizer steps the weight itself, so a master kept apart (DeepSpeed ZeRO-1/2) is it."""
    return layout is not None and not layout.fp16 and state_key("fp32_param", key) in index.tensors


def from_deepspeed(index, schedule: dict | None) -> FromDeepSpeed:
    """Megatron's optimizer state for a DeepSpeed source, or a UsageError saying why it would
    not be exact. Megatron-LM loads the optimizer's torch state dict (param groups included:
    torch keeps the loaded group's values) and then ``opt_param_scheduler``, which sets every
    group's ``lr`` and ``weight_decay`` from the schedule and the group's ``max_lr``,
    ``min_lr`` and ``wd_mult``. So:

    * exact from the source: the moments, fp32 masters and step; the torch Adam(W) group
      values the scheduler does not set (betas, eps, decoupled_weight_decay...), equal in
      every DeepSpeed group; ``wd_mult`` (1 for weights, 0 for biases and 1-D parameters, by
      Megatron's rule, which must agree with which DeepSpeed groups decay);
      ``num_steps`` = DeepSpeed's ``global_samples`` (Megatron counts samples);
    * Megatron's own defaults: ``lr_mult`` 1, not expert-parallel, no decoupled LR;
    * from the user (``schedule``): max_lr, min_lr and the rest of the scheduler's state,
      which the job asserts equal to its args.
    """
    found = deepspeed_groups(index)
    if found is None:
        raise UsageError("the DeepSpeed source's optimizer state has no param groups to map",
                         path=index.url, hint="Pass --drop-optimizer to write the weights only")
    members, hyper, steps = found
    refuse = _refusal(index.url)
    fp16 = _mixed_precision(index, refuse)
    values = {float(s) for s in steps}
    if len(values) != 1:
        refuse(f"the DeepSpeed param groups are at different optimizer steps {sorted(values)}")
    adam = _shared_adam(hyper, refuse)
    if schedule is None:
        refuse("Megatron needs its LR schedule with the optimizer (each param group's "
               "max_lr/min_lr and opt_param_scheduler), which a DeepSpeed checkpoint does not hold",
               hint=_SCHEDULE_HINT)
    decay = _weight_decay(members, hyper, schedule, refuse)
    groups_ = [dict(MEGATRON_GROUP, wd_mult=1.0 if decays else 0.0, max_lr=schedule["max_lr"],
                    min_lr=schedule["min_lr"], **adam, weight_decay=decay.get(decays, 0.0))
               for decays in (True, False)]  # Megatron's group order: weights, then no decay
    samples = index.objects.get("global_samples")
    num_steps = schedule.get("num_steps", samples.value if samples else None)
    if num_steps is None:
        refuse("the DeepSpeed source does not say how many samples it trained on "
               "(global_samples), Megatron's scheduler step", hint=f"Add num_steps=N to {SCHEDULE_FLAG}")
    layout = Layout(fp16, {}, values.pop(), groups_, {})
    masters = any(k.startswith(PREFIX + "fp32_param.") for k in index.tensors)
    reason = check_tensors(index, layout, index.url, KINDS if masters else None)  # fp32: masters = weights
    if reason:
        refuse(reason)
    scheduler = {"max_lr": schedule["max_lr"], "lr_warmup_steps": schedule["lr_warmup_steps"],
                 "num_steps": int(num_steps), "lr_decay_style": schedule["lr_decay_style"],
                 "lr_decay_steps": schedule["lr_decay_steps"], "min_lr": schedule["min_lr"],
                 "start_wd": schedule["start_wd"], "end_wd": schedule["end_wd"],
                 "wd_incr_style": schedule["wd_incr_style"], "wd_incr_steps": schedule["wd_incr_steps"]}
    note = (f"the DeepSpeed optimizer becomes Megatron's {'Float16' if fp16 else 'FP32'}Optimizer "
            f"with torch {'AdamW' if adam['decoupled_weight_decay'] else 'Adam'} (what Megatron-Core "
            "builds without Transformer Engine or apex; their FusedAdam cannot take this state): "
            f"betas {tuple(adam.get('betas', ()))} and eps {adam.get('eps')} come from the "
            f"checkpoint, not the job's args; opt_param_scheduler num_steps={int(num_steps)} "
            f"({'given' if 'num_steps' in schedule else 'DeepSpeed global_samples'}), so resume "
            f"with a --global-batch-size of the samples per DeepSpeed step and the schedule of "
            f"{SCHEDULE_FLAG}")
    return FromDeepSpeed(layout, scheduler, note)


def _shared_adam(hyper: list[dict], refuse) -> dict:
    """The torch Adam(W) values every DeepSpeed group shares (all but weight_decay): Megatron's
    groups share one schedule and one Adam."""
    common = [{k: v for k, v in h.items() if k != "weight_decay"} for h in hyper]
    if any(c != common[0] for c in common):
        refuse("the DeepSpeed param groups differ in more than weight decay (lr, betas or eps)")
    if common[0].get("amsgrad") or common[0].get("maximize"):
        refuse("the DeepSpeed AdamW runs with amsgrad or maximize, which Megatron's does not")
    if common[0].get("decoupled_weight_decay") is None or "bias_correction" in common[0]:
        refuse("the DeepSpeed optimizer is not torch's Adam/AdamW (set \"torch_adam\": true); "
               "its state is not the one Megatron's torch AdamW loads")
    return common[0]


def _weight_decay(members, hyper, schedule: dict, refuse) -> dict[bool, float]:
    """DeepSpeed's weight decay of the parameters Megatron decays (True) and of the others
    (False), refused unless DeepSpeed decayed exactly the parameters Megatron's rule and
    the schedule decay, each class by one amount."""
    job_decays = schedule["start_wd"] > 0 or schedule["end_wd"] > 0
    amounts: dict[bool, set[float]] = {}
    for g, group in enumerate(members):
        wd = float(hyper[g].get("weight_decay", 0.0))
        for name, shape in group:
            decayed = not _no_decay(name, len(shape), refuse)
            if (wd > 0) != (decayed and job_decays):
                refuse(f"DeepSpeed {'applies' if wd > 0 else 'does not apply'} weight decay to "
                       f"{name} (param group {g}); Megatron {'would not' if wd > 0 else 'would'}: "
                       "it decays every parameter but biases and 1-D ones, at the schedule's "
                       "start_wd/end_wd")
            amounts.setdefault(decayed, set()).add(wd)
    if any(len(v) > 1 for v in amounts.values()):
        refuse(f"the DeepSpeed param groups decay weights by different amounts {sorted(amounts[True])}")
    return {decayed: wd.pop() for decayed, wd in amounts.items()}


def _refusal(url: str):
    def refuse(reason: str, hint: str = "Pass --drop-optimizer to write the weights only"):
        raise UsageError(f"the DeepSpeed optimizer state cannot become Megatron's exactly: {reason}",
                         path=url, hint=hint)
    return refuse


def _no_decay(name: str, ndim: int, refuse) -> bool:
    """Megatron's rule for one parameter; a name schema may rename, never reshape, so the
    rule holds under the source's names only where a bias is 1-D."""
    if name.endswith(".bias") and ndim != 1:
        refuse(f"{name} is a {ndim}-D bias: Megatron's weight-decay rule would depend on its name")
    return no_decay(name, ndim)


def _mixed_precision(index, refuse) -> bool:
    """Float16OptimizerWithFloat16Params (bf16 weights, fp32 masters) or FP32Optimizer."""
    dtypes = {index.model_dtype} if index.model_dtype else \
        {t.dtype for k, t in index.tensors.items() if not k.startswith("optimizer.")}
    if torch.float16 in dtypes:
        refuse("an fp16 run: DeepSpeed's loss scaler does not map exactly onto Megatron's "
               "DynamicGradScaler (other hysteresis and growth rules), and without one Megatron "
               "restarts at --initial-loss-scale and skips steps until it finds the scale again")
    if len(dtypes) != 1 or dtypes - {torch.bfloat16, torch.float32}:
        refuse(f"weights of dtypes {sorted(str(d) for d in dtypes)}")
    return dtypes == {torch.bfloat16}
