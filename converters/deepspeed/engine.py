"""DeepSpeed checkpoints (plain engines: mp=1, no pipeline, no MoE), read and written.

Pipeline checkpoints (Megatron-DeepSpeed's ``layer_*-model_*-model_states.pt``) are read
by :mod:`converters.deepspeed.pipe`, dispatched from :meth:`DeepSpeedReader.read_index`.

A run root has ``latest`` (the tag) and ``<tag>/`` (default ``global_step{N}``) with:

* **model states**: ``mp_rank_00_model_states.pt`` (stages 0-2, written once) or
  ``zero_pp_rank_{r}_mp_rank_00_model_states.pt`` (ZeRO-3, one per DP rank). ``module`` is
  the model's state dict (full tensors in the model dtype; at ZeRO-3 every parameter is an
  empty tensor and only buffers are real). ``param_shapes`` lists, per optimizer param
  group, the trainable parameters in flat-buffer order, tied parameters once under their
  owner; ``shared_params`` maps each alias to its owner. Frozen parameters are in ``module``
  and, from stage 2, in ``frozen_param_fragments`` (ZeRO-3: each rank's slice).
  ``dp_world_size`` is the only thing DeepSpeed checks against the job's DP size.
* **optimizer states** ``[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt``, one per DP
  rank, holding that rank's partition of each param group
  (:func:`~converters.deepspeed.zero.zero_partition`, :func:`~converters.deepspeed.zero.zero3_partition`) for
  the fp32 masters and the Adam moments, plus the torch optimizer's ``step`` and
  hyperparameters per group.

The global view: every ``module`` entry by its name (aliases are replicas of the owner),
and ``optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.<name>`` for trainable parameters. At
ZeRO-3 the fp32 partitions are the only copy of the weights, so they are the parameters
themselves and there is no separate ``fp32_param`` entry.

What ckptool writes carries a top-level ``ckptool`` entry in its model states (DeepSpeed
hands unknown entries back as client state); without ``ckptool.json`` it is not committed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

from ckptool.core.engine import TargetFile, TargetTensor
from ckptool.core.errors import (
    BadCheckpoint,
    TopologyError,
    UnreadableInput,
    UnsupportedFormat,
    UsageError,
)
from ckptool.core.index import CheckpointIndex, ObjectInfo, Writer
from ckptool.core.lazy import lazy
from ckptool.core.optimizer import FreshState, no_decay, state_key
from ckptool.core.regions import Region, Shard
from ckptool.core.safe_pickle import record_class
from ckptool.core.storage import Store, pointed_dir
from ckptool.core.topology import Topology
from ckptool.core.torchfile import Pending, TensorRef
from ckptool.core.torchreader import save_target

# The pipeline variant of this format (layer files), dispatched from the reader; the
# registry picks its writer. It imports nothing from this module.
from converters.deepspeed.pipe import PipeLayout, is_pipeline, read_pipeline
from converters.deepspeed.zero import (
    DYNAMIC_SCALER,
    EXPERT_FILE,
    EXPERT_NAME,
    MARK,
    MOMENTS,
    OPTIM_FILE,
    PER_RANK,
    UNFUSED_MASTERS,
    UNFUSED_STATE,
    Layout,
    Stage0Module,
    ZeroReader,
    add_region,
    alignment_paddings,
    Experts,
    check_sub_groups,
    expert_groups,
    int_or_none,
    model_states_tree,
    optim_states_tree,
    ordered_for,
    param_groups,
    parameter_alignment,
    rank_files,
    rank_group,
    record_layout,
    source_state_key,
    uncarried_state,
    zero3_partition,
    zero_partition,
    zero_stage,
)
from converters.schemas.hf import CONFIG

torch = lazy("torch", globals())

NAME = "deepspeed"
LATEST = "latest"
MODEL_STATES_SUFFIX = "_model_states.pt"
_MP_STATES = re.compile(r"^mp_rank_(\d{2})_model_states\.pt$")
_ZERO_STATES = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d{2})_model_states\.pt$")
_STEP_DIR = re.compile(r"^global_step(\d+)$")
_EXPERT_STATES = re.compile(r"^(layer_\d+_)?expert_\d+_mp_rank_\d{2}_model_states\.pt$")
"""deepspeed.moe.layer.MoE's expert files (``layer_{L}_expert_{E}_mp_rank_{MM}_model_states.pt``)."""


# ------------------------------------------------------------------------- reading


def _has_model_states(store: Store, rel: str = "") -> bool:
    return any(not d and n.endswith(MODEL_STATES_SUFFIX) for n, d in store.ls(rel))


def _tag(store: Store) -> str:
    """The directory (relative) that holds the files: the store itself, ``latest``'s tag, or
    the newest ``global_step*``."""
    if _has_model_states(store):
        return ""
    tag = pointed_dir(store, LATEST)
    if tag is not None:
        return tag
    steps = sorted((int(m.group(1)), n) for n, d in store.ls() if d and (m := _STEP_DIR.match(n)))
    if steps:
        return steps[-1][1]
    raise UnreadableInput("no DeepSpeed model-states files found", path=store.url)


class DeepSpeedReader(ZeroReader):
    name = NAME

    @classmethod
    def detect(cls, store: Store) -> bool:
        if store.isdir("zero"):
            return False  # universal
        if _has_model_states(store):
            return True
        tag = pointed_dir(store, LATEST)  # a `latest` naming a missing tag is refused here
        return tag is not None and _has_model_states(store, tag) and not store.isdir(f"{tag}/zero")

    def canonical(self, store: Store, index: CheckpointIndex) -> CheckpointIndex | None:
        if index.layout(PipeLayout) is not None:
            return None  # a pipeline's layer files are read under canonical names already
        return super().canonical(store, index)

    def read_index(self, store: Store) -> CheckpointIndex:
        tag = _tag(store)
        where = store.display(tag)
        join = (lambda n: f"{tag}/{n}") if tag else (lambda n: n)
        names = [n for n, d in store.ls(tag) if not d]
        experts = [n for n in names if _EXPERT_STATES.match(n)]
        if experts and (is_pipeline(names) or not any(OPTIM_FILE.match(n) for n in names)
                        or any(_ZERO_STATES.match(n) for n in names)):
            raise UnsupportedFormat(f"DeepSpeed MoE checkpoints (expert files such as {experts[0]}) "
                                    "are read at ZeRO-1/2 only, not of a pipeline, stage-0 or ZeRO-3 "
                                    "engine", path=where,
                                    hint="Nothing was read or written; reshard it with DeepSpeed at "
                                         "the same EP, or save it at ZeRO-1/2")
        if is_pipeline(names):  # Megatron-DeepSpeed's layer files: canonical names already
            return read_pipeline(self, store, tag, names)
        zero3 = {int(m.group(1)): join(n) for n in names if (m := _ZERO_STATES.match(n))}
        optim = {int(m.group(2)): join(n) for n in names if (m := OPTIM_FILE.match(n))}
        mp_ranks = {m.group(m.re.groups) for n in names
                    if (m := _MP_STATES.match(n) or _ZERO_STATES.match(n) or OPTIM_FILE.match(n))}
        if mp_ranks - {"00"}:
            raise UnreadableInput("model-parallel DeepSpeed checkpoints (mp_rank > 00) are not "
                                  "supported yet", path=where)
        first = zero3.get(0) or join("mp_rank_00_model_states.pt")
        ms = self._load(store, first).obj
        module = ms.get("module")
        if not isinstance(module, dict) or not all(isinstance(v, TensorRef) for v in module.values()):
            raise BadCheckpoint("model states have no `module` state dict of tensors",
                                path=store.display(first))
        if (zero3 or ms.get("param_shapes")) and not optim:
            raise BadCheckpoint("the ZeRO optimizer-states files are missing", path=where)
        dp = int(ms.get("dp_world_size") or 1)
        osd = None
        if optim:
            optim_rels = rank_files(optim, dp, "optimizer", where)
            osd = self._load(store, optim_rels[0]).obj.get("optimizer_state_dict")
            if not isinstance(osd, dict):
                raise BadCheckpoint("optimizer file has no optimizer_state_dict",
                                    path=store.display(optim_rels[0]))
        stage = 3 if zero3 else zero_stage(osd, ms)
        if osd is not None:
            _check_version(osd.get("ds_version") or ms.get("ds_version"), stage, where)
        layout = self._layout(store, tag, stage, first, optim, osd) if stage else None
        if experts:
            layout.experts = self._experts(store, tag, experts, layout, ms, dp, where)
        ep = layout.experts.ep if layout is not None and layout.experts else 1
        index = CheckpointIndex(format=NAME, url=store.url, topology=Topology(dp=dp, zero=stage, ep=ep),
                                iteration=int_or_none(ms.get("global_steps")),
                                format_version=str(ms.get("ds_version") or "") or None,
                                written_by_ckptool=MARK in ms)
        for key in ("global_steps", "global_samples", "skipped_steps", "lr_scheduler", "ds_config"):
            if key in ms:
                index.objects[key] = ObjectInfo(key, value=self._load(store, first).materialize(ms[key]))
        if stage == 0:
            aliases = _aliases(module)
            self._read_module(store, index, first, ms, aliases)
            if ms.get("optimizer"):
                self._read_stage0_optimizer(store, index, tag, first, ms, aliases)
            if index.layout(Layout) is None:
                index.set_layout(Stage0Module())
            return index
        model_rels = rank_files(zero3, dp, "ZeRO-3 model-states", where) if zero3 else [first]
        index.unmapped = uncarried_state(
            (osd.get("base_optimizer_state", osd.get("optimizer_state_dict")) or {}).get("state"))
        record_layout(index, layout)
        index.objects["optimizer.step"] = ObjectInfo("optimizer.step", value=layout.steps)
        index.objects["optimizer.param_groups"] = ObjectInfo("optimizer.param_groups", value=layout.hyper)
        if stage < 3:
            self._read_module(store, index, first, ms, layout.shared)
            if layout.experts is not None:
                self._read_expert_files(store, index, tag, experts)
        else:
            self._read_zero3_model_states(store, index, model_rels, layout)
            dtypes = {dtype for name, _, dtype in layout.module if name in layout.trainable}
            index.model_dtype = dtypes.pop() if len(dtypes) == 1 else None
        for rank, rel in enumerate(optim_rels):
            self._read_partitions(store, index, rel, rank, dp, layout)
        for key, info in index.tensors.items():
            if not info.pieces:
                raise BadCheckpoint("tensor has only replicas, no primary copy", path=where, key=key)
        return index

    def _layout(self, store, tag, stage, first, optim, osd) -> Layout:
        """The structure of the source and its non-tensor entries (rank 0's files)."""
        source = store.display(optim[0])
        ms = self._load(store, first).obj
        groups = param_groups(ms)
        if not groups:
            raise BadCheckpoint("model states have no param_shapes", path=store.display(tag))
        module = ms["module"]
        shared = dict(ms.get("shared_params") or {})
        trainable = {n for g in groups for n, _ in g}
        buffers = set(ms.get("buffer_names") or ())
        frozen_shapes = ms.get("frozen_param_shapes")
        frozen = [(n, tuple(s)) for n, s in frozen_shapes.items()] if frozen_shapes else \
            [(n, tuple(v.shape)) for n, v in module.items()
             if n not in trainable and n not in buffers and n not in shared]
        dtypes = {v.dtype for n, v in module.items() if n in trainable}
        zero_config = (ms.get("ds_config") or {}).get("zero_optimization") or {}
        align = parameter_alignment(bool(zero_config.get("parameter_alignment")) and
                                    "zero_stage" in osd,
                                    dtypes.pop() if len(dtypes) == 1 else torch.float32)
        stored = osd.get("param_alignment_paddings")
        if stored is not None and [list(p) for p in stored] != \
                [alignment_paddings(g, align) for g in groups]:
            raise UnreadableInput("param_alignment_paddings do not follow DeepSpeed's rule for this "
                                  "run's ds_config and dtype; ckptool cannot lay this buffer out",
                                  path=source)
        base = osd.get("base_optimizer_state", osd.get("optimizer_state_dict"))
        if not isinstance(base, dict):
            raise UnreadableInput("elastic DeepSpeed optimizer checkpoints are not supported yet",
                                  path=source, hint="Save with elastic_checkpoint off")
        if sorted(base.get("state", {})) != list(range(len(groups))) or \
                len(base.get("param_groups", ())) != len(groups):
            raise UnreadableInput("the optimizer has not one partition per param group "
                                  "(ZeRO-3 sub_group_size below a group's size?)", path=source)
        archive = self._load(store, optim[0])
        fragments = [v for g in osd.get("param_slice_mappings") or () for v in g.values()]
        model_states = {k: (None if k in ("module", "frozen_param_fragments") else v)
                        for k, v in ms.items()}
        return Layout(
            tag=tag or "global_step%d" % (int_or_none(ms.get("global_steps")) or 0), stage=stage,
            bf16_files=optim[0].rsplit("/", 1)[-1].startswith("bf16_"),
            bf16_optimizer="zero_stage" not in osd, groups=groups, frozen=frozen, shared=shared,
            module=[(n, tuple(v.shape), v.dtype) for n, v in module.items()],
            model_states=self._load(store, first).materialize(model_states),
            optim_file={k: (None if k == "optimizer_state_dict" else archive.materialize(v))
                        for k, v in archive.obj.items()},
            osd={k: archive.materialize(v) for k, v in osd.items() if k not in PER_RANK},
            hyper=[{k: v for k, v in g.items() if k != "params"} for g in base["param_groups"]],
            steps=[archive.materialize(base["state"][g].get("step")) for g in range(len(groups))],
            fragment_type=type(fragments[0]) if fragments else None, align=align)

    def _experts(self, store, tag, files, layout, ms, dp, where) -> Experts:
        """deepspeed.moe's layout (:class:`~converters.deepspeed.zero.Experts`) from the MoE
        param groups and the expert files, checked against each other."""
        moe = [g for g, h in enumerate(layout.hyper) if h.get("moe")]
        sizes = {str(layout.hyper[g].get("name")) for g in moe}
        found = [re.fullmatch(r"ep_size_(\d+)", n) for n in sizes]
        if not moe or len(sizes) != 1 or not found[0]:
            raise UnreadableInput(f"the expert files' MoE param groups are named {sorted(sizes)}: one "
                                  "EP size (ep_size_N) is read", path=where)
        ep = int(found[0].group(1))
        by_layer: dict[int, dict[int, str]] = {}
        for n in files:
            m = EXPERT_FILE.match(n)
            if m is None or m.group(3) != "00":
                raise UnreadableInput(f"expert file {n} is not layer_L_expert_E_mp_rank_00", path=where)
            by_layer.setdefault(int(m.group(1)), {})[int(m.group(2))] = f"{tag}/{n}" if tag else n
        if sorted(by_layer) != list(range(len(by_layer))):
            raise BadCheckpoint(f"expert files are for MoE layers {sorted(by_layer)}", path=where)
        layers, num_experts = [], {}
        for L in range(len(by_layer)):
            rels = by_layer[L]
            if sorted(rels) != list(range(len(rels))) or len(rels) % ep or dp % ep:
                raise BadCheckpoint(f"MoE layer {L} has expert files {sorted(rels)}: not every expert of "
                                    f"an EP{ep} run of DP{dp}", path=where)
            entries = None
            for e, rel in sorted(rels.items()):
                obj = self._load(store, rel).obj
                if not isinstance(obj, dict) or not all(isinstance(v, TensorRef) for v in obj.values()):
                    raise BadCheckpoint("expert file is not a state dict of tensors", path=store.display(rel))
                mine = []
                for key, ref in obj.items():
                    m = EXPERT_NAME.match(key)
                    if m is None or int(m["j"]) != e:
                        raise BadCheckpoint(f"{key} is not a parameter of expert {e}", path=store.display(rel))
                    mine.append((m["prefix"], m["rest"], tuple(ref.shape), ref.dtype))
                if entries is None:
                    entries = mine
                elif mine != entries:
                    raise BadCheckpoint(f"expert {e} has other parameters than expert 0", path=store.display(rel))
            prefixes = {p for p, *_ in entries}
            if len(prefixes) != 1 or next(iter(prefixes)) in num_experts:
                raise BadCheckpoint(f"the expert files of MoE layer {L} name {len(prefixes)} modules", path=where)
            prefix = prefixes.pop()
            num_experts[prefix] = len(rels)
            layers.append((prefix, tuple((rest, shape, dtype) for _, rest, shape, dtype in entries)))
        stored = ms.get("num_experts")
        if stored is not None and list(stored) != [num_experts[p] for p, _ in layers]:
            raise BadCheckpoint(f"model states say num_experts {stored}, the expert files hold "
                                f"{[num_experts[p] for p, _ in layers]}", path=where)
        out = Experts(ep, tuple(moe), num_experts, tuple(layers))
        try:
            rebuilt = expert_groups(layout.groups, moe, ep, ep)
        except UnreadableInput as exc:
            raise UnreadableInput(exc.message, path=where) from None
        if rebuilt != layout.groups or any(EXPERT_NAME.match(n)["prefix"] not in num_experts
                                           for g in moe for n, _ in layout.groups[g]):
            raise UnreadableInput("the MoE param groups are not each MoE layer's local experts in "
                                  "order, which is the layout ckptool reads", path=where)
        return out

    def _read_expert_files(self, store, index, tag, files) -> None:
        """The experts' weights: each expert file's tensors, under their global names."""
        for n in files:
            rel = f"{tag}/{n}" if tag else n
            for key, ref in self._load(store, rel).obj.items():
                add_region(index, key, ref, Region.whole(key, ref.shape), rel, (key,), 0)

    def _read_stage0_optimizer(self, store, index, tag, rel, ms, aliases) -> None:
        """A stage-0 engine's optimizer: the client's torch optimizer state dict, which numbers
        parameters by position across its param groups. Mapped to names by :func:`stage0_groups`.
        An fp32 engine's weights are the module's (no separate masters), as at ZeRO-3; a
        bf16/fp16 engine's FP16_UnfusedOptimizer keeps fp32 masters beside the state dict
        (``fp32_groups``, parallel to its param groups) and its loss-scale entries."""
        archive = self._load(store, rel)
        mapped = stage0_groups(ms, aliases)
        if isinstance(mapped, str):
            index.unmapped = f"DeepSpeed stage-0 optimizer state: {mapped}"
            return
        groups, order, frozen = mapped
        osd, wrapper = _unwrapped(ms["optimizer"])
        steps = []
        for g, group in enumerate(groups):
            values = {repr(archive.materialize(osd["state"][order[n]].get("step"))) for n, _ in group}
            if len(values) > 1:
                index.unmapped = f"DeepSpeed stage-0 optimizer state: steps differ within param group {g}"
                return
            steps.append(archive.materialize(osd["state"][order[group[0][0]]].get("step")) if group else 0)
        module = ms["module"]
        scaler = None if wrapper is None else {k: archive.materialize(v) for k, v in wrapper.items()
                                               if k not in (UNFUSED_STATE, UNFUSED_MASTERS)}
        layout = Layout(
            tag=tag or "global_step%d" % (int_or_none(ms.get("global_steps")) or 0), stage=0,
            bf16_files=False, bf16_optimizer=False, groups=groups, frozen=frozen, shared=aliases,
            module=[(n, tuple(v.shape), v.dtype) for n, v in module.items()],
            model_states=archive.materialize({k: v for k, v in ms.items()
                                              if k not in ("module", "optimizer")}),
            optim_file={"ds_version": ms.get("ds_version")},
            osd={"loss_scaler": _loss_scaler(float((scaler or {}).get("cur_scale", 1.0))),
                 "dynamic_loss_scale": bool((scaler or {}).get("dynamic_loss_scale")),
                 "overflow": False, "zero_stage": 0, "ds_version": ms.get("ds_version")},
            hyper=[{k: archive.materialize(v) for k, v in pg.items() if k != "params"}
                   for pg in osd["param_groups"]], steps=steps, scaler=scaler)
        layout.bf16_files = layout.model_dtype == torch.bfloat16  # the name of ZeRO output files
        record_layout(index, layout)
        index.objects["optimizer.step"] = ObjectInfo("optimizer.step", value=steps)
        index.objects["optimizer.param_groups"] = ObjectInfo("optimizer.param_groups", value=layout.hyper)
        at = ("optimizer",) if wrapper is None else ("optimizer", UNFUSED_STATE)
        slots = {i: (g, j) for g, pg in enumerate(osd["param_groups"]) for j, i in enumerate(pg["params"])}
        for name, shape in (p for group in groups for p in group):
            i = order[name]
            vectors = [(kind, osd["state"][i].get(kind), (*at, "state", i, kind)) for kind in MOMENTS]
            if wrapper is not None:
                g, j = slots[i]
                vectors.append(("fp32_param", wrapper[UNFUSED_MASTERS][g][j],
                                ("optimizer", UNFUSED_MASTERS, g, j)))
            for kind, ref, path in vectors:
                if not isinstance(ref, TensorRef) or tuple(ref.shape) != shape or \
                        ref.dtype != torch.float32:
                    raise BadCheckpoint(f"{kind} of {name} is not an fp32 tensor of its shape "
                                        f"{list(shape)}", path=store.display(rel))
                key = state_key(kind, name)
                add_region(index, key, ref, Region.whole(key, shape), rel, path, 0)

    def _read_module(self, store, index, rel, ms, shared) -> None:
        """Stages 0-2: every ``module`` entry is a full tensor; aliases (and stage 2's frozen
        fragments) are replicas."""
        for name, ref in ms["module"].items():
            owner = shared.get(name)
            add_region(index, owner or name, ref, Region.whole(owner or name, ref.shape), rel,
                 ("module", name), 0, replica=owner is not None)
        for name, ref in (ms.get("frozen_param_fragments") or {}).items():
            add_region(index, name, ref, Region.whole(name, ref.shape), rel,
                 ("frozen_param_fragments", name), 0, replica=True)

    def _read_zero3_model_states(self, store, index, rels, layout) -> None:
        """ZeRO-3: buffers are full in every rank's ``module`` (rank 0's is primary); frozen
        parameters are cut across ranks' ``frozen_param_fragments``."""
        for rank, rel in enumerate(rels):
            ms = self._load(store, rel).obj
            for name, ref in ms["module"].items():
                if name not in layout.params:
                    add_region(index, name, ref, Region.whole(name, ref.shape), rel, ("module", name), 0,
                         replica=rank > 0)
            fragments = ms.get("frozen_param_fragments") or {}
            for name, shape in layout.frozen:
                ref = fragments.get(name)
                shard = zero3_partition([(name, shape)], len(rels), rank)
                if not isinstance(ref, TensorRef) or ref.numel != shard.shape[0]:
                    raise BadCheckpoint(f"frozen fragment is not this rank's ZeRO-3 slice "
                                        f"({shard.shape[0]} elements)", path=store.display(rel),
                                        key=name)
                for offset, region in shard.parts:
                    add_region(index, name, ref, region, rel, ("frozen_param_fragments", name), offset)

    def _read_partitions(self, store, index, rel, rank, dp, layout) -> None:
        """One rank's optimizer file: its partition of every group, checked against the rule."""
        source = store.display(rel)
        osd = self._load(store, rel).obj.get("optimizer_state_dict") or {}
        zero3 = layout.stage == 3
        moments_at = ("optimizer_state_dict", "optimizer_state_dict" if zero3 else "base_optimizer_state")
        masters_at = ("optimizer_state_dict", "fp32_flat_groups" if zero3 else "single_partition_of_fp32_groups")
        base = osd.get(moments_at[1])
        states = (base.get("state") or {}) if isinstance(base, dict) else {}
        masters = osd.get(masters_at[1]) or []
        if len(masters) != len(layout.groups):
            raise BadCheckpoint("optimizer file does not hold one fp32 partition per param group",
                                path=source)
        for g, group in enumerate(layout.groups):
            if zero3:  # the masters are the weights themselves
                shard, weights = zero3_partition(group, dp, rank), None
                fp32_len = shard.shape[0]
            else:
                flat, count, part, _ = rank_group(layout, g, dp, rank)
                if layout.experts is not None and (osd.get("partition_count") or [None] * (g + 1))[g] != count:
                    raise BadCheckpoint(f"param group {g} is cut into {osd.get('partition_count')} "
                                        f"partitions, the ZeRO rule at DP{dp}/EP{layout.experts.ep} "
                                        f"says {count}", path=source)
                shard, pad = zero_partition(flat, count, part, align=layout.align)
                weights, fp32_len = "fp32_param", shard.shape[0] - (0 if layout.bf16_optimizer else pad)
                paddings = osd.get("group_paddings") or []
                if not layout.bf16_optimizer and (len(paddings) <= g or paddings[g] != pad):
                    raise BadCheckpoint(f"group_paddings do not follow the ZeRO rule ({pad} "
                                        f"expected for group {g})", path=source)
            vectors = [(kind, states.get(g, {}).get(kind), (*moments_at, "state", g, kind), shard.shape[0])
                       for kind in MOMENTS]
            vectors.append((weights, masters[g], (*masters_at, g), fp32_len))
            for kind, ref, path, length in vectors:
                if not isinstance(ref, TensorRef) or ref.numel != length:
                    raise BadCheckpoint(f"{kind or 'fp32 weights'} of param group {g} has "
                                        f"{getattr(ref, 'numel', 'no')} elements, the ZeRO-{layout.stage} "
                                        f"rule at DP{dp} says {length}", path=source)
                for offset, region in shard.parts:
                    key = state_key(kind, region.key) if kind else region.key
                    add_region(index, key, ref, replace(region, key=key), rel, path, offset)



def stage0_groups(ms: dict, aliases: dict[str, str]):
    """The param groups of a stage-0 engine's torch optimizer, by name: ``(groups, {name:
    state index}, frozen)``, or why they cannot be known.

    A torch state dict numbers parameters across its groups in order. The candidates are the
    module's parameters in ``named_parameters()`` order (its state dict without
    ``buffer_names`` and tied aliases). Two grouping rules are tried: one group, and the
    weight-decay split (biases and 1-D parameters apart, as the HF Trainer and Megatron do).
    A group may skip candidates (frozen parameters are in no group), so its stored moment
    shapes must be a subsequence of the rule's candidates, and the only one: an ambiguous
    or failed match is refused, never guessed."""
    if isinstance(ms.get("optimizer"), dict) and "fp32_groups_flat" in ms["optimizer"]:
        return ("FP16_Optimizer's flat fp32 groups (a fused-Adam fp16/bf16 engine) are not mapped "
                "to parameters yet")
    osd, wrapper = _unwrapped(ms.get("optimizer"))
    if not isinstance(osd, dict) or not isinstance(osd.get("state"), dict) or \
            not isinstance(osd.get("param_groups"), list):
        return "not a torch optimizer state dict"
    if wrapper is not None and [len(g) if isinstance(g, list) else None for g in wrapper[UNFUSED_MASTERS]] \
            != [len(pg.get("params") or ()) for pg in osd["param_groups"]]:
        return "FP16_UnfusedOptimizer's fp32_groups do not match its param groups"
    uncarried = uncarried_state(osd["state"])
    if uncarried:
        return uncarried
    buffers = set(ms.get("buffer_names") or ())
    candidates = [(n, tuple(v.shape)) for n, v in ms["module"].items()
                  if n not in buffers and n not in aliases]
    stored = []
    for g, pg in enumerate(osd["param_groups"]):
        shapes = []
        for i in pg.get("params") or ():
            ref = (osd["state"].get(i) or {}).get("exp_avg")
            if not isinstance(ref, TensorRef):
                return (f"parameter {i} of param group {g} has no Adam state (saved before its first "
                        "step, or a parameter the optimizer never updated)")
            shapes.append((i, tuple(ref.shape)))
        stored.append(shapes)
    rules = {1: [candidates],
             2: [[c for c in candidates if not no_decay(c[0], len(c[1]))],
                 [c for c in candidates if no_decay(c[0], len(c[1]))]]}
    pools = rules.get(len(stored))
    if pools is None:
        return (f"{len(stored)} param groups: only one group or the weight-decay split (2) "
                "can be mapped to names")
    groups, order = [], {}
    for g, (shapes, pool) in enumerate(zip(stored, pools)):
        picked = _unique_subsequence([s for _, s in shapes], [s for _, s in pool])
        if picked is None:
            return (f"param group {g}'s {len(shapes)} parameters do not match the model's "
                    f"{'parameters' if len(stored) == 1 else ('weight-decay' if g == 0 else 'no-decay') + ' parameters'} "
                    "in one way only")
        groups.append([pool[j] for j in picked])
        order.update({pool[j][0]: i for j, (i, _) in zip(picked, shapes)})
    frozen = [c for c in candidates if c[0] not in order]
    return groups, order, frozen


def _unique_subsequence(want: list, pool: list) -> list[int] | None:
    """Positions in ``pool`` where ``want`` occurs as a subsequence, if exactly one way.

    Every embedding lies between the leftmost (greedy from the front) and the rightmost
    (greedy from the back), position by position, so it is unique exactly when those two
    are the same: linear time, whatever the model's size."""
    def greedy(items, values):
        out, j = [], 0
        for value in items:
            while j < len(values) and values[j] != value:
                j += 1
            if j == len(values):
                return None
            out.append(j)
            j += 1
        return out

    left = greedy(want, pool)
    right = greedy(want[::-1], pool[::-1])
    if left is None or right is None:
        return None
    right = [len(pool) - 1 - j for j in reversed(right)]
    return left if left == right else None


def scaler_is_dynamic(state: dict | None) -> bool:
    """Whether a recorded loss scaler (the save hook's dict of its attributes) is dynamic."""
    return bool(state) and bool(state.get("dynamic") or "scale_window" in state)


def _loss_scaler(scale: float | dict = 1.0, where: str | None = None):
    """The ``loss_scaler`` that ZeRO files carry (never imported: pickled under its name).
    A number: DeepSpeed's static ``LossScaler(scale)`` (1 for fp32 and bf16 engines). A dict
    (the save hook's record of an fp16 engine's scaler): a static one at its ``cur_scale``,
    or, when it is dynamic, a ``DynamicLossScaler`` in that state, every attribute carried;
    one the record lacks is refused (a fresh or static scaler would change the run)."""
    if isinstance(scale, dict):
        state = scale
        if not all(type(v) in (int, float, bool) or v is None for v in state.values()):
            raise UnreadableInput("the loss scaler recorded holds something other than numbers",
                                  path=where)
        if not scaler_is_dynamic(state):
            return _loss_scaler(float(state.get("cur_scale") or 1.0))
        missing = [k for k in DYNAMIC_SCALER if k not in state]
        if missing:
            raise UsageError(f"the dynamic loss scaler recorded lacks {', '.join(missing)}",
                             path=where, hint="Save again with this ckptool's training.deepspeed")
        cls = record_class("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler")
        scaler = cls.__new__(cls)
        scaler.__setstate__({**{k: state[k] for k in DYNAMIC_SCALER}, "dynamic": True,
                             "dtype": torch.float16})
        return scaler
    cls = record_class("deepspeed.runtime.fp16.loss_scaler", "LossScaler")
    scaler = cls.__new__(cls)
    scaler.__setstate__({"cur_scale": scale, "dynamic": False})
    return scaler


def _unwrapped(optimizer) -> tuple[Any, dict | None]:
    """A stage-0 engine's ``optimizer`` entry: ``(the torch state dict, the
    FP16_UnfusedOptimizer state dict around it or None)``. An fp32 engine saves the client
    optimizer's state dict itself; a bf16/fp16 one (not a pipeline) saves FP16_UnfusedOptimizer's
    (:data:`~converters.deepspeed.zero.UNFUSED_STATE`, :data:`~converters.deepspeed.zero.UNFUSED_MASTERS`)."""
    if isinstance(optimizer, dict) and UNFUSED_STATE in optimizer and UNFUSED_MASTERS in optimizer:
        return optimizer[UNFUSED_STATE], optimizer
    return optimizer, None


def _aliases(module: dict) -> dict[str, str]:
    """Tied entries of a state dict that records no ``shared_params`` (stage 0): torch.save
    stores a tied tensor once, so later names of the same tensor are aliases of the first."""
    first: dict[TensorRef, str] = {}
    return {name: first.setdefault(ref, name) for name, ref in module.items()
            if first.setdefault(ref, name) != name}



LEGACY_STAGE1 = (0, 3, 17)
"""ZeRO-1 partitioned its flat groups differently before DeepSpeed 0.3.17 (``legacy_stage1``);
DeepSpeed's own loader keys on ``ds_version`` there, and so does ckptool."""


def _check_version(version, stage: int, where: str) -> None:
    """Refuse the layouts ``ds_version`` says are not the ones ckptool reads."""
    parsed = _version(version)
    if stage == 1 and parsed is not None and parsed < LEGACY_STAGE1:
        raise UnreadableInput(f"a ZeRO-1 checkpoint of DeepSpeed {version}: before 0.3.17 ZeRO-1 used "
                              "the legacy stage-1 partitioning, which ckptool does not read (and "
                              "current DeepSpeed does not load)", path=where,
                              hint="Load it with DeepSpeed <= 0.5.8 (legacy_stage1) and save it again")


def _version(text) -> tuple[int, ...] | None:
    """``"0.19.8+abc"`` -> ``(0, 19, 8)``; None when there is no version."""
    match = re.match(r"^(\d+)\.(\d+)(?:\.(\d+))?", str(text or ""))
    return tuple(int(g or 0) for g in match.groups()) if match else None



# ------------------------------------------------------------------------- writing


@dataclass(frozen=True, slots=True)
class ModelStatesFile:
    """``[zero_pp_rank_R_]mp_rank_00_model_states.pt`` of DP rank ``rank``."""

    rank: int
    topo: Topology


@dataclass(frozen=True, slots=True)
class ExpertStatesFile:
    """``layer_L_expert_E_mp_rank_00_model_states.pt``: one expert's weights, global names."""


@dataclass(frozen=True, slots=True)
class OptimStatesFile:
    """``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt``: DP rank ``rank``'s partitions, and
    the tail padding of each param group's (``group_paddings``)."""

    rank: int
    topo: Topology
    pads: list[int]


class DeepSpeedWriter(Writer):
    """Writes a DeepSpeed run root (``latest`` + ``<tag>/``) from a DeepSpeed ZeRO source at
    a new DP size and any ZeRO stage 1-3 (stages 1 and 2 have files of the same shape; from
    or to 3, the fp32 masters are the weights and ZeRO-3's ``module`` keeps only buffers).
    Every rank's partitions are laid out by the rules of :mod:`converters.deepspeed.zero`; the
    non-tensor entries are the source's, with ``dp_world_size``, the stage and the partition
    bookkeeping rewritten.

    The format's other writers are registered variants (``converters.VARIANTS``): a pipeline
    source (layer files) is written by :class:`~converters.deepspeed.pipe.PipelineWriter` at
    any TP/PP/DP, a Hugging Face model by
    :class:`~converters.deepspeed.from_hf.HfModelWriter`."""

    name = NAME
    canonical_source = False  # another format is read under its stored names (an hf model's)
    fresh_optimizer = True  # for an hf source (HfModelWriter)
    param_groups: str | None = None
    """hf source with --init-optimizer: ``decay`` (the default; weight decay / none for biases
    and 1-D parameters, as the HF Trainer and Megatron group them) or ``single`` (DeepSpeed's
    own optimizer from its config)."""
    _source: Layout | None = None
    _source_store: Store | None = None

    def configure(self, *, param_groups: str | None = None, **unknown) -> None:
        super().configure(**unknown)
        if param_groups is not None:
            self.param_groups = param_groups

    def target_topology(self, source: Topology, changes: dict) -> Topology:
        return replace(source, **changes)  # checked by target_spec, which sees the source's kind

    def _check_topology(self, source: Topology, target: Topology, experts: Experts | None = None) -> None:
        for axis in ("tp", "pp", "vpp") if experts else ("tp", "pp", "ep", "vpp"):
            if getattr(target, axis) != 1:
                raise TopologyError(f"DeepSpeed output with {axis.upper()}{getattr(target, axis)} is "
                                    "not supported yet", hint="Only mp=1 engines without pipeline "
                                    "are written; keep --to-tp 1 --to-pp 1" +
                                    ("" if experts or axis != "ep" else "; EP needs deepspeed.moe experts"))
        if experts is None:
            return
        if target.zero not in (1, 2):
            raise TopologyError(f"DeepSpeed MoE engines are written at ZeRO-1/2, not {target.zero}",
                                hint="Pass --to-zero 1 or 2")
        for prefix, n in experts.num_experts.items():
            if n % target.ep:
                raise TopologyError(f"the {n} experts of {prefix[:-1]} must be divisible by EP "
                                    f"({target.ep})", hint="EP sizes that work: " +
                                    ", ".join(str(e) for e in range(1, n + 1) if n % e == 0 and target.dp % e == 0))

    def target_spec(self, index, source, target, true_vocab_size):
        if self.param_groups is not None and index.layout(FreshState) is None:
            raise UsageError("--param-groups applies to a fresh optimizer state (--init-optimizer "
                             "from an hf source); this output keeps the source's groups")
        layout = self._source = self.engine_layout(index, source, target)
        if layout.bf16_optimizer and target.zero != 1:
            raise TopologyError("BF16_Optimizer checkpoints stay at ZeRO-1", path=index.url)
        if target.zero == 3:
            check_sub_groups(layout, target.dp, index.url)
        return None

    def engine_layout(self, index: CheckpointIndex, source: Topology, target: Topology) -> Layout:
        """The structure of the engine written: the source's (:class:`Layout`), checked."""
        layout = index.layout(Layout)
        self._check_topology(source, target, layout.experts if layout is not None else None)
        if layout is None:
            if index.layout(Stage0Module) is not None:
                raise TopologyError("this stage-0 checkpoint holds no optimizer state: it loads "
                                    "at any DP size as it is", path=index.url)
            raise UsageError(f"DeepSpeed output is written only from a DeepSpeed checkpoint "
                             f"or a Hugging Face model, not from {index.format}", path=index.url)
        if source.zero != target.zero and 0 in (source.zero, target.zero) \
                and layout.model_dtype == torch.float16:
            # FP16_UnfusedOptimizer keeps a scale, its iteration and last overflow; ZeRO's
            # DynamicLossScaler also a hysteresis and a minimum scale: neither maps onto the other
            raise TopologyError("an fp16 engine without ZeRO (FP16_UnfusedOptimizer) is written only "
                                "at stage 0: its dynamic loss scale and ZeRO's do not map onto each "
                                "other exactly", path=index.url,
                                hint="Reshard fp16 stage 0 to another DP size at stage 0, or ZeRO 1-3 "
                                     "among themselves; or convert to hf, dcp or megatron")
        return layout

    def source_schema(self, opened) -> str:
        return NAME

    def plan(self, index: CheckpointIndex, topo: Topology, spec, schema: str,
             with_optimizer: bool = True) -> list[TargetFile]:
        if not with_optimizer and topo.zero:
            raise UsageError("DeepSpeed ZeRO checkpoints keep the fp32 weights in the optimizer "
                             "files, so --drop-optimizer cannot apply", path=index.url,
                             hint="Convert to hf or dcp for the weights alone")
        self._with_optimizer = with_optimizer
        layout = ordered_for(self._source, index.topology, topo)
        experts = layout.experts
        if experts is not None:  # the target's local experts per MoE group and its expert files
            if layout is not self._source:
                raise UsageError("round_robin_gradients with deepspeed.moe experts is not written yet",
                                 path=index.url)
            layout = replace(layout, groups=expert_groups(layout.groups, experts.groups, experts.ep, topo.ep),
                             experts=experts.at(topo.ep))
        self._target = layout
        tag, files = layout.tag, []
        if topo.zero < 3:
            files.append(self._model_file(f"{tag}/mp_rank_00_model_states.pt", index, layout, topo, 0))
        for L, (prefix, entries) in enumerate(experts.layers if experts else ()):
            for e in range(experts.num_experts[prefix]):
                target = TargetFile(f"{tag}/layer_{L}_expert_{e}_mp_rank_00_model_states.pt",
                                    context=ExpertStatesFile())
                for rest, shape, dtype in entries:
                    key = f"{prefix}{e}{rest}"
                    target.tensors.append(TargetTensor(("expert", key), Shard.of(Region.whole(key, shape)), dtype))
                files.append(target)
        if topo.zero == 0:  # stage 0: the model states hold the optimizer too
            return files
        prefix = "bf16_" if layout.bf16_files else ""
        for rank in range(topo.dp):
            if topo.zero == 3:
                files.append(self._model_file(f"{tag}/zero_pp_rank_{rank}_mp_rank_00_model_states.pt",
                                              index, layout, topo, rank))
            files.append(self._optim_file(f"{tag}/{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
                                          index, layout, topo, rank))
        return files

    def _model_file(self, path, index, layout: Layout, topo: Topology, rank: int) -> TargetFile:
        """Model states: ``module`` (full tensors; at ZeRO-3 only buffers) and, from stage 2,
        the frozen parameters (ZeRO-3: this rank's slice). At stage 0 ``optimizer`` is the
        torch optimizer's state dict; an fp32 engine's trainable weights are the fp32 masters,
        a bf16 engine's are in its dtype (a ZeRO-3 source's masters rounded as DeepSpeed
        rounds them) and the masters go with the optimizer (FP16_UnfusedOptimizer)."""
        target = TargetFile(path, context=ModelStatesFile(rank, topo))
        masters = topo.zero == 0 and layout.model_dtype not in (None, torch.float32)
        for name, shape, dtype in layout.module:
            if topo.zero == 3 and name in layout.params or name in layout.shared:
                continue  # an alias is its owner's tensor (model_states_tree)
            key = source_state_key(index, "fp32_param", name) \
                if topo.zero == 0 and name in layout.trainable and not masters else name
            target.tensors.append(TargetTensor(("module", name), Shard.of(
                Region.whole(key, index.tensors[name].shape)),
                dtype if name in layout.trainable else index.tensors[name].dtype))
        if topo.zero == 0 and self._with_optimizer and \
                state_key("exp_avg", next(iter(layout.trainable), "")) in index.tensors:
            for name, shape in (p for group in layout.groups for p in group):
                for kind in MOMENTS + (("fp32_param",) if masters else ()):
                    key = source_state_key(index, kind, name)
                    target.tensors.append(TargetTensor(("optim", name, kind), Shard.of(
                        Region.whole(key, shape)), torch.float32 if kind == "fp32_param"
                        else index.tensors[key].dtype))
        if topo.zero >= 2:
            for name, shape in layout.frozen:
                shard = zero3_partition([(name, shape)], topo.dp, rank) if topo.zero == 3 else \
                    Shard.of(Region.whole(name, shape))
                target.tensors.append(TargetTensor(("frozen", name), shard, index.tensors[name].dtype))
        return target

    def _optim_file(self, path, index, layout: Layout, topo: Topology, rank: int) -> TargetFile:
        """One rank's partition of every group: the two moments and the fp32 masters."""
        target = TargetFile(path, context=OptimStatesFile(rank, topo, []))
        for g, group in enumerate(layout.groups):
            if topo.zero == 3:
                shard, pad, fp32_len = zero3_partition(group, topo.dp, rank), 0, None
            else:
                flat, count, part, _ = rank_group(layout, g, topo.dp, rank)
                shard, pad = zero_partition(flat, count, part, align=layout.align)
                fp32_len = shard.shape[0] - (0 if layout.bf16_optimizer else pad)
            target.context.pads.append(pad)
            for kind in (*MOMENTS, "fp32_param"):
                parts = tuple((o, replace(r, key=source_state_key(index, kind, r.key)))
                              for o, r in shard.parts)
                length = fp32_len if kind == "fp32_param" and fp32_len is not None else shard.shape[0]
                dtype = index.tensors[parts[0][1].key].dtype if parts else torch.float32
                target.tensors.append(TargetTensor((g, kind), Shard((length,), parts), dtype))
        return target

    def write_file(self, store: Store, target: TargetFile, produce, index: CheckpointIndex,
                   true_vocab_size: int | None) -> tuple[int, str]:
        layout = self._target
        ctx = target.context
        pending = {t.name: Pending(t.name, t.shard.shape, t.dtype) for t in target.tensors}
        if isinstance(ctx, ExpertStatesFile):
            return save_target(store, target, {t.name[1]: pending[t.name] for t in target.tensors}, produce)
        tree = model_states_tree(layout, ctx.topo, ctx.rank, pending) if isinstance(ctx, ModelStatesFile) \
            else optim_states_tree(layout, ctx.topo, ctx.rank, ctx.pads, pending)
        return save_target(store, target, tree, produce)

    def bind(self, opened) -> None:
        self._source_store = opened.store

    def finalize(self, store: Store, index: CheckpointIndex) -> list[str]:
        store.write_bytes(LATEST, self._source.tag.encode())
        # config.json beside `latest`, as the HF Trainer lays it out: what names the module's
        # schema (the one a DeepSpeed source carries; an hf source's) goes with it
        config = self.config_json()
        if config is None:
            return [LATEST]
        store.write_bytes(CONFIG, config)
        return [LATEST, CONFIG]

    def config_json(self) -> bytes | None:
        """The ``config.json`` written beside ``latest``: the source's, if it has one."""
        if self._source_store is not None and self._source_store.exists(CONFIG):
            return self._source_store.read_small(CONFIG)
        return None
