"""Legacy Megatron-LM checkpoints: ``iter_{:07d}/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt``.

A run root has ``latest_checkpointed_iteration.txt`` (an iteration number or ``release``)
beside the ``iter_*``/``release`` directories. At PP=1 the rank directories have no
``_PPP`` part. Each file holds ``args`` (an argparse Namespace: the model and the
topology), ``iteration``, ``checkpoint_version``, ``model`` (or ``model0``, ``model1``...
per virtual pipeline chunk), ``optimizer``, ``opt_param_scheduler`` and ``rng_state``.

Tensor names follow one of three schemas (see :mod:`converters.schemas.megatron`):
Megatron-Core with Transformer Engine, Megatron-Core local spec, or pre-mcore legacy
(Megatron-DeepSpeed). Each rank's layers are numbered from 0; the global index and every
split come from the layout rules in :mod:`ckptool.core.layout`.

What ckptool writes carries a top-level ``ckptool`` key (Megatron ignores unknown keys);
without the run root's ``ckptool.json`` such a checkpoint is not committed.
"""

from __future__ import annotations

import argparse
import copy
import math
import re
from dataclasses import asdict, dataclass, replace
from typing import Any

from ckptool.core import VERSION
from ckptool.core import optimizer as canon
from ckptool.core.engine import TargetFile, TargetTensor
from ckptool.core.errors import BadCheckpoint, UnreadableInput, UsageError
from ckptool.core.index import CheckpointIndex, ObjectInfo, Writer
from ckptool.core.layout import ModelSpec, expert_of, expert_tp_rank, local_experts, stage_layers
from ckptool.core.lazy import lazy
from ckptool.core.regions import Shard
from ckptool.core.storage import Store
from ckptool.core.topology import Topology
from ckptool.core.torchfile import Pending
from ckptool.core.torchreader import TorchFileReader, save_target
from converters.megatron import distopt
from converters.megatron.common import adopt_dcp_common
from converters.megatron import optimizer as optim
from converters.schemas.megatron import (
    ITER_DIR,
    SCHEMAS,
    TRACKER,
    detect_schema,
    iteration_dir,
    parameter_order,
    params_by_key,
    to_canonical,
    tracked_dir,
)
from converters.schemas.megatron_args import (
    UnevenStages,
    feature_notes,
    ignored_by_legacy,
    megatron_deepspeed,
    refuse_unapplied_by_legacy,
    refuse_unrunnable_gelu,
    source_dtype,
    spec_from_args,
    update_args,
)
from converters.schemas.megatron_ranks import add_piece as _add_piece
from converters.schemas.megatron_ranks import check_legacy_schema as _check_schema

torch = lazy("torch", globals())

EXTRA = "_extra_state"
MODEL_PATH = "@model"
EXTRA_STATE_MODULES = ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1",
                       "mlp.linear_fc2")
"""Megatron-Core modules that carry an ``_extra_state`` entry (the linears)."""
OPTIM_PATH = "@optim"
DISTOPT_PATH = "@distopt"
DISTRIB_OPTIM = "distrib_optim.pt"
_LAYER_MODULE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT_MODULE = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts)\.local_experts\.(\d+)\.(.+)$")

NAME = "megatron"
FILE = "model_optim_rng.pt"
RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
MARK = "ckptool"
CARRIED = ("iteration", "checkpoint_version", "opt_param_scheduler",
           "num_floating_point_operations_so_far")


def rank_dir(tp_rank: int, pp_rank: int, pp: int, ep_rank: int = 0, ep: int = 1) -> str:
    """Megatron-LM's ``mp_rank_TT`` + ``_PPP`` when PP > 1 + ``_EEE`` when EP > 1."""
    return f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "") + \
        (f"_{ep_rank:03d}" if ep > 1 else "")


def _has_rank_dirs(store: Store, rel: str = "") -> bool:
    return any(d and RANK_DIR.match(n) for n, d in store.ls(rel))


def checkpoint_dir(store: Store) -> str:
    """The iteration directory (relative) that holds the rank directories."""
    if _has_rank_dirs(store):
        return ""
    tracked = tracked_dir(store)
    if tracked is not None:
        return tracked
    iters = sorted(n for n, d in store.ls() if d and ITER_DIR.match(n))
    if iters:
        return iters[-1]
    raise UnreadableInput("no Megatron rank directories found", path=store.url)


@dataclass(frozen=True)
class Names:
    """The layout record of a legacy Megatron source: the tensor-name schema of its rank
    files (``mcore-local``, ``mcore-te``, ``legacy``)."""

    schema: str


def _unmappable(index: CheckpointIndex, reason: str) -> None:
    """Record why the source's optimizer state cannot be carried (the first reason found)."""
    if index.unmapped is None:
        index.unmapped = reason


@dataclass
class _RankFile:
    tp: int
    pp: int
    rel: str
    ep: int = 0
    rest: tuple = ()
    """The directory name's numbers after TP: ``(pp)``, ``(ep)`` or ``(pp, ep)``, which only
    the args tell apart (:meth:`placed`)."""

    def placed(self, topo: Topology) -> "_RankFile":
        numbers = list(self.rest)
        ep = numbers.pop() if topo.ep > 1 and numbers else 0
        pp = numbers.pop() if topo.pp > 1 and numbers else 0
        return _RankFile(self.tp, pp, self.rel, ep, self.rest)


class MegatronReader(TorchFileReader):
    name = NAME

    @classmethod
    def detect(cls, store: Store) -> bool:
        if _has_rank_dirs(store):
            return True
        tracked = tracked_dir(store)
        if tracked is not None:
            return _has_rank_dirs(store, tracked)
        iters = [n for n, d in store.ls() if d and ITER_DIR.match(n)]
        return bool(iters) and _has_rank_dirs(store, sorted(iters)[-1])

    def accepts_non_dict(self, rel: str) -> bool:
        return rel.endswith(DISTRIB_OPTIM)  # the expert-parallel form is a list (refused later)

    def _rank_files(self, store: Store) -> list[_RankFile]:
        base = checkpoint_dir(store)
        files = []
        for name, is_dir in store.ls(base):
            m = RANK_DIR.match(name) if is_dir else None
            if not m:
                continue
            rel = f"{base}/{name}/{FILE}" if base else f"{name}/{FILE}"
            rest = tuple(int(g) for g in m.groups()[1:] if g is not None)
            files.append(_RankFile(int(m.group(1)), rest[0] if rest else 0, rel, rest=rest))
        if not files:
            raise BadCheckpoint("no rank directories", path=store.display(base))
        return sorted(files, key=lambda f: (f.pp, f.tp))

    def read_index(self, store: Store) -> CheckpointIndex:
        files = self._rank_files(store)
        first = self._load(store, files[0].rel).obj
        args = first.get("args")
        if not isinstance(args, argparse.Namespace):
            raise BadCheckpoint("rank file has no Megatron `args`", path=store.display(files[0].rel),
                                hint="ckptool needs args to know the model layout")
        code = _model_code(first)
        spec, topo, vocab_known = spec_from_args(args, model=code)
        files = sorted((f.placed(topo) for f in files), key=lambda f: (f.pp, f.ep, f.tp))
        primaries = _primaries(files, topo, store)
        version = first.get("checkpoint_version")
        index = CheckpointIndex(format=self.name, url=store.url, topology=topo,
                                model_config=asdict(spec),
                                true_vocab_size=spec.vocab_size if vocab_known else None,
                                iteration=_iteration(first), written_by_ckptool=MARK in first,
                                format_version=None if version is None else str(version))
        index.objects["args"] = ObjectInfo("args", value=args)
        if code == "legacy":
            index.contradicts = ignored_by_legacy(args, spec)
        archive0 = self._load(store, files[0].rel)
        for key in CARRIED:
            if key in first:
                index.objects[key] = ObjectInfo(key, value=archive0.materialize(first[key]))
        params = params_by_key(spec)
        stages = stage_layers(spec, topo.pp, topo.vpp)
        padded = spec.padded_vocab(topo.tp)
        for f in files:
            archive = self._load(store, f.rel)
            data = archive.obj
            index.files[f.rel] = 1
            dense_primary, expert_primary = primaries[f.rel]
            if "rng_state" in data and dense_primary:
                index.objects[f"rank.{f.tp:02d}_{f.pp:03d}.rng_state"] = ObjectInfo(
                    "rng_state", value=archive.materialize(data["rng_state"]))
            mapped = {}  # "chunk/local name" -> (canonical, replica, shape, dtype)
            for chunk_key, chunk in _model_chunks(data, topo.vpp):
                flat = _flatten(data[chunk_key])
                schema = detect_schema(flat)
                _check_schema(schema, spec, version, store.display(f.rel))
                if index.layout(Names) is None:
                    index.set_layout(Names(schema))
                layers = stages[f.pp][chunk]
                for local_name, value in flat.items():
                    if local_name.endswith(EXTRA):
                        key = "extra:" + _global_module(local_name[:-len(EXTRA) - 1], layers)
                        index.objects.setdefault(key, ObjectInfo(key, value=archive.materialize(value)))
                        continue
                    canonical, replica = to_canonical(schema, local_name, layers, spec.tied_embeddings)
                    canonical, expert = _expert(canonical, spec, topo, f)
                    replica = replica or not (dense_primary if expert is None else expert_primary)
                    _add_piece(index, params, canonical, replica, f, (MODEL_PATH, chunk_key, local_name),
                               value, padded, topo, store, expert=expert)
                    mapped[f"{chunk_key}/{local_name}"] = (canonical, replica, tuple(value.shape),
                                                           value.dtype, expert)
            self._read_optimizer(store, index, f, data, mapped, params, padded, topo)
        if index.unmapped is not None:  # nothing half-mapped: the reason says why
            index.drop_layout(optim.Layout)
            index.drop_layout(distopt.Meta)
            for key in [k for k in index.tensors if k.startswith(canon.PREFIX)]:
                del index.tensors[key]
        for key, info in index.tensors.items():
            if not info.pieces:
                raise BadCheckpoint("tensor has only replicas, no primary copy", path=store.url, key=key)
            if expert_of_stacked(key) and sum(p.region.numel for p in info.pieces) != math.prod(info.shape):
                raise BadCheckpoint(f"the rank files hold part of the {info.shape[0]} experts args name "
                                    "(each EP rank's local_experts)", path=store.url, key=key)
        return index

    def _read_optimizer(self, store, index, f, data, mapped, params, padded, topo) -> None:
        """Map this rank's optimizer state to parameters, or record why it cannot be."""
        rel = f.rel.rsplit("/", 1)[0] + "/" + DISTRIB_OPTIM
        if store.exists(rel):
            try:
                self._read_distributed_optimizer(store, index, f, rel, data, mapped, params,
                                                 padded, topo)
            except UnreadableInput as exc:
                _unmappable(index, exc.one_line())
            return
        if not data.get("optimizer"):
            return
        names = [(n, len(shape), shape) for n, (_, _, shape, _, _) in mapped.items()]
        try:
            layout_ = optim.read(data["optimizer"], names, store.display(f.rel),
                                 self._load(store, f.rel).materialize, ep=topo.ep)
        except UnreadableInput as exc:
            _unmappable(index, exc.message)
            return
        for name, paths in layout_.tensors.items():
            canonical, replica, _, _, expert = mapped[name]
            for kind, path in paths.items():
                ref = _resolve(data, path)
                _add_piece(index, params, canonical, replica, f, path, ref, padded, topo, store, expert=expert,
                           key=canon.state_key(kind, canonical))
        saved = index.layout(optim.Layout)
        materialize = self._load(store, f.rel).materialize
        meta = optim.Layout(layout_.fp16, {}, layout_.step, layout_.hyper, materialize(layout_.extra),
                            layout_.kinds, None if layout_.expert_extra is None else
                            materialize(layout_.expert_extra))
        if saved is None:
            index.set_layout(meta)
        elif saved.step != meta.step or saved.fp16 != meta.fp16:
            _unmappable(index, "optimizer state that differs between ranks (step or kind)")

    def _read_distributed_optimizer(self, store, index, f, rel, data, mapped, params, padded,
                                    topo) -> None:
        """Map this rank's distrib_optim.pt to parameters (see :mod:`megatron_distopt`): each
        parameter's slice of the file's vectors is its TP shard, like the weight's."""
        source = store.display(rel)
        archive = self._load(store, rel)
        index.files[rel] = 1
        args = index.objects["args"].value
        spec = ModelSpec(**index.model_config)
        schema = index.layout(Names).schema
        entries = [(uname.split("/", 1)[0], uname, canonical, math.prod(shape), dtype)
                   for uname, (canonical, _, shape, dtype, _) in mapped.items()]  # the file's order
        for chunk_key in dict.fromkeys(e[0] for e in entries):
            names = [e[1].split("/", 1)[1] for e in entries if e[0] == chunk_key]
            if sorted(names, key=lambda n: parameter_order(schema, n)) != names:
                raise UnreadableInput(f"the parameters of {chunk_key} are not in the order of "
                                      "Megatron's named_parameters() that ckptool knows, which "
                                      "distrib_optim.pt follows", path=source)
        chained = _chained(spec, topo)  # [dense, expert] optimizers
        files = distopt.optimizers(archive.obj, chained, source)
        states = [distopt.check_state(s, store.display(f.rel))
                  for s in distopt.optimizers(data.get("optimizer"), chained, store.display(f.rel))]
        chunks = distopt.chunk_params(entries, spec.tied_embeddings, topo.pp)
        groups = distopt.split_experts(chunks, lambda u: mapped[u][4] is not None) if chained else [chunks]
        keys = []
        for s, (obj, group) in enumerate(zip(files, groups)):
            if obj is None:  # another rank's file holds it (not DP rank 0 of that group here)
                held = [u for chunk in group for u in (p.name for p in chunk) if not mapped[u][1]]
                if held:
                    raise UnreadableInput(f"distrib_optim.pt holds no {'expert' if s else 'dense'} "
                                          f"optimizer state, and no other rank file holds that of {held[0]}",
                                          path=source)
                continue
            buffers = distopt.layout(group, args, topo.dp, f.pp)
            found = distopt.check_file(obj, buffers, source)
            keys += found
            prefix = (s,) if chained else ()
            for i, (buffer, key) in enumerate(zip(buffers, found)):
                for uname, offset in buffer.offsets.items():
                    canonical, replica, _, _, expert = mapped[uname]
                    for kind, file_key in distopt.FILE_KEYS.items():
                        path = (*prefix, i, key, file_key)
                        _add_piece(index, params, canonical, replica, f, path, _resolve(archive.obj, path),
                                   padded, topo, store, key=canon.state_key(kind, canonical),
                                   file=rel, base=offset, expert=expert)
        materialize = self._load(store, f.rel).materialize
        meta = distopt.Meta({k[0]: k for k in keys}, materialize(states[0]),
                            expert_state=materialize(states[1]) if chained else None)
        saved = index.layout(distopt.Meta)
        if saved is None:
            index.set_layout(meta)
        elif _steps(saved.state) != _steps(meta.state) or any(
                saved.keys.get(d, k) != k for d, k in meta.keys.items()):
            raise UnreadableInput("ranks disagree on the optimizer step or grad buffer dtypes",
                                  path=source)
        else:
            saved.keys.update(meta.keys)

    def resolve(self, obj: Any, path: tuple) -> Any:
        return _resolve(obj, path)


def _resolve(obj: Any, path: tuple) -> Any:
    """The object at ``path`` in a rank file's tree (model entries by their flat name)."""
    if path[0] == MODEL_PATH:
        return _flatten(obj[path[1]])[path[2]]
    for step in path:
        obj = obj[step]
    return obj


def _steps(state: dict) -> list:
    """The step of each param group of a distributed optimizer's state dict."""
    return [g.get("step") for g in state["optimizer"]["param_groups"]]


def _global_module(local_module: str, layers: range) -> str:
    m = re.match(r"^(.*?layers\.)(\d+)\.(.+)$", local_module)
    if not m:
        return local_module
    return f"decoder.layers.{layers[int(m.group(2))]}.{m.group(3)}"


def expert_of_stacked(key: str) -> bool:
    return ".mlp.experts.experts." in key


def _primaries(files: list[_RankFile], topo: Topology, store: Store) -> dict[str, tuple[bool, bool]]:
    """Per rank file: (holds the primary dense tensors of its (TP, PP) rank, holds the
    primary experts of its (expert TP rank, EP rank, PP rank)); the first file in (PP, EP, TP)
    order wins. Megatron-LM writes a file per (TP, PP, EP) rank that a DP-rank-0 or an
    expert-DP-rank-0 rank holds: every pair when ETP = TP, only some when ETP < TP (TP2,
    ETP1, EP2 on two ranks: ``mp_rank_00_000`` and ``mp_rank_01_001``). Refuses a set that
    leaves a dense shard or an expert shard uncovered, or names ranks the args do not have."""
    if topo.tp * topo.pp * topo.ep != len(files) and topo.tp * topo.pp * topo.ep > 4 * len(files) + 64:
        raise BadCheckpoint(f"args say TP{topo.tp}/PP{topo.pp}/EP{topo.ep}: "
                            f"{topo.tp * topo.pp * topo.ep} rank directories, {len(files)} found",
                            path=store.url)
    shown = "" if topo.ep == 1 else f"/EP{topo.ep}"
    extra = [f for f in files if f.tp >= topo.tp or f.pp >= topo.pp or f.ep >= topo.ep]
    dense, experts, out = {}, {}, {}
    for f in files:
        if f not in extra:
            first_dense = dense.setdefault((f.tp, f.pp), f) is f
            first_expert = experts.setdefault((expert_tp_rank(topo, f.tp), f.ep, f.pp), f) is f
            out[f.rel] = (first_dense, first_expert)
    missing = [rank_dir(t, p, topo.pp, 0, topo.ep) for p in range(topo.pp) for t in range(topo.tp)
               if (t, p) not in dense]
    missing += [rank_dir(r, p, topo.pp, e, topo.ep) for p in range(topo.pp) for e in range(topo.ep)
                for r in range(topo.expert_tp) if (r, e, p) not in experts]
    if missing or extra:
        raise BadCheckpoint(
            f"rank directories do not match args TP{topo.tp}/PP{topo.pp}{shown}: "
            + (f"missing {sorted(set(missing))}" if missing else "")
            + (f" unexpected {[rank_dir(f.tp, f.pp, topo.pp, f.ep, topo.ep) for f in extra]}" if extra else ""),
            path=store.url)
    return out


def _expert(canonical: str | None, spec: ModelSpec, topo: Topology, f: _RankFile) -> tuple:
    """(the stacked expert tensor's key, the global expert) of a local expert's canonical
    name on rank file ``f``; ``(canonical, None)`` for every other tensor."""
    found = expert_of(canonical) if canonical and spec.num_experts else None
    if found is None:
        return canonical, None
    key, j = found
    experts = local_experts(spec, topo, f.ep)
    if j >= len(experts):
        return f"<local expert {j} beyond this EP rank's {len(experts)}>", None
    return key, experts[j]


def _model_code(first: dict) -> str | None:
    """Which model code wrote a rank file (its tensor names say): ``legacy`` (Megatron-LM's legacy
    model, ``language_model.*``) or ``mcore``; None when its model chunk is not found."""
    chunk = first.get("model", first.get("model0"))
    if not isinstance(chunk, dict):
        return None
    return "legacy" if detect_schema(_flatten(chunk)) == "legacy" else "mcore"


def _iteration(data: dict) -> int | None:
    it = data.get("iteration")
    return int(it) if isinstance(it, int) else None


def _model_chunks(data: dict, vpp: int) -> list[tuple[str, int]]:
    if "model" in data:
        return [("model", 0)]
    chunks = [(f"model{c}", c) for c in range(vpp) if f"model{c}" in data]
    if not chunks:
        raise BadCheckpoint("rank file has no `model` entry")
    return chunks


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Nested state dicts (pre-mcore Megatron) to dotted names; flat ones pass through."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    out = {}
    for k, v in tree.items():
        name = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict):
            out.update(_flatten(v, name))
        else:
            out[name] = v
    return out


def _unflatten(flat: dict[str, Any], nested: bool) -> dict:
    if not nested:
        return dict(flat)
    out: dict = {}
    for name, value in flat.items():
        # Pre-mcore nesting: language_model -> {embedding -> ..., encoder -> flat layer keys}
        parts = name.split(".")
        if parts[0] == "language_model" and len(parts) > 2 and parts[1] == "encoder":
            out.setdefault("language_model", {}).setdefault("encoder", {})[".".join(parts[2:])] = value
            continue
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return out


# ----------------------------------------------------------------------------- writing


@dataclass(frozen=True, slots=True)
class RankFile:
    """``mp_rank_TT[_PPP]/model_optim_rng.pt`` of TP rank ``tp``, stage ``pp``: its chunks under
    ``schema``'s names and what else it holds (the optimizer of the rank's parameters,
    a DeepSpeed source's scheduler, a distributed optimizer's ``optimizer`` entry)."""

    tp: int
    pp: int
    schema: str
    spec: ModelSpec
    topo: Topology
    optimizer: Any
    scheduler: Any
    distopt_state: Any
    ep: int = 0
    """Expert-parallel rank (its directory's ``_EEE``)."""


@dataclass(frozen=True, slots=True)
class DistoptFile:
    """``distrib_optim.pt`` of one rank: its buffers (of each optimizer: one, or at EP > 1
    dense and expert), keyed as the source keys them."""

    buffers: list
    keys: Any
    chained: bool = False


class MegatronWriter(UnevenStages, Writer):
    """Writes a legacy Megatron run root: tracker + ``iter_*/mp_rank_*/model_optim_rng.pt``."""

    name = NAME
    _layout_note: str | None = None
    _schedule: dict | None = None
    _from_deepspeed: optim.FromDeepSpeed | None = None

    def configure(self, *, megatron_lr_schedule: str | None = None, **options) -> None:
        super().configure(**options)
        self._schedule = optim.parse_schedule(megatron_lr_schedule) if megatron_lr_schedule else None

    def bind(self, opened) -> None:
        adopt_dcp_common(opened)  # a DCP source's opt_param_scheduler, stored one object per field

    def notes(self, index: CheckpointIndex) -> list[str]:
        """What a user resuming from the output must know."""
        notes = [self._layout_note] if self._layout_note else []
        notes += feature_notes(index)
        if self._from_deepspeed:
            notes.append(self._from_deepspeed.note)
        if not any(k.endswith(".rng_state") for k in index.objects):
            args = index.objects.get("args")
            notes.append("the source has no RNG state: each rank gets the one a fresh Megatron-LM "
                         f"start with --seed {_seed(args.value if args else None)} sets (random, "
                         "numpy, torch, CUDA and the model/data/expert-parallel trackers), so "
                         "Megatron-LM loads it without --no-load-rng")
        if not any(k.startswith(canon.PREFIX) for k in index.tensors) and not index.unmapped:
            notes.append("the source holds no optimizer state, so none is written: start Megatron "
                         "with --no-load-optim (or --finetune); ckptool never invents one")
        return notes

    def source_schema(self, opened) -> str:
        names = opened.index.layout(Names)  # a legacy Megatron source's
        return names.schema if names else "mcore-local"

    def plan(self, index: CheckpointIndex, topo: Topology, spec: ModelSpec,
             schema: str = "mcore-local", with_optimizer: bool = True) -> list[TargetFile]:
        if spec.num_experts and schema != "mcore-local":
            raise UsageError(f"Mixture-of-Experts output is written under mcore-local names only "
                             f"(Megatron-Core's local spec), not {schema}",
                             hint="Pass --megatron-names mcore-local")
        if schema == "legacy" and (spec.groups != spec.num_attention_heads or spec.qk_layernorm):
            what = "QK norms" if spec.qk_layernorm else "grouped-query attention"
            raise UsageError(f"pre-mcore (legacy) names cannot express {what} here",
                             hint="Use --megatron-names mcore-local or mcore-te")
        refuse_unrunnable_gelu(spec, "legacy" if schema == "legacy" else "mcore")
        names = index.layout(Names)
        args = index.objects.get("args")
        if schema == "legacy" and not (names is not None and names.schema == "legacy") and not (
                args is not None and megatron_deepspeed(args.value)):
            # a legacy source keeps its args as they are; Megatron-DeepSpeed applies its rope_theta
            refuse_unapplied_by_legacy(spec)
        it_dir = iteration_dir(index.iteration if index.iteration is not None else 0)
        optim_layout = index.layout(optim.Layout) if with_optimizer else None
        self._from_deepspeed = optim.deepspeed_state(index, self._schedule, with_optimizer)
        optim_layout = optim_layout if optim_layout else \
            self._from_deepspeed.layout if self._from_deepspeed else None
        distributed = index.layout(distopt.Meta) if with_optimizer else None
        files = []
        # the dtypes matter only to lay out the distributed optimizer's buffers
        dtype_of = (lambda t: source_dtype(index, _key(t))) if distributed else (lambda t: None)
        for rank in distopt.rank_params(spec, topo, schema, dtype_of):
            rank_path = f"{it_dir}/{rank_dir(rank.tp, rank.pp, topo.pp, rank.ep, topo.ep)}"
            target = TargetFile(f"{rank_path}/{FILE}",
                                context=RankFile(
                                    rank.tp, rank.pp, schema, spec, topo, optim_layout,
                                    self._from_deepspeed.scheduler if self._from_deepspeed else None,
                                    distopt.target_state(distributed, _chained(spec, topo))
                                    if distributed else None, rank.ep))
            named = rank.named()
            for chunk, name, t in named:
                chunk_key = "model" if topo.vpp == 1 else f"model{chunk}"
                if optim.master_is_weight(index, optim_layout, _key(t)):
                    target.tensors.append(TargetTensor((chunk_key, name),
                                                       canon.state_shard("fp32_param", t.shard),
                                                       torch.float32))
                    continue
                target.tensors.append(TargetTensor((chunk_key, name), t.shard, source_dtype(index, _key(t))))
            if distributed is not None:
                files.append(self._distopt_file(f"{rank_path}/{DISTRIB_OPTIM}", index, rank,
                                                distributed, topo, _chained(spec, topo)))
            if optim_layout is not None:
                for chunk, name, t in named:
                    chunk_key = "model" if topo.vpp == 1 else f"model{chunk}"
                    for kind in optim.state_kinds(optim_layout):
                        key = canon.state_key(kind, _key(t))
                        target.tensors.append(TargetTensor((OPTIM_PATH, kind, chunk_key, name),
                                                           canon.state_shard(kind, t.shard),
                                                           source_dtype(index, key)))
            files.append(target)
        return files

    def _distopt_file(self, path: str, index: CheckpointIndex, rank: distopt.RankParams,
                      meta: distopt.Meta, topo: Topology, chained: bool) -> TargetFile:
        """The distrib_optim.pt of one target rank: the source's optimizer vectors, laid out
        by Megatron's buffer rule for the target's parameters; the gaps between parameters
        are zeros, as Megatron's."""
        args = index.objects["args"].value
        groups = rank.optimizer_chunks(chained)
        try:
            subs = [distopt.layout(group, args, topo.dp, rank.pp) for group in groups]
        except UnreadableInput as exc:
            raise UsageError(f"cannot lay out distrib_optim.pt for the target: {exc.message}",
                             path=index.url, hint=distopt.HINT) from None
        buffers = [b for sub in subs for b in sub]
        unknown = sorted(str(b.dtype) for b in buffers if b.dtype not in meta.keys)
        if unknown:
            raise UsageError(f"the source's distrib_optim.pt has no grad buffer of {unknown} "
                             "parameters to take the buffer's key from", path=index.url,
                             hint=distopt.HINT)
        if rank.pp == 0:
            size = buffers[0].bucket_size
            self._layout_note = (
                f"distrib_optim.pt is laid out for DDP buckets of "
                f"{size if size is not None else 'unlimited'} elements (overlap_grad_reduce="
                f"{getattr(args, 'overlap_grad_reduce', None)}, ddp_bucket_size="
                f"{getattr(args, 'ddp_bucket_size', None)}, DP{topo.dp}): resume with the same "
                "settings, Megatron checks only the total size")
        target = TargetFile(path, context=DistoptFile(subs, meta.keys, chained))
        for s, sub in enumerate(subs):
            for i, buffer in enumerate(sub):
                for kind, file_key in distopt.FILE_KEYS.items():
                    parts = sorted(((offset + off, replace(r, key=canon.state_key(kind, r.key)))
                                    for uname, offset in buffer.offsets.items()
                                    for off, r in rank.tensors[uname].shard.parts), key=lambda x: x[0])
                    target.tensors.append(TargetTensor((DISTOPT_PATH, *((s,) if chained else ()), i, file_key),
                                                       Shard((buffer.numel_unpadded,), tuple(parts)),
                                                       torch.float32))
        return target

    def write_file(self, store: Store, target: TargetFile, produce, index: CheckpointIndex,
                   true_vocab_size: int | None) -> tuple[int, str]:
        """Stream one rank file: ``produce(target_tensor)`` fills each tensor as it is written."""
        ctx = target.context
        if isinstance(ctx, DistoptFile):
            shapes = {t.name: t.shard.shape for t in target.tensors}

            def vectors(*prefix):
                def vector(i, key):
                    name = (DISTOPT_PATH, *prefix, i, key)
                    return Pending(name, shapes[name], torch.float32)
                return vector

            obj = [distopt.build(sub, ctx.keys, vectors(s)) for s, sub in enumerate(ctx.buffers)] \
                if ctx.chained else distopt.build(ctx.buffers[0], ctx.keys, vectors())
            return save_target(store, target, obj, produce)
        topo, spec, schema = ctx.topo, ctx.spec, ctx.schema
        pending = {t.name: t for t in target.tensors}
        chunks: dict[str, dict] = {}
        for t in target.tensors:
            if t.name[0] != OPTIM_PATH:
                chunk_key, name = t.name
                chunks.setdefault(chunk_key, {})[name] = Pending(t.name, t.shard.shape, t.dtype)
        state: dict[str, Any] = {}
        for key in CARRIED:
            if key in index.objects:
                state[key] = copy.deepcopy(index.objects[key].value)
        if ctx.scheduler is not None:
            state[optim.SCHEDULER_KEY] = copy.deepcopy(ctx.scheduler)
        state.setdefault("checkpoint_version", 3.0)
        state.setdefault("iteration", index.iteration or 0)
        args = index.objects.get("args")
        state["args"] = update_args(args.value if args else None, spec, topo, true_vocab_size, index,
                                    model="legacy" if ctx.schema == "legacy" else "mcore")
        rng = _pick_rng(index, ctx.tp, ctx.pp)
        state["rng_state"] = rng if rng is not None else fresh_rng_state(
            _seed(state["args"]), ctx.tp, ctx.pp, ctx.ep, expert_tp_rank(topo, ctx.tp))
        stages = stage_layers(spec, topo.pp, topo.vpp)[ctx.pp]
        for c, chunk_layers in enumerate(stages):
            chunk_key = "model" if topo.vpp == 1 else f"model{c}"
            flat = dict(chunks.get(chunk_key, {}))
            if not SCHEMAS[schema].nested:
                flat.update(_extra_states(index, chunk_layers, ctx.pp == 0 and c == 0,
                                          ctx.pp == topo.pp - 1 and c == len(stages) - 1,
                                          spec.num_experts // topo.ep if spec.num_experts else 0))
            state[chunk_key] = _unflatten(flat, nested=SCHEMAS[schema].nested)
        if ctx.optimizer is not None:
            params = [(f"{c}/{n}", len(p.shape)) for c, entries in chunks.items() for n, p in entries.items()
                      if isinstance(p, Pending)]

            def placeholder(kind, uname):
                chunk_key, name = uname.split("/", 1)
                t = pending[(OPTIM_PATH, kind, chunk_key, name)]
                return Pending(t.name, t.shard.shape, t.dtype)

            state["optimizer"] = optim.build(params, ctx.optimizer, placeholder, ep=topo.ep)
        if ctx.distopt_state is not None:
            state["optimizer"] = copy.deepcopy(ctx.distopt_state)
        state[MARK] = {"version": VERSION}
        return save_target(store, target, state, produce)

    def finalize(self, store: Store, index: CheckpointIndex) -> list[str]:
        it = index.iteration if index.iteration is not None else 0
        store.write_bytes(TRACKER, str(it).encode())
        return [TRACKER]




def _chained(spec: ModelSpec, topo: Topology) -> bool:
    """Megatron-LM holds a MoE model's experts at EP > 1 in an optimizer of their own
    (``ChainedOptimizer`` [dense, expert])."""
    return bool(spec.num_experts) and topo.ep > 1


def _key(t) -> str:
    """The global key of a layout tensor (its regions'), or its local name if all padding."""
    return t.shard.regions[0].key if t.shard.regions else t.name


DEFAULT_SEED = 1234
"""Megatron-LM's ``--seed`` default."""
RNG_TRACKERS = ("data-parallel-rng", "model-parallel-rng", "expert-parallel-rng")
"""Megatron-Core's CUDA RNG tracker names (``tensor_parallel.random``)."""


def _seed(args) -> int:
    seed = getattr(args, "seed", None)
    return seed if isinstance(seed, int) and seed > 0 else DEFAULT_SEED


def fresh_rng_state(seed: int, tp: int, pp: int, ep: int = 0, etp: int = 0) -> list[dict]:
    """The ``rng_state`` Megatron-LM saves for rank (tp, pp, ep, etp) right after a fresh start
    with ``--seed seed`` (``_set_random_seed``: the stage's seed ``seed + 100·pp`` for random,
    numpy, torch and the default CUDA generator; ``model_parallel_cuda_manual_seed``: the
    trackers' ``data-parallel-rng`` at that seed, ``model-parallel-rng`` at ``+ 2718 + tp``,
    ``expert-parallel-rng`` at ``+ 1024 + 100·ep + etp``), one entry as without
    ``--data-parallel-random-init``. A CUDA generator's state is its seed and its Philox
    offset (0), two int64s as bytes (``CUDAGeneratorImpl::get_state``)."""
    import random

    import numpy as np

    stage = seed + 100 * pp

    def cuda(s: int) -> torch.Tensor:
        return torch.tensor([s, 0], dtype=torch.int64).view(torch.uint8)

    trackers = dict(zip(RNG_TRACKERS, (stage, stage + 2718 + tp, stage + 1024 + 100 * ep + etp)))
    return [{"random_rng_state": random.Random(stage).getstate(),
             "np_rng_state": np.random.RandomState(stage).get_state(),
             "torch_rng_state": torch.Generator().manual_seed(stage).get_state(),
             "cuda_rng_state": cuda(stage),
             "rng_tracker_states": {name: cuda(s) for name, s in trackers.items()}}]


def _pick_rng(index: CheckpointIndex, tp: int, pp: int):
    """RNG state of the same (tp, pp) rank if the source had it, else of a rank that did.

    Megatron refuses to load without rng_state; after a topology change an exact RNG
    stream cannot exist, so the state of rank (tp mod TP_src, pp mod PP_src) is carried.
    """
    topo = index.topology
    if topo is None:
        return None
    key = f"rank.{tp % topo.tp:02d}_{pp % topo.pp:03d}.rng_state"
    obj = index.objects.get(key)
    return copy.deepcopy(obj.value) if obj else None


def _extra_states(index: CheckpointIndex, chunk_layers: range, first: bool, last: bool,
                  local_experts: int = 0) -> dict:
    """``_extra_state`` entries of this file's modules (mcore only): carried from the source,
    or, when the source format has none, the empty ones Megatron-Core's modules expect. A
    local expert's entry is the same for every expert: each of the target's
    ``local_experts`` gets the one the source has for that layer and module."""
    found = {k[len("extra:"):]: o.value for k, o in index.objects.items() if k.startswith("extra:")}
    for module in [m for m in found if _EXPERT_MODULE.match(m)]:
        value = found.pop(module)
        m = _EXPERT_MODULE.match(module)
        for j in range(local_experts):
            found.setdefault(f"{m.group(1)}.local_experts.{j}.{m.group(3)}", value)
    if not found:
        modules = EXTRA_STATE_MODULES if not local_experts else EXTRA_STATE_MODULES[:2] + tuple(
            f"mlp.experts.local_experts.{j}.linear_fc{k}" for j in range(local_experts) for k in (1, 2))
        found = {f"decoder.layers.{g}.{module}": None for g in chunk_layers for module in modules}
        found["output_layer"] = None
    out = {}
    for module, value in found.items():
        m = _LAYER_MODULE.match(module)
        if m:
            g = int(m.group(1))
            if g in chunk_layers:
                out[f"decoder.layers.{chunk_layers.index(g)}.{m.group(2)}.{EXTRA}"] = value
        elif (module.startswith("embedding") and first) or (not module.startswith("embedding") and last):
            out[f"{module}.{EXTRA}"] = value
    return out
