"""DeepSpeed checkpoints (plain engines: mp=1, no pipeline, no MoE), read and written.

Pipeline checkpoints (Megatron-DeepSpeed's ``layer_*-model_*-model_states.pt``) are read
by :mod:`converters.deepspeed_pipe`, dispatched from :meth:`DeepSpeedReader.read_index`.

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
  rank, holding that rank's partition of each param group (:func:`zero_partition`,
  :func:`zero3_partition`) for the fp32 masters and the Adam moments, plus the torch
  optimizer's ``step`` and hyperparameters per group.

The global view: every ``module`` entry by its name (aliases are replicas of the owner),
and ``optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.<name>`` for trainable parameters. At
ZeRO-3 the fp32 partitions are the only copy of the weights, so they are the parameters
themselves and there is no separate ``fp32_param`` entry.

What ckptool writes carries a top-level ``ckptool`` entry in its model states (DeepSpeed
hands unknown entries back as client state); without ``ckptool.json`` it is not committed.
"""

from __future__ import annotations

import copy
import json
import math
import re
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

import torch

from ckptool.core import VERSION
from ckptool.core.engine import TargetFile, TargetTensor
from ckptool.core.errors import BadCheckpoint, TopologyError, UnreadableInput, UsageError
from ckptool.core.index import CheckpointIndex, Location, ObjectInfo, Piece, TensorInfo, Writer
from ckptool.core.regions import Region, Shard
from ckptool.core.storage import Store
from ckptool.core.topology import Topology
from ckptool.core.torchfile import Pending, TensorRef
from ckptool.core.torchreader import TorchFileReader, save_target
from converters.deepspeed_pipe import PIPELINE_KEY, PipelineWriter, is_pipeline, read_pipeline
from converters.megatron_optimizer import FRESH_STEP, state_key
from converters.megatron_optimizer import groups as megatron_groups
from converters.megatron_optimizer import no_decay

NAME = "deepspeed"
LATEST = "latest"
MODEL_STATES_SUFFIX = "_model_states.pt"
LAYOUT_KEY = "deepspeed.layout"
MARK = "ckptool"
MOMENTS = ("exp_avg", "exp_avg_sq")
_MP_STATES = re.compile(r"^mp_rank_(\d{2})_model_states\.pt$")
_ZERO_STATES = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d{2})_model_states\.pt$")
_OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d{2})_?optim_states\.pt$")
_STEP_DIR = re.compile(r"^global_step(\d+)$")
_PER_RANK = ("base_optimizer_state", "optimizer_state_dict", "single_partition_of_fp32_groups",
             "fp32_flat_groups", "group_paddings", "partition_count", "param_slice_mappings")
"""Optimizer-file entries that depend on the DP rank; the others are carried as they are."""
_ZERO12_ONLY = ("clip_grad", "param_alignment_paddings", "ds_version")
"""``optimizer_state_dict`` entries of ZeRO-1/2 files that ZeRO-3 files lack (DeepSpeed
0.19.8); derived when writing 1/2 from 3, dropped when writing 3 from 1/2."""

Group = list[tuple[str, tuple[int, ...]]]


# ------------------------------------------------------------------- the layout rules


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

    @property
    def trainable(self) -> set[str]:
        return {name for group in self.groups for name, _ in group}

    @property
    def params(self) -> set[str]:
        """Every parameter name of ``module`` (trainable, frozen, aliases): not buffers."""
        return self.trainable | {name for name, _ in self.frozen} | set(self.shared)


# ------------------------------------------------------------------------- reading


def _has_model_states(store: Store, rel: str = "") -> bool:
    return any(not d and n.endswith(MODEL_STATES_SUFFIX) for n, d in store.ls(rel))


def _tag(store: Store) -> str:
    """The directory (relative) that holds the files: the store itself, ``latest``'s tag, or
    the newest ``global_step*``."""
    if _has_model_states(store):
        return ""
    if store.exists(LATEST) and not store.isdir(LATEST):
        tag = store.read_bytes(LATEST).decode(errors="replace").strip()
        if tag and "/" not in tag and store.isdir(tag):
            return tag
    steps = sorted((int(m.group(1)), n) for n, d in store.ls() if d and (m := _STEP_DIR.match(n)))
    if steps:
        return steps[-1][1]
    raise UnreadableInput("no DeepSpeed model-states files found", path=store.url)


def _resolve(obj: Any, path: tuple) -> Any:
    for step in path:
        obj = obj[step]
    return obj


def _ranks(found: dict[int, str], dp: int, what: str, where: str) -> list[str]:
    if sorted(found) != list(range(dp)):
        raise BadCheckpoint(f"{what} files are for DP ranks {sorted(found)}, dp_world_size is {dp}",
                            path=where)
    return [found[r] for r in range(dp)]


class DeepSpeedReader(TorchFileReader):
    name = NAME
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
        from converters.hf import CONFIG, named_view

        if PIPELINE_KEY in index.objects:
            return None
        if self.model_config:
            where = self.model_config
            try:
                with open(where, "rb") as f:
                    raw = f.read()
            except OSError as exc:
                raise UnreadableInput(f"cannot read the model config ({exc.strerror})",
                                      path=where) from None
        elif store.exists(CONFIG):
            where, raw = store.display(CONFIG), store.read_bytes(CONFIG)
        else:
            return None
        try:
            config = json.loads(raw)
        except ValueError:
            raise UnreadableInput("the model config is not valid JSON", path=where) from None
        if not isinstance(config, dict):
            raise UnreadableInput("the model config is not a JSON object", path=where)
        kinds = ("fp32_param", *MOMENTS)
        return named_view(index, config, self.model_family, where,
                          ("", *(state_key(kind, "") for kind in kinds)))

    @classmethod
    def detect(cls, store: Store) -> bool:
        if store.isdir("zero"):
            return False  # universal
        if _has_model_states(store):
            return True
        if store.exists(LATEST) and not store.isdir(LATEST):
            tag = store.read_bytes(LATEST).decode(errors="replace").strip()
            return bool(tag) and "/" not in tag and _has_model_states(store, tag) \
                and not store.isdir(f"{tag}/zero")
        return False

    def read_index(self, store: Store) -> CheckpointIndex:
        tag = _tag(store)
        where = store.display(tag)
        join = (lambda n: f"{tag}/{n}") if tag else (lambda n: n)
        names = [n for n, d in store.ls(tag) if not d]
        if is_pipeline(names):  # Megatron-DeepSpeed's layer files: canonical names already
            return read_pipeline(self, store, tag, names)
        zero3 = {int(m.group(1)): join(n) for n in names if (m := _ZERO_STATES.match(n))}
        optim = {int(m.group(2)): join(n) for n in names if (m := _OPTIM.match(n))}
        mp_ranks = {m.group(m.re.groups) for n in names
                    if (m := _MP_STATES.match(n) or _ZERO_STATES.match(n) or _OPTIM.match(n))}
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
            optim_rels = _ranks(optim, dp, "optimizer", where)
            osd = self._load(store, optim_rels[0]).obj.get("optimizer_state_dict")
            if not isinstance(osd, dict):
                raise BadCheckpoint("optimizer file has no optimizer_state_dict",
                                    path=store.display(optim_rels[0]))
        stage = 3 if zero3 else _stage(osd, ms)
        if osd is not None:
            _check_version(osd.get("ds_version") or ms.get("ds_version"), stage, where)
        index = CheckpointIndex(format=NAME, url=store.url, topology=Topology(dp=dp, zero=stage),
                                iteration=_int(ms.get("global_steps")),
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
            return index
        model_rels = _ranks(zero3, dp, "ZeRO-3 model-states", where) if zero3 else [first]
        layout = self._layout(store, tag, stage, first, optim, osd)
        index.objects[LAYOUT_KEY] = ObjectInfo(LAYOUT_KEY, value=layout)
        index.objects["optimizer.step"] = ObjectInfo("optimizer.step", value=layout.steps)
        index.objects["optimizer.param_groups"] = ObjectInfo("optimizer.param_groups", value=layout.hyper)
        if stage < 3:
            self._read_module(store, index, first, ms, layout.shared)
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
        groups = [[(n, tuple(s)) for n, s in g.items()] for g in ms.get("param_shapes") or []]
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
            tag=tag or "global_step%d" % (_int(ms.get("global_steps")) or 0), stage=stage,
            bf16_files=optim[0].rsplit("/", 1)[-1].startswith("bf16_"),
            bf16_optimizer="zero_stage" not in osd, groups=groups, frozen=frozen, shared=shared,
            module=[(n, tuple(v.shape), v.dtype) for n, v in module.items()],
            model_states=self._load(store, first).materialize(model_states),
            optim_file={k: (None if k == "optimizer_state_dict" else archive.materialize(v))
                        for k, v in archive.obj.items()},
            osd={k: archive.materialize(v) for k, v in osd.items() if k not in _PER_RANK},
            hyper=[{k: v for k, v in g.items() if k != "params"} for g in base["param_groups"]],
            steps=[archive.materialize(base["state"][g].get("step")) for g in range(len(groups))],
            fragment_type=type(fragments[0]) if fragments else None, align=align)

    def _read_stage0_optimizer(self, store, index, tag, rel, ms, aliases) -> None:
        """A stage-0 engine's optimizer: the client's torch optimizer state dict, which numbers
        parameters by position across its param groups. Mapped to names by :func:`stage0_groups`;
        the fp32 weights are the module's (no separate masters), as at ZeRO-3."""
        archive = self._load(store, rel)
        mapped = stage0_groups(ms, aliases)
        if isinstance(mapped, str):
            index.unmapped = f"DeepSpeed stage-0 optimizer state: {mapped}"
            return
        groups, order, frozen = mapped
        osd = ms["optimizer"]
        steps = []
        for g, group in enumerate(groups):
            values = {repr(archive.materialize(osd["state"][order[n]].get("step"))) for n, _ in group}
            if len(values) > 1:
                index.unmapped = f"DeepSpeed stage-0 optimizer state: steps differ within param group {g}"
                return
            steps.append(archive.materialize(osd["state"][order[group[0][0]]].get("step")) if group else 0)
        module = ms["module"]
        layout = Layout(
            tag=tag or "global_step%d" % (_int(ms.get("global_steps")) or 0), stage=0,
            bf16_files=False, bf16_optimizer=False, groups=groups, frozen=frozen, shared=aliases,
            module=[(n, tuple(v.shape), v.dtype) for n, v in module.items()],
            model_states=archive.materialize({k: v for k, v in ms.items()
                                              if k not in ("module", "optimizer")}),
            optim_file={"ds_version": ms.get("ds_version")},
            osd={"loss_scaler": _loss_scaler(), "dynamic_loss_scale": False, "overflow": False,
                 "zero_stage": 0, "ds_version": ms.get("ds_version")},
            hyper=[{k: archive.materialize(v) for k, v in pg.items() if k != "params"}
                   for pg in osd["param_groups"]], steps=steps)
        index.objects[LAYOUT_KEY] = ObjectInfo(LAYOUT_KEY, value=layout)
        index.objects["optimizer.step"] = ObjectInfo("optimizer.step", value=steps)
        index.objects["optimizer.param_groups"] = ObjectInfo("optimizer.param_groups", value=layout.hyper)
        for name, shape in (p for group in groups for p in group):
            for kind in MOMENTS:
                ref = osd["state"][order[name]].get(kind)
                if not isinstance(ref, TensorRef) or tuple(ref.shape) != shape:
                    raise BadCheckpoint(f"{kind} of {name} is not a tensor of its shape {list(shape)}",
                                        path=store.display(rel))
                key = state_key(kind, name)
                _add(index, key, ref, Region.whole(key, shape), rel,
                     ("optimizer", "state", order[name], kind), 0)

    def _read_module(self, store, index, rel, ms, shared) -> None:
        """Stages 0-2: every ``module`` entry is a full tensor; aliases (and stage 2's frozen
        fragments) are replicas."""
        for name, ref in ms["module"].items():
            owner = shared.get(name)
            _add(index, owner or name, ref, Region.whole(owner or name, ref.shape), rel,
                 ("module", name), 0, replica=owner is not None)
        for name, ref in (ms.get("frozen_param_fragments") or {}).items():
            _add(index, name, ref, Region.whole(name, ref.shape), rel,
                 ("frozen_param_fragments", name), 0, replica=True)

    def _read_zero3_model_states(self, store, index, rels, layout) -> None:
        """ZeRO-3: buffers are full in every rank's ``module`` (rank 0's is primary); frozen
        parameters are cut across ranks' ``frozen_param_fragments``."""
        for rank, rel in enumerate(rels):
            ms = self._load(store, rel).obj
            for name, ref in ms["module"].items():
                if name not in layout.params:
                    _add(index, name, ref, Region.whole(name, ref.shape), rel, ("module", name), 0,
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
                    _add(index, name, ref, region, rel, ("frozen_param_fragments", name), offset)

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
                shard, pad = zero_partition(group, dp, rank, align=layout.align)
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
                    _add(index, key, ref, replace(region, key=key), rel, path, offset)


def _add(index: CheckpointIndex, key: str, ref: TensorRef, region: Region, rel: str, path: tuple,
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
    osd = ms.get("optimizer")
    if not isinstance(osd, dict) or not isinstance(osd.get("state"), dict) or \
            not isinstance(osd.get("param_groups"), list):
        return "not a torch optimizer state dict (fp16's FP16_Optimizer is not read yet)"
    buffers = set(ms.get("buffer_names") or ())
    candidates = [(n, tuple(v.shape)) for n, v in ms["module"].items()
                  if n not in buffers and n not in aliases]
    stored = []
    for g, pg in enumerate(osd["param_groups"]):
        shapes = []
        for i in pg.get("params") or ():
            ref = (osd["state"].get(i) or {}).get("exp_avg")
            if not isinstance(ref, TensorRef):
                return f"parameter {i} of param group {g} has no Adam state (saved before the first step?)"
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
    """Positions in ``pool`` where ``want`` occurs as a subsequence, if exactly one way."""
    n, m = len(want), len(pool)
    # ways[i][j]: embeddings of want[i:] into pool[j:] (capped at 2)
    ways = [[0] * (m + 1) for _ in range(n + 1)]
    for j in range(m + 1):
        ways[n][j] = 1
    for i in range(n - 1, -1, -1):
        for j in range(m - 1, -1, -1):
            ways[i][j] = min(2, ways[i][j + 1] + (ways[i + 1][j + 1] if want[i] == pool[j] else 0))
    if ways[0][0] != 1:
        return None
    picked, j = [], 0
    for i in range(n):
        while not (want[i] == pool[j] and ways[i + 1][j + 1] == 1 and ways[i][j + 1] == 0):
            j += 1
        picked.append(j)
        j += 1
    return picked


def _loss_scaler():
    """DeepSpeed's static ``LossScaler(scale=1)`` of an fp32 engine, which ZeRO-3 files carry
    (never imported: pickled under its name)."""
    from ckptool.core.torchfile import _opaque_class

    cls = _opaque_class("deepspeed.runtime.fp16.loss_scaler", "LossScaler")
    scaler = cls.__new__(cls)
    scaler.__setstate__({"cur_scale": 1.0, "dynamic": False})
    return scaler


def _aliases(module: dict) -> dict[str, str]:
    """Tied entries of a state dict that records no ``shared_params`` (stage 0): torch.save
    stores a tied tensor once, so later names of the same tensor are aliases of the first."""
    first: dict[TensorRef, str] = {}
    return {name: first.setdefault(ref, name) for name, ref in module.items()
            if first.setdefault(ref, name) != name}


def _stage(osd: dict | None, ms: dict) -> int:
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


def _int(value) -> int | None:
    return int(value) if isinstance(value, int) else None


# ------------------------------------------------------------------------- writing


class DeepSpeedWriter(Writer):
    """Writes a DeepSpeed run root (``latest`` + ``<tag>/``) from a DeepSpeed ZeRO source at
    a new DP size and any ZeRO stage 1-3 (stages 1 and 2 have files of the same shape; from
    or to 3, the fp32 masters are the weights and ZeRO-3's ``module`` keeps only buffers).
    Every rank's partitions are laid out by the rules above; the non-tensor entries are the
    source's, with ``dp_world_size``, the stage and the partition bookkeeping rewritten.
    A pipeline source (layer files) is written by :class:`~converters.deepspeed_pipe.PipelineWriter`
    at any TP/PP/DP; the topology is checked once the source's kind is known (``target_spec``)."""

    name = NAME
    canonical_source = False  # an hf source keeps its names: they are the engine module's
    fresh_optimizer = True
    pipeline: PipelineWriter | None = None
    """Set for a pipeline source: it writes the output (:mod:`converters.deepspeed_pipe`)."""
    param_groups: str = "decay"
    """hf source: ``decay`` (weight decay / none for biases and 1-D parameters, as the HF
    Trainer and Megatron group them) or ``single`` (DeepSpeed's own optimizer from its config)."""
    _source: Layout | None = None

    def configure(self, *, param_groups: str | None = None, **unknown) -> None:
        super().configure(**unknown)
        if param_groups is not None:
            self.param_groups = param_groups

    def target_topology(self, source: Topology, changes: dict) -> Topology:
        return replace(source, **changes)  # checked by target_spec, which sees the source's kind

    def _check_topology(self, source: Topology, target: Topology) -> None:
        for axis in ("tp", "pp", "ep", "vpp"):
            if getattr(target, axis) != 1:
                raise TopologyError(f"DeepSpeed output with {axis.upper()}{getattr(target, axis)} is "
                                    "not supported yet", hint="Only mp=1 engines without pipeline "
                                    "are written; keep --to-tp 1 --to-pp 1")

    def target_spec(self, index, source, target, true_vocab_size):
        if PIPELINE_KEY in index.objects:
            self.pipeline = PipelineWriter()
            return self.pipeline.target_spec(index, source, target, true_vocab_size)
        if index.format == "hf":
            self._source = _hf_layout(index, target, self.param_groups)
        else:
            self._check_topology(source, target)
            if LAYOUT_KEY not in index.objects:
                if index.format == NAME and source.zero == 0:
                    raise TopologyError("this stage-0 checkpoint holds no optimizer state: it loads "
                                        "at any DP size as it is", path=index.url)
                raise UsageError(f"DeepSpeed output is written only from a DeepSpeed checkpoint "
                                 f"or a Hugging Face model, not from {index.format}", path=index.url)
            self._source = index.objects[LAYOUT_KEY].value
        layout = self._source
        if target.zero == 0 and index.format != "hf" and (layout.bf16_files or layout.bf16_optimizer or any(
                d != torch.float32 for n, _, d in layout.module if n in layout.trainable)):
            raise TopologyError("a bf16 or fp16 engine without ZeRO keeps its state in "
                                "BF16_Optimizer/FP16_Optimizer files; stage-0 output is written for "
                                "fp32 engines only", path=index.url, hint="Keep --to-zero 1 or more")
        if layout.bf16_optimizer and target.zero != 1:
            raise TopologyError("BF16_Optimizer checkpoints stay at ZeRO-1", path=index.url)
        if target.zero == 3:
            _check_sub_groups(layout, target.dp, index.url)
        return None

    def notes(self, index: CheckpointIndex) -> list[str]:
        if self.pipeline is not None or index.format != "hf":
            return []
        if FRESH_STEP not in index.objects:
            return ["model weights only (no optimizer state was asked for): load with "
                    "engine.load_checkpoint(DST, load_module_only=True) into a ZeRO-0/1/2 engine "
                    "at any DP size; --init-optimizer --zero S --dp N writes ZeRO files (ZeRO-3 "
                    "needs them)"]
        groups = "one param group" if self.param_groups == "single" else \
            "two param groups (decay; no decay for biases and 1-D parameters)"
        return [f"fresh optimizer state (fp32 masters = the weights, zero Adam moments, step 0) "
                f"in {groups}, in the model's parameter order: load with engine.load_checkpoint("
                "DST, load_optimizer_states=False, load_lr_scheduler_states=False), so that your "
                "config's hyperparameters and scheduler apply (the files carry none)"]

    def source_schema(self, opened) -> str:
        return NAME

    def plan(self, index: CheckpointIndex, topo: Topology, spec, schema: str,
             with_optimizer: bool = True) -> list[TargetFile]:
        if self.pipeline is not None:
            return self.pipeline.plan(index, topo, with_optimizer)
        if not with_optimizer and topo.zero:
            raise UsageError("DeepSpeed ZeRO checkpoints keep the fp32 weights in the optimizer "
                             "files, so --drop-optimizer cannot apply", path=index.url,
                             hint="Convert to hf or dcp for the weights alone")
        self._with_optimizer = with_optimizer
        layout = self._target = _ordered_for(self._source, index.topology, topo)
        tag, files = layout.tag, []
        if topo.zero < 3:
            files.append(self._model_file(f"{tag}/mp_rank_00_model_states.pt", index, layout, topo, 0))
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
        the frozen parameters (ZeRO-3: this rank's slice). At stage 0 the trainable weights
        are the fp32 masters and ``optimizer`` is the torch optimizer's state dict."""
        target = TargetFile(path, context={"kind": "model", "rank": rank, "topo": topo})
        for name, shape, dtype in layout.module:
            if topo.zero == 3 and name in layout.params or name in layout.shared:
                continue  # an alias is its owner's tensor (_model_states)
            key = _state_key(index, "fp32_param", name) if topo.zero == 0 and name in layout.trainable \
                else name
            target.tensors.append(TargetTensor(("module", name), Shard.of(
                Region.whole(key, index.tensors[name].shape)), index.tensors[name].dtype))
        if topo.zero == 0 and self._with_optimizer and \
                state_key("exp_avg", next(iter(layout.trainable), "")) in index.tensors:
            for name, shape in (p for group in layout.groups for p in group):
                for kind in MOMENTS:
                    key = state_key(kind, name)
                    target.tensors.append(TargetTensor(("optim", name, kind), Shard.of(
                        Region.whole(key, shape)), index.tensors[key].dtype))
        if topo.zero >= 2:
            for name, shape in layout.frozen:
                shard = zero3_partition([(name, shape)], topo.dp, rank) if topo.zero == 3 else \
                    Shard.of(Region.whole(name, shape))
                target.tensors.append(TargetTensor(("frozen", name), shard, index.tensors[name].dtype))
        return target

    def _optim_file(self, path, index, layout: Layout, topo: Topology, rank: int) -> TargetFile:
        """One rank's partition of every group: the two moments and the fp32 masters."""
        target = TargetFile(path, context={"kind": "optim", "rank": rank, "topo": topo, "pads": []})
        for g, group in enumerate(layout.groups):
            if topo.zero == 3:
                shard, pad, fp32_len = zero3_partition(group, topo.dp, rank), 0, None
            else:
                shard, pad = zero_partition(group, topo.dp, rank, align=layout.align)
                fp32_len = shard.shape[0] - (0 if layout.bf16_optimizer else pad)
            target.context["pads"].append(pad)
            for kind in (*MOMENTS, "fp32_param"):
                parts = tuple((o, replace(r, key=_state_key(index, kind, r.key))) for o, r in shard.parts)
                length = fp32_len if kind == "fp32_param" and fp32_len is not None else shard.shape[0]
                dtype = index.tensors[parts[0][1].key].dtype if parts else torch.float32
                target.tensors.append(TargetTensor((g, kind), Shard((length,), parts), dtype))
        return target

    def write_file(self, store: Store, target: TargetFile, produce, index: CheckpointIndex,
                   true_vocab_size: int | None) -> tuple[int, str]:
        if self.pipeline is not None:
            return self.pipeline.write_file(store, target, produce, index, true_vocab_size)
        layout = self._target
        ctx = target.context
        pending = {t.name: Pending(t.name, t.shard.shape, t.dtype) for t in target.tensors}
        tree = _model_states(layout, ctx["topo"], ctx["rank"], pending) if ctx["kind"] == "model" \
            else _optim_states(layout, ctx["topo"], ctx["rank"], ctx["pads"], pending)
        return save_target(store, target, tree, produce)

    def finalize(self, store: Store, index: CheckpointIndex) -> list[str]:
        if self.pipeline is not None:
            return self.pipeline.finalize(store, index)
        store.write_bytes(LATEST, self._source.tag.encode())
        if index.format != "hf":
            return [LATEST]
        from converters.hf import CONFIG, CONFIG_KEY

        # beside `latest`, as the HF Trainer lays it out: the reader finds the model's schema
        store.write_bytes(CONFIG, json.dumps(index.objects[CONFIG_KEY].value, indent=2).encode())
        return [LATEST, CONFIG]


def _state_key(index: CheckpointIndex, kind: str, name: str) -> str:
    """The global tensor an optimizer vector comes from; a ZeRO-3 source has no separate
    ``fp32_param``: its weights are the masters."""
    key = state_key(kind, name)
    return key if kind != "fp32_param" or key in index.tensors else name


def _ordered_for(layout: Layout, source: Topology, target: Topology) -> Layout:
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


def _check_sub_groups(layout: Layout, dp: int, where: str) -> None:
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


def _config(layout: Layout, topo: Topology) -> dict:
    """The source's ds_config with the target's stage and per-GPU micro batch (DeepSpeed
    stores it and does not read it on load)."""
    config = copy.deepcopy(layout.model_states.get("ds_config") or {})
    if isinstance(config.get("zero_optimization"), dict):
        config["zero_optimization"]["stage"] = topo.zero
    batch, gas = config.get("train_batch_size"), config.get("gradient_accumulation_steps") or 1
    if isinstance(batch, int) and batch % (topo.dp * gas) == 0 and "train_micro_batch_size_per_gpu" in config:
        config["train_micro_batch_size_per_gpu"] = batch // (topo.dp * gas)
    return config


def _model_states(layout: Layout, topo: Topology, rank: int, pending: dict) -> dict:
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
        tree["ds_config"] = _config(layout, topo)
    tree[MARK] = {"version": VERSION}
    return tree


def _torch_optimizer(layout: Layout, pending: dict) -> dict | None:
    """A stage-0 engine's ``optimizer``: the torch state dict, parameters numbered across the
    groups in order (the rule :func:`stage0_groups` reads back); each its own step tensor
    (torch's Adam increments them in place)."""
    params = [name for group in layout.groups for name, _ in group]
    if not params or ("optim", params[0], MOMENTS[0]) not in pending:
        return None
    state, groups, i = {}, [], 0
    for g, group in enumerate(layout.groups):
        step = layout.steps[g]
        groups.append(dict(layout.hyper[g], params=list(range(i, i + len(group)))))
        for name, _ in group:
            state[i] = {"step": step.clone() if isinstance(step, torch.Tensor) else step,
                        **{kind: pending[("optim", name, kind)] for kind in MOMENTS}}
            i += 1
    return {"state": state, "param_groups": groups}


def _optim_states(layout: Layout, topo: Topology, rank: int, pads: list[int], pending: dict) -> dict:
    """One rank's optimizer file: the source's entries, the per-rank ones rewritten."""
    groups = range(len(layout.groups))
    state = {"state": {g: {"step": layout.steps[g],
                           **{k: pending[(g, k)] for k in MOMENTS}} for g in groups},
             "param_groups": [dict(h, params=[g]) for g, h in zip(groups, layout.hyper)]}
    masters = [pending[(g, "fp32_param")] for g in groups]
    osd = dict(layout.osd)
    if "zero_stage" in osd and topo.zero != layout.stage:
        osd["zero_stage"] = type(osd["zero_stage"])(topo.zero)
    if topo.zero == 3:
        for key in _ZERO12_ONLY:
            osd.pop(key, None)
    elif layout.stage == 3:  # the ZeRO-1/2 entries, as DeepSpeed writes them
        config = layout.model_states.get("ds_config") or {}
        osd.update(clip_grad=float(config.get("gradient_clipping", 0.0)),
                   ds_version=layout.model_states.get("ds_version"))
    if topo.zero < 3 and (layout.stage == 3 or "param_alignment_paddings" in osd):
        osd["param_alignment_paddings"] = [alignment_paddings(g, layout.align) for g in layout.groups]
    if topo.zero == 3:
        osd.update(optimizer_state_dict=state, fp32_flat_groups=masters, partition_count=topo.dp)
    else:
        last = rank == topo.dp - 1
        osd.update(base_optimizer_state=state, single_partition_of_fp32_groups=masters,
                   partition_count=[topo.dp] * len(groups),
                   group_paddings=[(pending[(g, "exp_avg")].shape[0] * topo.dp
                                    - sum(math.prod(s) for _, s in layout.groups[g])) * last
                                   for g in groups] if layout.bf16_optimizer else list(pads))
        if layout.fragment_type is not None:
            osd["param_slice_mappings"] = [_fragments(layout.fragment_type, group, topo.dp, rank,
                                                      layout.align) for group in layout.groups]
    tree = dict(layout.optim_file)
    tree["optimizer_state_dict"] = osd
    if "ds_config" in tree:
        tree["ds_config"] = _config(layout, topo)
    return tree


FRESH_DS_VERSION = "0.16.0"
"""``ds_version`` of files written for an hf source: any version from 0.3.17 (ZeRO-1's
layout change) reads the layout written here; DeepSpeed refuses an empty one."""


def _hf_layout(index: CheckpointIndex, target: Topology, param_groups: str) -> Layout:
    """The structure of the engine a Hugging Face model becomes: its parameters in
    ``named_parameters()`` order (the hf reader's native index), tied aliases sharing their
    owner's tensor, no buffers, in ``param_groups`` (``decay``: Megatron's and the HF
    Trainer's split, weight decay off for biases and 1-D parameters; ``single``)."""
    from converters.hf import FAMILY_KEY, CONFIG_KEY, spec_from_config, tied_aliases

    for axis in ("tp", "pp", "ep", "vpp"):
        if getattr(target, axis) != 1:
            raise TopologyError(f"DeepSpeed output with {axis.upper()}{getattr(target, axis)} is not "
                                "supported from a Hugging Face model", hint="Keep --tp 1 --pp 1")
    fresh = FRESH_STEP in index.objects
    if target.zero and not fresh:
        raise UsageError(f"a ZeRO-{target.zero} DeepSpeed checkpoint holds optimizer state, and a "
                         "Hugging Face model has none", path=index.url,
                         hint="Pass --init-optimizer for a fresh state, or leave out --zero: the "
                              "model states alone load with load_checkpoint(..., load_module_only=True)")
    if fresh and not target.zero:
        raise UsageError("--init-optimizer writes ZeRO optimizer files: give --zero 1, 2 or 3",
                         path=index.url)
    family = index.objects[FAMILY_KEY].value
    spec = spec_from_config(index.objects[CONFIG_KEY].value, family)
    params = [(k, tuple(t.shape), t.dtype) for k, t in index.tensors.items()
              if not k.startswith("optimizer.")]
    aliases = tied_aliases(spec, family)
    owners = {name: (shape, dtype) for name, shape, dtype in params}
    module = params + [(alias, *owners[owner]) for alias, owner in aliases.items()]
    if param_groups == "single":
        groups = [[(n, s) for n, s, _ in params]]
    else:
        groups = [g for g in megatron_groups([(n, len(s)) for n, s, _ in params]) if g]
        groups = [[(n, owners[n][0]) for n in g] for g in groups]
    dtypes = {d for _, _, d in params}
    bf16 = dtypes == {torch.bfloat16}
    return Layout(
        tag="global_step0", stage=target.zero, bf16_files=bf16, bf16_optimizer=False,
        groups=groups, frozen=[], shared=aliases, module=module,
        model_states=dict(buffer_names=[], optimizer=None, lr_scheduler=None, data_sampler=None,
                          random_ltd=None, skipped_steps=0, global_steps=0, global_samples=0,
                          mp_world_size=1, ds_version=FRESH_DS_VERSION),
        optim_file={"ds_version": FRESH_DS_VERSION},
        osd={"dynamic_loss_scale": False, "overflow": False, "zero_stage": target.zero,
             "ds_version": FRESH_DS_VERSION},
        hyper=[{} for _ in groups], steps=[torch.tensor(0.0) for _ in groups])


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
