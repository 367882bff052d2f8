"""DeepSpeed's ZeRO layout rules and file structure, shared by the deepspeed,
deepspeed-universal and pipeline readers and writers (:mod:`converters.deepspeed`,
:mod:`converters.deepspeed.universal`, :mod:`converters.deepspeed.pipe`). Not a format.

* The partition rules: ZeRO-1/2 cut each param group's flat buffer (``param_shapes``
  order, optional ``parameter_alignment`` gaps, tail padding to a multiple of ``2*dp``)
  into ``dp`` equal partitions (:func:`zero_partition`); ZeRO-3 cuts each parameter alone
  (:func:`zero3_partition`); ``round_robin_gradients`` reorders the groups for a DP size
  (:func:`round_robin`).
* :class:`Layout`: a source's structure and the non-tensor entries of its files, which the
  writers carry as they are, with the per-rank entries (:data:`PER_RANK`) rewritten.
* The pieces of reading (:func:`add_region`, :func:`rank_files`, :func:`zero_stage`) and of
  writing (:func:`model_states_tree`, :func:`optim_states_tree`, :func:`ds_config_for`)
  that more than one of those modules uses, and :class:`ZeroReader`, the readers' base.
"""

from __future__ import annotations

import copy
import math
import re
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

from ckptool.core import VERSION
from ckptool.core.errors import BadCheckpoint, CkptoolError, TopologyError, UnreadableInput
from ckptool.core.index import CheckpointIndex, Location, Piece, TensorInfo
from ckptool.core.jsonfile import json_object
from ckptool.core.lazy import lazy
from ckptool.core.optimizer import ParamGroups, state_key, torch_state_dict
from ckptool.core.regions import Region, Shard
from ckptool.core.safe_pickle import record_class
from ckptool.core.storage import Store
from ckptool.core.topology import Topology
from ckptool.core.torchfile import TensorRef
from ckptool.core.torchreader import TorchFileReader
from converters.schemas.hf import CONFIG, known_family, named_view, stored_view

torch = lazy("torch", globals())

MARK = "ckptool"
MOMENTS = ("exp_avg", "exp_avg_sq")
OPTIM_FILE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d{2})_?optim_states\.pt$")
PER_RANK = ("base_optimizer_state", "optimizer_state_dict", "single_partition_of_fp32_groups",
            "fp32_flat_groups", "group_paddings", "partition_count", "param_slice_mappings")
"""Optimizer-file entries that depend on the DP rank; the others are carried as they are."""
_ZERO12_ONLY = ("clip_grad", "param_alignment_paddings", "ds_version")
"""``optimizer_state_dict`` entries of ZeRO-1/2 files that ZeRO-3 files lack (DeepSpeed
0.19.8); derived when writing 1/2 from 3, dropped when writing 3 from 1/2."""

UNFUSED_STATE, UNFUSED_MASTERS = "optimizer_state_dict", "fp32_groups"
"""FP16_UnfusedOptimizer's state dict (a bf16/fp16 engine without ZeRO, not a pipeline): the
client's torch state dict and the fp32 masters, a list per param group parallel to its
``params``, beside the loss-scale entries (DeepSpeed 0.19.8)."""


Group = list[tuple[str, tuple[int, ...]]]


# ------------------------------------------------------------------- the layout rules


def param_groups(model_states: dict) -> list[Group]:
    """The param groups of a model-states file, in flat-buffer order: its ``param_shapes``
    (one ``{name: shape}`` per optimizer param group); [] when it records none."""
    shapes = model_states.get("param_shapes") or []
    if not isinstance(shapes, list) or not all(isinstance(g, dict) for g in shapes):
        raise BadCheckpoint("model states: param_shapes is not a list of {name: shape}")
    try:
        return [[(str(n), tuple(int(x) for x in s)) for n, s in g.items()] for g in shapes]
    except (TypeError, ValueError):  # a shape that is no sequence of ints (a refused global...)
        raise BadCheckpoint("model states: a param_shapes entry is not a shape") from None


def uncarried_state(state) -> str | None:
    """Why a torch optimizer's per-parameter ``state`` holds more than Adam's step and two
    moments (AdamW with ``amsgrad``: ``max_exp_avg_sq``), which ckptool does not map; or None."""
    extra = sorted({str(k) for entry in (state or {}).values() if isinstance(entry, dict)
                    for k in entry} - {"step", *MOMENTS})
    if not extra:
        return None
    return (f"optimizer state {', '.join(extra)} (amsgrad?) is not carried: only Adam's step "
            "and two moments are")


def zero_partition(group: Group, dp: int, rank: int, key=lambda name: name,
                   align: int = 1) -> tuple[Shard, int]:
    """ZeRO-1/2: ``rank``'s partition of one param group's flat buffer, and its padding.

    The group's parameters are concatenated in ``param_shapes`` order (with
    ``parameter_alignment``, each but the last followed by :func:`alignment_paddings`), the
    buffer is padded at the tail to a multiple of ``2*dp`` and cut into ``dp`` equal
    partitions of P elements; rank r owns ``[r*P, (r+1)*P)``, so a parameter can straddle
    ranks. The Adam moments keep the tail padding (zeros); ``single_partition_of_fp32_groups``
    drops it (BF16_Optimizer keeps it); ``group_paddings[g][r]`` counts it. ``key`` names the
    regions' global tensor.
    """
    gaps = alignment_paddings(group, align)
    total = sum(math.prod(shape) for _, shape in group) + sum(gaps)
    per_rank = -(-total // (2 * dp)) * 2
    lo, hi = rank * per_rank, (rank + 1) * per_rank
    parts, offset = [], 0
    for (name, shape), gap in zip(group, gaps):
        n = math.prod(shape)
        start, stop = max(offset, lo), min(offset + n, hi)
        if start < stop:
            parts.append((start - lo, Region.whole(key(name), shape, (start - offset, stop - offset))))
        offset += n + gap
    return Shard((per_rank,), tuple(parts)), max(0, hi - max(lo, total))


def alignment_paddings(group: Group, align: int) -> list[int]:
    """ZeRO-1/2 ``parameter_alignment``: zeros after each parameter but the last, up to a
    multiple of ``align`` elements of the flat buffer (``align`` = 16 bytes over the model
    dtype's size; 1 without the option): DeepSpeed's ``param_alignment_paddings``."""
    out, offset = [], 0
    for i, (_, shape) in enumerate(group):
        offset += math.prod(shape)
        gap = 0 if i == len(group) - 1 else (-offset) % align
        out.append(gap)
        offset += gap
    return out


def parameter_alignment(enabled: bool, dtype: torch.dtype) -> int:
    """The ``align`` of :func:`alignment_paddings`: 16 bytes in elements of the model dtype
    when ``zero_optimization.parameter_alignment`` is on, else 1."""
    return 16 // math.gcd(16, dtype.itemsize) if enabled else 1


def zero3_partition(group: Group, dp: int, rank: int, key=lambda name: name) -> Shard:
    """ZeRO-3: each parameter is cut alone into ``dp`` slices of ``ceil(n/dp)`` elements (the
    last zero-padded); a rank's flat group is its slices in ``param_shapes`` order. The same
    rule cuts ``frozen_param_fragments`` (one parameter at a time)."""
    parts, offset = [], 0
    for name, shape in group:
        n = math.prod(shape)
        size = -(-n // dp)
        start, stop = min(rank * size, n), min((rank + 1) * size, n)
        if start < stop:
            parts.append((offset, Region.whole(key(name), shape, (start, stop))))
        offset += size
    return Shard((offset,), tuple(parts))


def round_robin(group: Group, dp: int) -> Group:
    """ZeRO-1/2 with ``round_robin_gradients``: the flat buffer (and ``param_shapes``) holds
    the group's parameters reordered for DP size ``dp``, those at positions ``i % dp == 0``
    first, then ``1``... (``_round_robin_reorder`` in stage_1_and_2.py). The order depends
    on DP, so a new DP size needs a new order."""
    return [group[i] for j in range(dp) for i in range(j, len(group), dp)]


def round_robin_undone(group: Group, dp: int) -> Group:
    """The model's own order of a group that :func:`round_robin` reordered for ``dp``."""
    order = [i for j in range(dp) for i in range(j, len(group), dp)]
    out: Group = [None] * len(group)  # type: ignore[list-item]
    for position, i in enumerate(order):
        out[i] = group[position]
    return out


EXPERT_NAME = re.compile(r"^(?P<prefix>.*\.deepspeed_experts\.)(?P<j>\d+)(?P<rest>\..+)$")
EXPERT_FILE = re.compile(r"^layer_(\d+)_expert_(\d+)_mp_rank_(\d{2})_model_states\.pt$")
"""deepspeed.moe's expert files: one per (MoE layer, global expert), the expert's parameters
under their global names."""


DYNAMIC_SCALER = ("cur_scale", "cur_iter", "last_overflow_iter", "scale_factor", "scale_window",
                  "min_scale", "delayed_shift", "cur_hysteresis", "consecutive_hysteresis",
                  "raise_error_at_min_scale")
"""The attributes of DeepSpeed's ``DynamicLossScaler`` (besides ``dynamic`` and ``dtype``):
what an fp16 engine's scaler is, and what the save hook records of it."""


@dataclass(frozen=True)
class Experts:
    """``deepspeed.moe.layer.MoE``'s layout rule (DeepSpeed 0.19.8, ZeRO-1/2, mp=1).

    ``split_params_into_different_moe_groups_for_optimizer`` puts the experts' parameters in
    param groups of their own (``moe: True``, ``name: ep_size_{EP}``). EP ranks are
    consecutive DP ranks: DP rank r is EP rank ``r % EP`` and expert-DP rank ``r // EP``, so a
    MoE group's flat buffer holds EP rank e's local experts ``e·E/EP + j`` and is cut into
    ``DP/EP`` partitions over the expert-DP group (:func:`rank_group`). ``param_shapes`` and
    ``param_slice_mappings`` name the local experts ``deepspeed_experts.{j}`` (EP rank 0's
    names); the weights are in the expert files under global names; the model states'
    ``module`` holds the dense parameters only."""

    ep: int
    groups: tuple[int, ...]
    """The MoE param groups."""
    num_experts: dict[str, int]
    """Each MoE layer's expert prefix (``...deepspeed_experts.``) -> its number of experts."""
    layers: tuple[tuple[str, tuple[tuple[str, tuple[int, ...], torch.dtype], ...]], ...]
    """Each MoE layer (``layer_{L}``, in order): its prefix and one expert file's entries
    (the name after the expert index, shape, dtype)."""

    def global_name(self, name: str, ep_rank: int) -> str:
        """Local expert name -> the global one on EP rank ``ep_rank``; others unchanged."""
        m = EXPERT_NAME.match(name)
        if m is None or m["prefix"] not in self.num_experts:
            return name
        local = self.num_experts[m["prefix"]] // self.ep
        return f"{m['prefix']}{ep_rank * local + int(m['j'])}{m['rest']}"

    def at(self, ep: int) -> "Experts":
        return replace(self, ep=ep)


def expert_groups(groups: list[Group], moe: list[int], ep: int, target: int) -> list[Group]:
    """The param groups (``param_shapes``: EP rank 0's local expert names) of an engine at EP
    ``target`` from those at EP ``ep``: each MoE layer's block of local experts holds
    ``E/target`` experts of the same parameters, in the same order."""
    out = []
    for g, group in enumerate(groups):
        if g not in moe:
            out.append(group)
            continue
        blocks: dict[str, dict[int, list]] = {}
        for name, shape in group:
            m = EXPERT_NAME.match(name)
            if m is None:
                raise UnreadableInput(f"MoE param group {g} holds {name}, not an expert parameter")
            blocks.setdefault(m["prefix"], {}).setdefault(int(m["j"]), []).append((m["rest"], shape))
        rebuilt = []
        for prefix, experts in blocks.items():
            first = experts.get(0)
            if sorted(experts) != list(range(len(experts))) or any(v != first for v in experts.values()):
                raise UnreadableInput(f"the local experts of {prefix[:-1]} in MoE param group {g} do "
                                      "not all have the same parameters")
            local = len(experts) * ep // target
            rebuilt += [(f"{prefix}{j}{rest}", shape) for j in range(local) for rest, shape in first]
        out.append(rebuilt)
    return out


def rank_group(layout: "Layout", g: int, dp: int, rank: int) -> tuple[Group, int, int, Group]:
    """``(param group g's flat order on DP rank rank under global names, its number of
    partitions, this rank's partition, the names DeepSpeed records)``: a dense group is cut over
    DP, a MoE group (:class:`Experts`) over expert-DP, holding the rank's EP rank's experts."""
    group, experts = layout.groups[g], layout.experts
    if experts is None or g not in experts.groups:
        return group, dp, rank, group
    return ([(experts.global_name(n, rank % experts.ep), s) for n, s in group], dp // experts.ep,
            rank // experts.ep, group)


@dataclass
class Layout:
    """What a DeepSpeed writer needs beyond the tensors: the source's structure and the
    non-tensor entries of its files (rank 0's), carried as they are."""

    tag: str
    stage: int
    bf16_files: bool
    """Optimizer files are named ``bf16_zero_pp_rank_*`` (bf16 runs)."""
    bf16_optimizer: bool
    """BF16_Optimizer files: fp32 partitions keep the padding; no ``zero_stage``."""
    groups: list[Group]
    frozen: Group
    shared: dict[str, str]
    module: list[tuple[str, tuple[int, ...], torch.dtype]]
    """``module`` entries in file order (at ZeRO-3, parameters have shape (0,))."""
    model_states: dict
    """Rank 0's model states, ``module`` and ``frozen_param_fragments`` set to None."""
    optim_file: dict
    """Rank 0's optimizer file, ``optimizer_state_dict`` set to None."""
    osd: dict
    """Rank 0's ``optimizer_state_dict`` without the per-rank entries."""
    hyper: list[dict]
    steps: list[Any]
    fragment_type: Any = None
    """The class of ``param_slice_mappings`` values (``fragment_address``), kept opaque."""
    align: int = 1
    """ZeRO-1/2 ``parameter_alignment`` (:func:`alignment_paddings`); 1 without it."""
    scaler: dict | None = None
    """A bf16/fp16 stage-0 source's FP16_UnfusedOptimizer entries beside its torch state dict
    and masters (``dynamic_loss_scale``, ``cur_scale``, ``cur_iter``...); None elsewhere
    (:func:`_unfused_scaler` derives them from a ZeRO source)."""
    experts: Experts | None = None
    """deepspeed.moe's experts (their param groups, layers and files); None without MoE."""

    @property
    def trainable(self) -> set[str]:
        return {name for group in self.groups for name, _ in group}

    @property
    def model_dtype(self) -> torch.dtype | None:
        """The trainable parameters' dtype in ``module`` (bf16/fp16 engines keep fp32 masters
        apart), if they have one."""
        dtypes = {dtype for name, _, dtype in self.module if name in self.trainable}
        return dtypes.pop() if len(dtypes) == 1 else None

    @property
    def params(self) -> set[str]:
        """Every parameter name of ``module`` (trainable, frozen, aliases): not buffers."""
        return self.trainable | {name for name, _ in self.frozen} | set(self.shared)


@dataclass(frozen=True)
class Stage0Module:
    """The layout record of a stage-0 engine's model states without an optimizer layout:
    nothing in them depends on the DP size."""


def record_layout(index: CheckpointIndex, layout: Layout) -> None:
    """Record a ZeRO/stage-0 source's :class:`Layout` and, for the writers of other
    frameworks (Megatron's optimizer from a DeepSpeed one), its param groups."""
    index.set_layout(layout)
    if layout.hyper and layout.experts is None:  # MoE groups are not another framework's
        index.set_layout(ParamGroups({0: layout.groups}, layout.hyper, layout.steps))


# ------------------------------------------------------------------------- reading


class ZeroReader(TorchFileReader):
    """What the DeepSpeed readers (plain and universal) share: ``--model-family``,
    ``--model-config`` and the canonical view of a module that is a Hugging Face model."""

    model_family: str | None = None
    model_config: str | None = None
    """``--model-config``: a Hugging Face config.json for a module that is an HF model."""

    def configure(self, *, model_family: str | None = None, model_config: str | None = None,
                  **unknown) -> None:
        super().configure(**unknown)
        self.model_family, self.model_config = model_family, model_config

    def canonical(self, store: Store, index: CheckpointIndex) -> CheckpointIndex | None:
        """A module that is a Hugging Face model (HF Trainer, accelerate) under canonical
        names, its optimizer state with it; its config is ``--model-config`` or the
        ``config.json`` beside ``latest`` (the HF Trainer's ``checkpoint-N/`` layout)."""
        if self.model_config:
            where = self.model_config
            try:
                raw = Store.open(where).read_small("")  # bounded, as every JSON document read
            except CkptoolError:  # not found, too large: said as it is
                raise
            except OSError as exc:
                raise UnreadableInput(f"cannot read the model config ({exc.strerror})",
                                      path=where) from None
        elif store.exists(CONFIG):
            where, raw = store.display(CONFIG), store.read_small(CONFIG)
        else:
            return None
        config = json_object(raw, where, "the model config")
        if self.model_family is None and known_family(config) is None:
            layout = index.layout(Layout)  # an architecture without a table: names kept
            return stored_view(index, config, layout.shared if layout else {})
        kinds = ("fp32_param", *MOMENTS)
        layout = index.layout(Layout)
        return named_view(index, config, self.model_family, where,
                          ("", *(state_key(kind, "") for kind in kinds)),
                          shared=layout.shared if layout else None)


def rank_files(found: dict[int, str], dp: int, what: str, where: str) -> list[str]:
    if len(found) != dp or sorted(found) != list(range(dp)):  # never a list the size of a claim
        raise BadCheckpoint(f"{what} files are for DP ranks {sorted(found)}, dp_world_size is {dp}",
                            path=where)
    return [found[r] for r in range(dp)]



def add_region(index: CheckpointIndex, key: str, ref: TensorRef, region: Region, rel: str, path: tuple,
         offset: int, replica: bool = False) -> None:
    """Record that ``region`` of ``key`` is stored at element ``offset`` of ``ref``."""
    info = index.tensors.get(key)
    if info is None:
        info = index.tensors[key] = TensorInfo(key, region.global_shape, ref.dtype)
    elif info.shape != region.global_shape or info.dtype != ref.dtype:
        raise BadCheckpoint(f"stored as {list(region.global_shape)} {ref.dtype} and as "
                            f"{list(info.shape)} {info.dtype}", path=index.url, key=key)
    if region.flat is None and tuple(ref.shape) != region.lengths:
        raise BadCheckpoint(f"tensor is {list(ref.shape)}, expected {list(region.lengths)}",
                            path=index.url, key=key)
    index.files[rel] = 1
    (info.replicas if replica else info.pieces).append(Piece(region, Location(rel, detail=(path, offset))))


def zero_stage(osd: dict | None, ms: dict) -> int:
    """The ZeRO stage: the optimizer file's ``zero_stage`` enum (kept opaque: its argument),
    else the config's (BF16_Optimizer files have no enum), else 0 (no optimizer files)."""
    if osd is None:
        return 0
    enum = osd.get("zero_stage")
    if isinstance(enum, int):  # what ckptool writes for an hf source
        return enum
    args = getattr(enum, "_args", None)
    if args and isinstance(args[0], int):
        return args[0]
    config = (ms.get("ds_config") or {}).get("zero_optimization") or {}
    return int(config.get("stage", 1)) or 1


def int_or_none(value) -> int | None:
    return int(value) if isinstance(value, int) else None


# ------------------------------------------------------------------------- writing


def source_state_key(index: CheckpointIndex, kind: str, name: str) -> str:
    """The global tensor an optimizer vector comes from; a ZeRO-3 source has no separate
    ``fp32_param``: its weights are the masters."""
    key = state_key(kind, name)
    return key if kind != "fp32_param" or key in index.tensors else name


def ordered_for(layout: Layout, source: Topology, target: Topology) -> Layout:
    """The layout with each group in the order the target engine flattens it: the model's
    order, reordered by :func:`round_robin` for the target DP when the run uses
    ``round_robin_gradients`` at ZeRO-1/2 (BF16_Optimizer and ZeRO-3 do not reorder)."""
    config = (layout.model_states.get("ds_config") or {}).get("zero_optimization") or {}
    if not config.get("round_robin_gradients") or layout.bf16_optimizer:
        return layout
    groups = layout.groups
    if source.zero in (1, 2):  # stage 0 and 3 keep the model's order
        groups = [round_robin_undone(g, source.dp) for g in groups]
    if target.zero in (1, 2):
        groups = [round_robin(g, target.dp) for g in groups]
    return replace(layout, groups=groups)


def check_sub_groups(layout: Layout, dp: int, where: str) -> None:
    """ZeRO-3 splits a param group whose per-rank elements exceed ``sub_group_size`` (the
    source's ds_config, else DeepSpeed's default 1e9) into sub-groups, each with its own
    flat group and optimizer state; one partition per group is all that is written."""
    config = (layout.model_states.get("ds_config") or {}).get("zero_optimization") or {}
    value = config.get("sub_group_size")
    limit = int(float(1e9 if value is None else value))
    for g, group in enumerate(layout.groups):
        numel = zero3_partition(group, dp, 0).shape[0]
        if numel > limit:
            raise TopologyError(f"param group {g} has {numel} elements per rank at DP{dp}, over "
                                f"ZeRO-3's sub_group_size {limit}: DeepSpeed would split it into "
                                "sub-groups, which are not written yet", path=where,
                                hint="Write at a larger DP, or convert to deepspeed-universal")


def ds_config_for(layout: Layout, topo: Topology) -> dict:
    """The source's ds_config with the target's stage and per-GPU micro batch (DeepSpeed
    stores it and does not read it on load)."""
    config = copy.deepcopy(layout.model_states.get("ds_config") or {})
    if isinstance(config.get("zero_optimization"), dict):
        config["zero_optimization"]["stage"] = topo.zero
    batch, gas = config.get("train_batch_size"), config.get("gradient_accumulation_steps") or 1
    if isinstance(batch, int) and batch % (topo.dp * gas) == 0 and "train_micro_batch_size_per_gpu" in config:
        config["train_micro_batch_size_per_gpu"] = batch // (topo.dp * gas)
    return config


def model_states_tree(layout: Layout, topo: Topology, rank: int, pending: dict) -> dict:
    tree = dict(layout.model_states)
    tree["param_shapes"] = [OrderedDict((n, torch.Size(s)) for n, s in group)
                            for group in layout.groups] if topo.zero else None  # .numel() is called
    # a tied alias is the very same tensor (one storage in the file), as torch.save keeps it
    tree["module"] = OrderedDict(
        (name, pending.get(("module", layout.shared.get(name, name)), torch.empty(0, dtype=dtype)))
        for name, shape, dtype in layout.module)
    frozen = OrderedDict((n, pending[("frozen", n)]) for n, _ in layout.frozen) if topo.zero >= 2 else None
    tree["frozen_param_fragments"] = frozen
    tree["frozen_param_shapes"] = OrderedDict((n, torch.Size(s)) for n, s in layout.frozen) \
        if frozen is not None else None
    tree["shared_params"] = (dict(layout.shared) if rank == 0 else {}) if topo.zero else None
    if topo.zero == 0:
        tree["optimizer"] = _torch_optimizer(layout, pending)
    tree["dp_world_size"] = topo.dp
    if "ds_config" in tree:
        tree["ds_config"] = ds_config_for(layout, topo)
    tree[MARK] = {"version": VERSION}
    return tree


def _torch_optimizer(layout: Layout, pending: dict) -> dict | None:
    """A stage-0 engine's ``optimizer``: the torch state dict, parameters numbered across the
    groups in order (the rule :func:`converters.deepspeed.stage0_groups` reads back); each its own step tensor
    (torch's Adam increments them in place). With fp32 masters (a bf16 engine) it is wrapped
    as FP16_UnfusedOptimizer saves it: the loss-scale entries, ``optimizer_state_dict`` and
    ``fp32_groups`` (the masters, group by group in the same order)."""
    params = [name for group in layout.groups for name, _ in group]
    if not params or ("optim", params[0], MOMENTS[0]) not in pending:
        return None

    def entry(g, name):
        step = layout.steps[g]
        return {"step": step.clone() if isinstance(step, torch.Tensor) else step,
                **{kind: pending[("optim", name, kind)] for kind in MOMENTS}}

    osd = torch_state_dict([[name for name, _ in group] for group in layout.groups], layout.hyper,
                           entry)
    if ("optim", params[0], "fp32_param") not in pending:
        return osd
    return {**_unfused_scaler(layout), UNFUSED_STATE: osd,
            UNFUSED_MASTERS: [[pending[("optim", name, "fp32_param")] for name, _ in group]
                              for group in layout.groups]}


def _unfused_scaler(layout: Layout) -> dict:
    """FP16_UnfusedOptimizer's loss-scale entries: a stage-0 source's own, else those of a
    ZeRO source's (static) ``loss_scaler``; ``cur_iter`` counts the optimizer's steps."""
    if layout.scaler is not None:
        return dict(layout.scaler)
    state = getattr(layout.osd.get("loss_scaler"), "_state", None) or {}
    return {"dynamic_loss_scale": bool(layout.osd.get("dynamic_loss_scale")),
            "cur_scale": float(state.get("cur_scale", 1.0)),
            "cur_iter": int_or_none(layout.model_states.get("global_steps")) or 0}


def optim_states_tree(layout: Layout, topo: Topology, rank: int, pads: list[int], pending: dict) -> dict:
    """One rank's optimizer file: the source's entries, the per-rank ones rewritten."""
    groups = range(len(layout.groups))
    hyper = [dict(h, name=f"ep_size_{layout.experts.ep}") if layout.experts and g in layout.experts.groups
             else h for g, h in enumerate(layout.hyper)]  # DeepSpeed finds a MoE group's EP group by it
    state = {"state": {g: {"step": layout.steps[g],
                           **{k: pending[(g, k)] for k in MOMENTS}} for g in groups},
             "param_groups": [dict(h, params=[g]) for g, h in zip(groups, hyper)]}
    masters = [pending[(g, "fp32_param")] for g in groups]
    osd = dict(layout.osd)
    if "zero_stage" in osd and topo.zero != layout.stage:
        osd["zero_stage"] = type(osd["zero_stage"])(topo.zero)
    if topo.zero == 3:
        for key in _ZERO12_ONLY:
            osd.pop(key, None)
    elif layout.stage in (0, 3):  # the ZeRO-1/2 entries the source's files lack, as DeepSpeed writes them
        config = layout.model_states.get("ds_config") or {}
        osd.setdefault("clip_grad", float(config.get("gradient_clipping", 0.0)))
        osd.setdefault("ds_version", layout.model_states.get("ds_version"))
    if topo.zero < 3 and (layout.stage in (0, 3) or "param_alignment_paddings" in osd):
        osd["param_alignment_paddings"] = [alignment_paddings(g, layout.align) for g in layout.groups]
    if topo.zero == 3:
        osd.update(optimizer_state_dict=state, fp32_flat_groups=masters, partition_count=topo.dp)
    else:
        last = rank == topo.dp - 1
        cuts = [rank_group(layout, g, topo.dp, rank) for g in groups]
        osd.update(base_optimizer_state=state, single_partition_of_fp32_groups=masters,
                   partition_count=[count for _, count, _, _ in cuts],
                   group_paddings=[(pending[(g, "exp_avg")].shape[0] * topo.dp
                                    - sum(math.prod(s) for _, s in layout.groups[g])) * last
                                   for g in groups] if layout.bf16_optimizer else list(pads))
        # what ds_to_universal reads; a ZeRO-3 or stage-0 source has none to take the class from
        fragment = layout.fragment_type or record_class("deepspeed.utils.tensor_fragment", "fragment_address")
        osd["param_slice_mappings"] = [_fragments(fragment, names, count, part, layout.align)
                                       for _, count, part, names in cuts]
    tree = dict(layout.optim_file)
    tree["optimizer_state_dict"] = osd
    if "ds_config" in tree:
        tree["ds_config"] = ds_config_for(layout, topo)
    return tree


def _fragments(cls: type, group: Group, dp: int, rank: int, align: int = 1) -> OrderedDict:
    """``param_slice_mappings``: each parameter in this partition, ``fragment_address(numel,
    start)`` with start the offset inside the partition (read by ds_to_universal)."""
    shard, _ = zero_partition(group, dp, rank, align=align)
    out = OrderedDict()
    for offset, region in shard.parts:
        address = cls.__new__(cls)  # the source's opaque class: pickled back under its name
        address.__setstate__({"numel": region.numel, "start": offset})
        out[region.key] = address
    return out
