"""DeepSpeed pipeline checkpoints as Megatron-DeepSpeed writes them (``GPTModelPipe``), read
and written at another TP, PP and DP (:class:`PipelineWriter`).

A ``PipelineModule`` is a list of layer specs; DeepSpeed numbers them from 0 over the whole
model and each stage builds a contiguous run of them. ``save_checkpoint`` then writes, in
``<tag>/`` (default ``global_step{N}``):

* ``layer_{idx:02d}-model_{tp:02d}-model_states.pt``: the state dict of spec ``idx`` as TP
  rank ``tp`` holds it (``layer_{idx:02d}-model_states.pt`` when the topology has no
  ``model`` axis), written by DP rank 0 of the stage that builds it. Specs without a state
  dict (functions, and a ``TiedLayerSpec`` with a ``forward_fn``, which is a ``partial``)
  have no file.
* ``mp_rank_{mp:02d}_model_states.pt`` per model-parallel rank, ``mp = pp_rank * tp +
  tp_rank`` (DeepSpeed's model group is every rank of one data-parallel slice, in
  pipe-major order): ``module`` is None; ``param_shapes`` names the stage's trainable
  parameters as ``PipelineModule.named_parameters()`` does (``{idx}.{local}`` and
  ``tied_modules.{key}.{local}``); ``dp_world_size``, ``mp_world_size`` and, since 0.16,
  ``checkpoint_parallel_dimensions``. Megatron-DeepSpeed's client state adds ``args``,
  ``checkpoint_version`` (3.0), ``iteration``, ``tokens`` and ``rng_state``.
* ``[bf16_]zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt``: that stage's flat param
  groups cut by :func:`~converters.deepspeed.zero.zero_partition`, at ZeRO-1, or from
  DeepSpeed's BF16_Optimizer, which a bf16 pipeline runs at stage 0 (its fp32 partitions
  keep the tail padding). DeepSpeed runs pipelines at ZeRO 0 or 1 only. Optimizer state
  that cannot be mapped leaves the weights readable and says why (``index.unmapped``).

``GPTModelPipe``'s specs (Megatron-DeepSpeed ``megatron/model/gpt_model.py``): the fp16
cast (a function, index 0), the embedding (``EmbeddingPipe``: ``word_embeddings.weight``,
``position_embeddings.weight``; ``TiedLayerSpec('embed')`` when tied), the ``num_layers``
transformer layers (``ParallelTransformerLayerPipe``, legacy local names), the final norm
(``weight``, ``bias``), then the head: the tied ``'embed'`` again with a ``forward_fn`` (no
file) or ``LMHeadPipe`` (``lm_head.weight``). So the layer files are the legacy Megatron
rank files cut per layer: each local name is put under its legacy prefix and mapped to
canonical by the legacy schema and the TP layout rules, exactly as the ``megatron`` reader
does (:mod:`converters.schemas.megatron`, :mod:`converters.schemas.megatron_ranks`).

The last stage's copy of the tied embedding module is in its optimizer (its
``tied_modules.embed.*``): the word embeddings are a replica of the first stage's (their
gradients are summed across the two stages), while the position embeddings there are a
dead copy that no forward uses, never synchronized nor saved as a layer file: their
optimizer state is left out of the view.
"""

from __future__ import annotations

import argparse
import copy
import re
from collections import OrderedDict
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ckptool.core import VERSION
from ckptool.core.engine import TargetFile, TargetTensor
from ckptool.core.errors import (
    BadCheckpoint,
    TopologyError,
    UnreadableInput,
    UsageError,
)
from ckptool.core.index import CheckpointIndex, ObjectInfo, Writer
from ckptool.core.layout import WORD_EMBEDDINGS, check, split
from ckptool.core.lazy import lazy
from ckptool.core.optimizer import ParamGroups, state_key
from ckptool.core.regions import Shard, flat_regions
from ckptool.core.safe_pickle import record_class
from ckptool.core.topology import Topology
from ckptool.core.torchfile import Pending
from ckptool.core.torchreader import save_target
from converters.deepspeed.zero import (
    MOMENTS,
    OPTIM_FILE,
    PER_RANK,
    Layout,
    add_region,
    ds_config_for,
    int_or_none,
    optim_states_tree,
    param_groups,
    rank_files,
    round_robin,
    round_robin_undone,
    zero_partition,
    zero_stage,
)
from converters.schemas.megatron import TRACKER, params_by_key, to_canonical
from converters.schemas.megatron_args import (
    normalize_args,
    spec_from_args,
    target_spec,
    update_args,
)
from converters.schemas.megatron_ranks import add_piece, check_legacy_schema

torch = lazy("torch", globals())

LAYER_FILE = re.compile(r"^layer_(\d+)(?:-model_(\d+))?-model_states\.pt$")
MP_FILE = "mp_rank_{:02d}_model_states.pt"
_TIED = re.compile(r"^tied_modules\.[^.]+\.(.+)$")
_PARAM = re.compile(r"^(\d+)\.(.+)$")
_CARRIED = ("iteration", "checkpoint_version", "tokens", "global_steps", "global_samples",
            "skipped_steps", "lr_scheduler", "ds_config")


def is_pipeline(names) -> bool:
    """Whether a tag directory's file names are a pipeline checkpoint's."""
    return any(LAYER_FILE.match(n) for n in names)


@dataclass(frozen=True)
class PipeLayers:
    """Which spec index holds which module of a GPTModelPipe (see the module docstring)."""

    embedding: int
    num_layers: int
    head: int | None
    """``LMHeadPipe``'s index (untied); None when the head is the tied embedding."""

    @property
    def final_norm(self) -> int:
        return self.embedding + self.num_layers + 1

    def legacy_name(self, idx: int, local: str) -> str | None:
        """The pre-mcore Megatron name of spec ``idx``'s ``local`` tensor, with its global
        layer index (None when the spec holds no such tensor)."""
        if idx == self.embedding:
            return "language_model.embedding." + local
        if self.embedding < idx < self.final_norm:
            return f"language_model.encoder.layers.{idx - self.embedding - 1}.{local}"
        if idx == self.final_norm:
            return "language_model.encoder.final_layernorm." + local
        if idx == self.head and local.startswith("lm_head."):
            return "language_model.output_layer." + local[len("lm_head."):]
        return None

    def parameter(self, name: str) -> tuple[int, str] | None:
        """(spec index, local name) of a ``PipelineModule`` parameter name."""
        m = _TIED.match(name)
        if m:
            return self.embedding, m.group(1)
        m = _PARAM.match(name)
        return (int(m.group(1)), m.group(2)) if m else None


@dataclass
class PipeLayout:
    """The source's structure beyond its tensors, for writing (:class:`PipelineWriter`)."""

    layers: PipeLayers
    tag: str
    entries: dict[int, list[str]]
    """Spec index -> the names in its layer file, in file (``state_dict``) order."""
    groups: dict[int, list[list[tuple[str, tuple[int, ...]]]]] = field(default_factory=dict)
    """Model-parallel rank -> its param groups in flat-buffer order (``param_shapes``)."""
    model_states: dict = field(default_factory=dict)
    """Model-parallel rank 0's model states without ``optimizer`` and ``rng_state``."""
    model_optimizer: bool = False
    """The model states hold the optimizer's state dict too (BF16_Optimizer at stage 0)."""
    optim: Any = None
    """The optimizer files' non-tensor entries (:class:`converters.deepspeed.zero.Layout`)."""

    @property
    def tied_key(self) -> str:
        """The tied module's key (``TiedLayerSpec('embed', ...)`` in GPTModelPipe)."""
        for name in (n for groups in self.groups.values() for g in groups for n, _ in g):
            m = re.match(r"^tied_modules\.([^.]+)\.", name)
            if m:
                return m.group(1)
        return "embed"


@dataclass
class _Rank:
    """A file read as one TP rank's (``add_piece``'s view of a rank file)."""

    tp: int
    rel: str


def read_pipeline(reader, store, tag: str, names: list[str]) -> CheckpointIndex:
    """The canonical global view of a pipeline checkpoint in ``tag`` (``names``: its files)."""
    where = store.display(tag)
    join = (lambda n: f"{tag}/{n}") if tag else (lambda n: n)
    layer_files = {(int(m.group(1)), int(m.group(2) or 0)): join(n)
                   for n in names if (m := LAYER_FILE.match(n))}
    first = join(MP_FILE.format(0))
    if not store.exists(first):
        raise BadCheckpoint(f"{MP_FILE.format(0)} is missing", path=where)
    archive0 = reader._load(store, first)
    ms = archive0.obj
    raw_args = ms.get("args")
    if not isinstance(raw_args, argparse.Namespace):
        raise UnreadableInput("a DeepSpeed pipeline checkpoint without Megatron `args`: nothing "
                              "says which layer file holds which module", path=store.display(first),
                              hint="ckptool reads Megatron-DeepSpeed's GPTModelPipe checkpoints, "
                                   "whose client state carries args")
    args = normalize_args(raw_args)
    spec, topo, vocab_known = spec_from_args(args, model="megatron-deepspeed")
    version = ms.get("checkpoint_version")
    check_legacy_schema("legacy", spec, version, store.display(first))
    dims = ms.get("checkpoint_parallel_dimensions")
    if isinstance(dims, dict) and (dims.get("tp_degree", topo.tp), dims.get("pp_degree", topo.pp)) \
            != (topo.tp, topo.pp):
        raise BadCheckpoint(f"DeepSpeed recorded TP{dims.get('tp_degree')}/PP{dims.get('pp_degree')}, "
                            f"args say TP{topo.tp}/PP{topo.pp}", path=store.display(first))
    dp = int(ms.get("dp_world_size") or topo.dp)
    mp_rels = [join(MP_FILE.format(m)) for m in range(topo.tp * topo.pp)]
    missing = [r for r in mp_rels if not store.exists(r)]
    if missing:
        raise BadCheckpoint(f"model-states files missing for TP{topo.tp}/PP{topo.pp}: "
                            f"{[r.rsplit('/', 1)[-1] for r in missing]}", path=where)
    layers = _pipe_layers(layer_files, spec, topo, where)
    optim = {(int(m.group(2)), int(m.group(3))): join(n) for n in names if (m := OPTIM_FILE.match(n))}
    osd0 = None
    if optim:
        osd0 = reader._load(store, optim[min(optim)]).obj.get("optimizer_state_dict")
    stage = zero_stage(osd0, ms)
    index = CheckpointIndex(format="deepspeed", url=store.url,
                            topology=Topology(tp=topo.tp, pp=topo.pp, dp=dp, zero=stage),
                            model_config=_asdict(spec), true_vocab_size=spec.vocab_size if vocab_known else None,
                            iteration=int_or_none(ms.get("iteration", ms.get("global_steps"))),
                            format_version=str(ms.get("ds_version") or "") or None,
                            written_by_ckptool="ckptool" in ms)
    index.objects["args"] = ObjectInfo("args", value=args)
    record = PipeLayout(layers, tag or "global_step%d" % (index.iteration or 0), {},
                        model_states={k: None if k in ("optimizer", "rng_state") else archive0.materialize(v)
                                      for k, v in ms.items()},
                        model_optimizer=ms.get("optimizer") is not None)
    index.set_layout(record)
    for key in _CARRIED:
        if key in ms:
            index.objects[key] = ObjectInfo(key, value=archive0.materialize(ms[key]))
    for mp, rel in enumerate(mp_rels):  # Megatron-DeepSpeed's client state: RNG per rank
        archive = reader._load(store, rel)
        if "rng_state" in archive.obj:
            key = f"rank.{mp % topo.tp:02d}_{mp // topo.tp:03d}.rng_state"
            index.objects[key] = ObjectInfo("rng_state", value=archive.materialize(archive.obj["rng_state"]))
    params = params_by_key(spec)
    padded = spec.padded_vocab(topo.tp)
    for (idx, tp_rank), rel in sorted(layer_files.items()):
        state = reader._load(store, rel).obj
        record.entries.setdefault(idx, list(state))
        for local, ref in state.items():
            legacy = layers.legacy_name(idx, local)
            canonical, replica = to_canonical("legacy", legacy, range(spec.num_layers),
                                              spec.tied_embeddings) if legacy else (None, False)
            add_piece(index, params, canonical, replica, _Rank(tp_rank, rel), (local,), ref, padded,
                      topo, store)
    if stage == 0:
        if any(reader._load(store, r).obj.get("optimizer") for r in mp_rels):
            index.unmapped = ("DeepSpeed stage-0 optimizer state is a torch state dict that does "
                              "not name its parameters")
    else:
        try:
            for mp, rel in enumerate(mp_rels):
                rels = rank_files({r: f for (r, m), f in optim.items() if m == mp}, dp, "optimizer", where)
                record.groups[mp] = _read_optimizer(reader, store, index, rel, rels, mp, layers, params,
                                                    padded, topo, add_region)
                if mp == 0:
                    record.optim = _optim_layout(reader, store, rels[0], record, stage)
        except UnreadableInput as exc:  # the weights stay readable; nothing half-mapped
            index.unmapped = exc.message
            record.groups, record.optim = {}, None
            for key in [k for k in index.tensors if k.startswith("optimizer.")]:
                del index.tensors[key]
    if record.optim is not None and record.optim.hyper:
        index.set_layout(ParamGroups(record.groups, record.optim.hyper, record.optim.steps))
    for key, info in index.tensors.items():
        if not info.pieces:
            raise BadCheckpoint("tensor has only replicas, no primary copy", path=where, key=key)
    return index


def _pipe_layers(layer_files: dict, spec, topo, where: str) -> PipeLayers:
    """Which spec index is which module, checked against the files found (see
    :func:`pipe_layers`); every layer has one file per TP rank."""
    layers = pipe_layers(sorted({idx for idx, _ in layer_files}), spec, where)
    for idx in range(layers.embedding, layers.final_norm + (layers.head is not None) + 1):
        ranks = sorted(tp for i, tp in layer_files if i == idx)
        if ranks != list(range(topo.tp)):
            raise BadCheckpoint(f"layer {idx:02d} has files for TP ranks {ranks}, args say TP{topo.tp}",
                                path=where)
    return layers


def pipe_layers(indices: list[int], spec, where: str) -> PipeLayers:
    """Which spec index is which module, from the sorted spec indices that hold state (a
    layer file each): the embedding is the first, then ``num_layers`` layers, the final norm
    and, untied, the head."""
    count = spec.num_layers + (2 if spec.tied_embeddings else 3)
    expected = range(indices[0], indices[0] + count)
    gaps = [i for i in expected if i not in indices]
    if gaps and set(indices) <= set(expected):
        raise BadCheckpoint(f"layer files missing: {[f'layer_{i:02d}' for i in gaps]}", path=where)
    if indices != list(expected):
        raise UnreadableInput(f"layer files for spec indices {indices}, but a GPTModelPipe of "
                              f"{spec.num_layers} layers ({'tied' if spec.tied_embeddings else 'untied'}) "
                              f"has {count} consecutive ones", path=where,
                              hint="ckptool reads Megatron-DeepSpeed's GPTModelPipe layer order")
    return PipeLayers(indices[0], spec.num_layers, indices[-1] if not spec.tied_embeddings else None)


def _read_optimizer(reader, store, index, ms_rel, rels, mp, layers: PipeLayers, params, padded,
                    topo, add) -> list:
    """ZeRO-1: every DP rank's partition of model-parallel rank ``mp``'s param groups. Each
    parameter's flat range of the partition is cut into the canonical regions its TP shard
    holds (the same rule as its weight). Returns the param groups (names, TP shard shapes)."""
    tp_rank, pp_rank = mp % topo.tp, mp // topo.tp
    ms = reader._load(store, ms_rel).obj
    source = store.display(ms_rel)
    groups = param_groups(ms)
    if not groups:  # BF16_Optimizer at stage 0 records no param_shapes: its slice mappings
        groups = _groups_from_mappings(reader, store, rels, layers, pp_rank, tp_rank, params,
                                       padded, topo, source)
    where = {}
    for name, shape in (p for g in groups for p in g):
        placed = place_parameter(name, shape, layers, pp_rank, tp_rank, params, padded, topo, source)
        where[name] = placed and (placed[0], placed[1], placed[2].parts)
    dp = len(rels)
    for rank, rel in enumerate(rels):
        source = store.display(rel)
        osd = reader._load(store, rel).obj.get("optimizer_state_dict") or {}
        if any(any(p) for p in osd.get("param_alignment_paddings") or ()):
            raise UnreadableInput("parameter_alignment padding between parameters is not "
                                  "supported yet", path=source)
        bf16_optimizer = "zero_stage" not in osd  # its fp32 partitions keep the tail padding
        base = osd.get("base_optimizer_state") or {}
        states, masters = base.get("state") or {}, osd.get("single_partition_of_fp32_groups") or []
        if len(masters) != len(groups):
            raise BadCheckpoint("optimizer file does not hold one fp32 partition per param group",
                                path=source)
        for g, group in enumerate(groups):
            shard, pad = zero_partition(group, dp, rank)
            if not bf16_optimizer and (osd.get("group_paddings") or [None] * (g + 1))[g] != pad:
                raise BadCheckpoint(f"group_paddings do not follow the ZeRO rule ({pad} expected "
                                    f"for group {g})", path=source)
            vectors = [(kind, states.get(g, {}).get(kind), ("base_optimizer_state", "state", g, kind),
                        shard.shape[0]) for kind in MOMENTS]
            vectors.append(("fp32_param", masters[g], ("single_partition_of_fp32_groups", g),
                            shard.shape[0] - (0 if bf16_optimizer else pad)))
            for kind, ref, path, length in vectors:
                if getattr(ref, "numel", None) != length:
                    raise BadCheckpoint(f"{kind} of param group {g} has {getattr(ref, 'numel', 'no')} "
                                        f"elements, the ZeRO-1 rule at DP{dp} says {length}", path=source)
                for offset, region in shard.parts:
                    placed = where[region.key]
                    if placed is None:
                        continue  # the last stage's dead copy of a tied module's other weights
                    canonical, replica, parts = placed
                    for at, piece in flat_regions(parts, *region.flat, state_key(kind, canonical)):
                        add(index, piece.key, ref, piece, rel, ("optimizer_state_dict", *path),
                            offset + at, replica=replica)
    return groups


def _optim_layout(reader, store, rel: str, record: PipeLayout, stage: int):
    """The non-tensor entries of model-parallel rank 0's first optimizer file, as the plain
    DeepSpeed writer carries them (:class:`converters.deepspeed.zero.Layout`)."""
    archive = reader._load(store, rel)
    osd = archive.obj.get("optimizer_state_dict") or {}
    base = osd.get("base_optimizer_state") or {}
    groups = record.groups[0]
    if sorted(base.get("state") or {}) != list(range(len(groups))) or \
            len(base.get("param_groups") or ()) != len(groups):
        raise UnreadableInput("the optimizer does not hold one state per param group",
                              path=store.display(rel))
    fragments = [v for g in osd.get("param_slice_mappings") or () for v in g.values()]
    return Layout(
        tag=record.tag, stage=stage, bf16_files=rel.rsplit("/", 1)[-1].startswith("bf16_"),
        bf16_optimizer="zero_stage" not in osd, groups=groups, frozen=[], shared={}, module=[],
        model_states=record.model_states,
        optim_file={k: None if k == "optimizer_state_dict" else archive.materialize(v)
                    for k, v in archive.obj.items()},
        osd={k: archive.materialize(v) for k, v in osd.items() if k not in PER_RANK},
        hyper=[archive.materialize({k: v for k, v in g.items() if k != "params"})
               for g in base["param_groups"]],
        steps=[archive.materialize(base["state"][g].get("step")) for g in range(len(groups))],
        fragment_type=type(fragments[0]) if fragments else None)


def _groups_from_mappings(reader, store, rels, layers, pp_rank, tp_rank, params, padded, topo,
                          source) -> list:
    """Param groups in flat-buffer order from ``param_slice_mappings`` (each DP rank names
    the parameters its partition touches, in order), shaped by the layout rule."""
    groups: list[dict] = []
    for rel in rels:
        mappings = (reader._load(store, rel).obj.get("optimizer_state_dict") or {}).get(
            "param_slice_mappings") or []
        groups += [{} for _ in range(len(mappings) - len(groups))]
        for g, mapping in enumerate(mappings):
            for name in mapping:
                groups[g].setdefault(name, None)
    if not groups:
        raise BadCheckpoint("model states have no param_shapes and the optimizer files no "
                            "param_slice_mappings", path=source)
    out = []
    for group in groups:
        shaped = []
        for name in group:
            param = _canonical(name, layers, params, source)[1]
            shaped.append((name, split(param, tp_rank, topo.tp, padded).shape))
        out.append(shaped)
    return out


def _canonical(name, layers: PipeLayers, params, source):
    """(canonical key, its Param, spec index, is the tied copy) of a PipelineModule parameter."""
    found = layers.parameter(name)
    legacy = layers.legacy_name(*found) if found else None
    canonical, replica = to_canonical("legacy", legacy, range(layers.num_layers), True) \
        if legacy else (None, False)
    param = params.get(canonical) if canonical else None
    if param is None:
        raise BadCheckpoint(f"parameter {name!r} does not fit the model described by args",
                            path=source)
    return canonical, param, found[0], replica


def place_parameter(name, shape, layers: PipeLayers, pp_rank, tp_rank, params, padded, topo,
                    source) -> tuple[str, bool, Shard] | None:
    """(canonical key, is a replica, the TP shard) of a stage's ``PipelineModule`` parameter
    ``name`` of local ``shape``, or None for the last stage's dead copy of the tied embedding
    module's other weights. The one rule the reader, the writer and the training hook
    (``training.deepspeed``) place a pipeline parameter by."""
    canonical, param, idx, replica = _canonical(name, layers, params, source)
    if pp_rank > 0 and idx == layers.embedding:  # the last stage's tied copy
        if canonical != WORD_EMBEDDINGS:
            return None
        replica = True
    tshard = split(param, tp_rank, topo.tp, padded)
    if tshard.shape != tuple(shape):
        raise BadCheckpoint(f"{name} is {list(shape)}, the layout from args says {list(tshard.shape)}",
                            path=source)
    replica = replica or (param.rule == "replicated" and tp_rank > 0)
    return canonical, replica, tshard


# ----------------------------------------------------------------------- the stage rule


def partition_uniform(items: int, parts: int) -> list[int]:
    """DeepSpeed's ``partition_uniform`` (``deepspeed/runtime/utils.py``): ``parts + 1``
    bounds; the first ``items % parts`` parts get one item more."""
    if items <= parts:
        return [min(p, items) for p in range(parts + 1)]
    size, rest = divmod(items, parts)
    return [p * size + min(p, rest) for p in range(parts + 1)]


def partition_balanced(weights: list[int], parts: int) -> list[int]:
    """DeepSpeed's ``partition_balanced``: the linear partition that minimizes the spread
    (max - min) of the parts' weights, by its dynamic program and its tie-break (the last
    split point of equal cost wins)."""
    n, m = len(weights), parts
    if n <= m:
        return partition_uniform(n, m)
    inf = float("inf")
    high = [[inf] * (m + 1) for _ in range(n + 1)]
    low = [[inf] * (m + 1) for _ in range(n + 1)]
    cost = [[inf] * (m + 1) for _ in range(n + 1)]
    position = [[0] * (m + 1) for _ in range(n + 1)]
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    high[0][0] = cost[0][0] = 0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                part = prefix[i] - prefix[k]
                hi, lo = max(high[k][j - 1], part), min(low[k][j - 1], part)
                if cost[i][j] >= hi - lo:
                    cost[i][j], high[i][j], low[i][j], position[i][j] = hi - lo, hi, lo, k
    bounds = [n]
    for j in range(m, 0, -1):
        bounds.append(position[bounds[-1]][j])
    return bounds[::-1]


def stage_bounds(layers: PipeLayers, pp: int) -> list[int]:
    """Which specs each of ``pp`` stages builds (stage p: ``[b[p], b[p+1])``), as
    ``PipelineModule(partition_method='type:transformer')`` assigns them for GPTModelPipe
    (Megatron-DeepSpeed's choice): every spec whose class name matches ``transformer``
    weighs 1, the others 0, and :func:`partition_balanced` splits the weights. Specs past
    the head (a trailing fp32 cast) only lengthen the last stage, so they are not counted."""
    weights = [int(layers.embedding < i < layers.final_norm) for i in range(layers.final_norm + 2)]
    return partition_balanced(weights, pp)


# ------------------------------------------------------------------------ writing


@dataclass(frozen=True, slots=True)
class LayerFile:
    """``layer_XX-model_TT-model_states.pt``: one layer spec's tensors at one TP rank."""


@dataclass(frozen=True, slots=True)
class StageModelFile:
    """``mp_rank_MM_model_states.pt`` of stage ``pp``, TP rank ``tp`` (with DP rank 0's
    optimizer state when the engine keeps it there: ``pads`` then set)."""

    topo: Topology
    tp: int
    pp: int
    stage: Any
    pads: list[int] | None


@dataclass(frozen=True, slots=True)
class StageOptimFile:
    """A stage's ``zero_pp_rank_R_mp_rank_MM_optim_states.pt`` of DP rank ``rank``."""

    topo: Topology
    rank: int
    stage: Any
    pads: list[int]


class PipelineWriter(Writer):
    """Writes a Megatron-DeepSpeed pipeline checkpoint (``<tag>/`` of layer files, model
    states per model-parallel rank and ZeRO-1 / BF16_Optimizer files per (DP, MP) rank) at
    a new TP, PP and DP: the ``deepspeed`` format's writer for a pipeline source (the
    registry picks it by :meth:`serves`).

    * Layer files do not depend on PP: each TP rank's file of spec ``idx`` holds the layout
      rule's shard of each entry, under the source's names and in its order.
    * Stage p builds the specs :func:`stage_bounds` gives it. Its parameters, in
      ``PipelineModule.named_parameters()`` order (the tied module, registered before the
      layers, then each spec's in state-dict order), go to the param group each parameter
      was in at the source, and :func:`~converters.deepspeed.zero.zero_partition` cuts every
      group. Both rules are checked against the source's own stages before anything is
      written.
    * A stage that builds the tied head (PP > 1) holds DeepSpeed's copy of the whole tied
      module: its word embeddings are the first stage's (a replica), and its dead
      position-embedding copy, which no forward uses and no file keeps, is written as a
      replica of the live one (weights and Adam state).
    * The non-tensor entries are the source's (model-parallel rank 0's), with the
      topology-dependent ones rewritten: ``param_shapes``, ``dp_world_size``,
      ``mp_world_size``, ``checkpoint_parallel_dimensions``, Megatron ``args``, each rank's
      RNG state (of the source rank ``(tp mod TP, pp mod PP)``: no exact RNG stream survives
      a topology change) and the partition bookkeeping of the optimizer files.
    """

    name = "deepspeed"
    canonical_source = False

    @classmethod
    def serves(cls, index: CheckpointIndex) -> bool:
        return index.layout(PipeLayout) is not None or HOOK_OBJECT in index.objects

    def __init__(self):
        self.spec = None
        self._params: dict = {}
        self.group_of: dict[str, int] = {}

    def bind(self, opened) -> None:
        adopt_hook_state(opened)  # a save-hook checkpoint of a pipeline engine

    def target_spec(self, index: CheckpointIndex, source: Topology, target: Topology,
                    true_vocab_size: int | None):
        """Refuse an impossible target (naming the rule) before anything is written."""

        layout = index.layout(PipeLayout)
        if layout.optim is None:
            raise UsageError("DeepSpeed pipeline output needs the source's ZeRO-1 or BF16_Optimizer "
                             "state, which it does not hold", path=index.url,
                             hint="Convert to megatron, megatron-dist, hf or dcp")
        for axis in ("ep", "vpp"):
            if getattr(target, axis) != 1:
                raise TopologyError(f"DeepSpeed pipeline output with {axis.upper()}"
                                    f"{getattr(target, axis)} is not supported", path=index.url)
        if target.zero != source.zero:
            raise TopologyError(f"DeepSpeed runs pipelines at ZeRO-1 (or its BF16_Optimizer); the "
                                f"stage stays {source.zero}", path=index.url, hint="Drop --to-zero")
        self.spec = target_spec(index, source, target, true_vocab_size)
        self._params = params_by_key(self.spec)
        check(self.spec, Topology(tp=target.tp))  # TP rules; PP follows DeepSpeed's, not Megatron's
        self.group_of = self._check_source(index, layout, source)
        return None

    def _check_source(self, index, layout: PipeLayout, source: Topology) -> dict[str, int]:
        """Each canonical parameter's param group, after checking that the stage rule gives
        the source's own stages and groups."""
        group_of = {}
        for mp, groups in layout.groups.items():
            for g, group in enumerate(groups):
                for name, _ in group:
                    group_of[_canonical(name, layout.layers, self._params, index.url)[0]] = g
        bounds = stage_bounds(layout.layers, source.pp)
        for p in range(source.pp):
            got = [[name for name, _ in _model_order(group, layout, source.dp)]
                   for group in layout.groups[p * source.tp]]
            want = self._groups(layout, bounds, p, group_of, len(got), index.url)
            if got != want:
                raise UsageError(f"stage {p}'s parameters are not those DeepSpeed's partition_method="
                                 f"'type:transformer' gives it at PP{source.pp} (specs "
                                 f"{bounds[p]}-{bounds[p + 1] - 1}), in named_parameters() order "
                                 f"per param group", path=index.url,
                                 hint="ckptool writes GPTModelPipe pipelines as Megatron-DeepSpeed "
                                      "partitions them")
        return group_of

    def _groups(self, layout: PipeLayout, bounds, p: int, group_of, count: int, where) -> list:
        """Stage ``p``'s param groups (parameter names in flat-buffer order)."""
        names = stage_parameters(layout, bounds[p], bounds[p + 1])
        groups = [[] for _ in range(count)]
        for name in names:
            canonical = _canonical(name, layout.layers, self._params, where)[0]
            if canonical not in group_of:
                raise UsageError(f"{name} is in no param group of the source", path=where)
            groups[group_of[canonical]].append(name)
        return groups

    def source_schema(self, opened) -> str:
        return self.name  # the layer files keep the source's names, whatever is asked

    def plan(self, index: CheckpointIndex, topo: Topology, spec=None, schema: str = "legacy",
             with_optimizer: bool = True) -> list[TargetFile]:
        if not with_optimizer:
            raise UsageError("DeepSpeed ZeRO checkpoints keep the fp32 weights in the optimizer "
                             "files, so --drop-optimizer cannot apply", path=index.url,
                             hint="Convert to hf or dcp for the weights alone")
        layout = index.layout(PipeLayout)
        padded, params, tag = self.spec.padded_vocab(topo.tp), self._params, layout.tag
        files = []
        for idx, entries in sorted(layout.entries.items()):
            for t in range(topo.tp):
                target = TargetFile(f"{tag}/layer_{idx:02d}-model_{t:02d}-model_states.pt",
                                    context=LayerFile())
                for local in entries:
                    canonical = to_canonical("legacy", layout.layers.legacy_name(idx, local),
                                             range(self.spec.num_layers), True)[0]
                    target.tensors.append(TargetTensor(("layer", local), split(params[canonical], t, topo.tp,
                                                                               padded), index.tensors[canonical].dtype))
                files.append(target)
        bounds = stage_bounds(layout.layers, topo.pp)
        count = len(layout.optim.groups)
        for p in range(topo.pp):
            names = self._groups(layout, bounds, p, self.group_of, count, index.url)
            empty = [g for g, group in enumerate(names) if not group]
            if empty:
                raise TopologyError(f"stage {p} of PP{topo.pp} would hold no parameter of param "
                                    f"group {empty[0]} (DeepSpeed's partition_method="
                                    f"'type:transformer' gives it specs {bounds[p]}-{bounds[p + 1] - 1})",
                                    path=index.url, hint="Choose a smaller --to-pp")
            for t in range(topo.tp):
                mp = p * topo.tp + t
                placed = {}
                for name in (n for group in names for n in group):
                    canonical, param = _canonical(name, layout.layers, params, index.url)[:2]
                    placed[name] = canonical, split(param, t, topo.tp, padded)
                groups = [_flat_order([(n, placed[n][1].shape) for n in group], layout, topo.dp)
                          for group in names]
                stage = replace(layout.optim, groups=groups)
                tensors, pads = _optim_tensors(stage, placed, topo.dp, 0, index, "model") \
                    if layout.model_optimizer else ([], None)  # DP rank 0's optimizer state, as DeepSpeed keeps it there
                files.append(TargetFile(f"{tag}/{MP_FILE.format(mp)}", tensors,
                                        StageModelFile(topo, t, p, stage, pads)))
                prefix = "bf16_" if stage.bf16_files else ""
                for rank in range(topo.dp):
                    tensors, pads = _optim_tensors(stage, placed, topo.dp, rank, index)
                    files.append(TargetFile(f"{tag}/{prefix}zero_pp_rank_{rank}_mp_rank_{mp:02d}_optim_states.pt",
                                            tensors, StageOptimFile(topo, rank, stage, pads)))
        return files

    def write_file(self, store, target, produce, index: CheckpointIndex,
                   true_vocab_size: int | None) -> tuple[int, str]:

        ctx = target.context
        pending = {t.name: Pending(t.name, t.shard.shape, t.dtype) for t in target.tensors}
        if isinstance(ctx, LayerFile):
            tree = OrderedDict((name[1], value) for name, value in pending.items())
        elif isinstance(ctx, StageModelFile):
            tree = self._model_states(index, ctx, pending, true_vocab_size)
        else:
            tree = _optim_tree(ctx.stage, ctx.topo, ctx.rank, ctx.pads, pending)
        return save_target(store, target, tree, produce)

    def _model_states(self, index, ctx: "StageModelFile", pending, true_vocab_size) -> dict:


        layout = index.layout(PipeLayout)
        topo, stage = ctx.topo, ctx.stage
        tree = dict(layout.model_states)
        if tree.get("param_shapes") is not None:  # BF16_Optimizer records none
            tree["param_shapes"] = [OrderedDict((n, torch.Size(s)) for n, s in group)
                                    for group in stage.groups]
        tree["dp_world_size"], tree["mp_world_size"] = topo.dp, topo.tp * topo.pp
        if isinstance(tree.get("checkpoint_parallel_dimensions"), dict):
            tree["checkpoint_parallel_dimensions"] = {**tree["checkpoint_parallel_dimensions"],
                                                      "pp_degree": topo.pp, "tp_degree": topo.tp}
        if isinstance(tree.get("args"), argparse.Namespace):  # Megatron-DeepSpeed's own spellings
            tree["args"] = update_args(tree["args"], self.spec, topo, true_vocab_size,
                                       model="megatron-deepspeed")
        if "ds_config" in tree:
            tree["ds_config"] = _pipe_config(stage, topo)
        src = index.topology
        rng = index.objects.get(f"rank.{ctx.tp % src.tp:02d}_{ctx.pp % src.pp:03d}.rng_state")
        if rng is not None:
            tree["rng_state"] = copy.deepcopy(rng.value)
        else:
            tree.pop("rng_state", None)
        if layout.model_optimizer:
            own = {name[1:]: value for name, value in pending.items()}  # ("model", g, kind)
            tree["optimizer"] = _optim_tree(stage, topo, 0, ctx.pads, own)["optimizer_state_dict"]
        tree["ckptool"] = {"version": VERSION}
        return tree

    def finalize(self, store, index: CheckpointIndex) -> list[str]:
        store.write_bytes("latest", index.layout(PipeLayout).tag.encode())
        store.write_bytes(TRACKER, str(index.iteration or 0).encode())  # Megatron-DeepSpeed's tracker
        return ["latest", TRACKER]


HOOK_OBJECT = "deepspeed.pipeline"
"""What the save hook records of a pipeline engine (``training.deepspeed.PIPELINE_OBJECT``)."""


def adopt_hook_state(opened) -> None:
    """Give a save-hook checkpoint of a Megatron-DeepSpeed pipeline engine the
    :class:`PipeLayout` its record describes (layer entries, each model-parallel rank's param
    groups, spec indices, config, step counters), with DeepSpeed's ZeRO-1 file entries as a
    fresh engine writes them, so :class:`PipelineWriter` writes it as from DeepSpeed's own
    checkpoint. The per-parameter Adam steps become their group's step (checked equal)."""
    index = opened.index
    obj = index.objects.get(HOOK_OBJECT)
    if obj is None or index.layout(PipeLayout) is not None:
        return
    where = opened.store.url
    value = opened.reader.read_object(opened.store, obj)
    record = value[0] if isinstance(value, list) and len(value) == 1 else None
    needed = ("layers", "entries", "groups", "hyper", "args", "bf16_files", "bf16_optimizer")
    if not isinstance(record, dict) or any(k not in record for k in needed):
        raise UnreadableInput(f"the hook's {HOOK_OBJECT} record is not one ckptool writes", path=where)
    bf16_optimizer = bool(record["bf16_optimizer"])  # DeepSpeed's bf16 pipelines at stage 0
    try:
        groups = {int(mp): [[(str(n), tuple(int(d) for d in shape)) for n, shape in g] for g in gs]
                  for mp, gs in record["groups"].items()}
        hyper = [dict(h) for h in record["hyper"]]
        layers = PipeLayers(*(None if v is None else int(v) for v in record["layers"]))
        entries = {int(idx): [str(n) for n in names] for idx, names in record["entries"].items()}
        if not all(type(k) is str for k in record["args"]):
            raise TypeError("args keys")
        args = argparse.Namespace(**record["args"])
    except (TypeError, ValueError, AttributeError) as exc:
        raise UnreadableInput(f"the hook's {HOOK_OBJECT} record is not one ckptool writes ({exc})",
                              path=where) from None
    if not groups or any(len(g) != len(hyper) for g in groups.values()) or len(record["layers"]) != 3:
        raise UnreadableInput("the hook's record holds no param groups for every rank", path=where)
    steps = _group_steps(opened, groups, layers)
    if index.model_config is None:  # the job's Megatron args say what the model is
        index.model_config = _asdict(spec_from_args(args, model="megatron-deepspeed")[0])
    iteration = index.iteration if index.iteration is not None else int(record.get("global_steps") or 0)
    topo = index.topology or Topology()
    version = record.get("ds_version") or "0.16.0"
    model_states = dict(  # BF16_Optimizer records no param_shapes (its state is in `optimizer`)
        module=None, buffer_names=[], optimizer=None, param_shapes=None if bf16_optimizer else [],
        frozen_param_shapes=None,
        shared_params=None, frozen_param_fragments=None, lr_scheduler=record.get("lr_scheduler"),
        data_sampler=None, random_ltd=None,
        skipped_steps=int(record.get("skipped_steps") or 0), global_steps=iteration,
        global_samples=int(record.get("global_samples") or 0), dp_world_size=topo.dp,
        mp_world_size=topo.tp * topo.pp,
        checkpoint_parallel_dimensions={"pp_degree": topo.pp, "tp_degree": topo.tp},
        ds_config=record.get("ds_config") or {},
        ds_version=version, args=args, checkpoint_version=3.0, iteration=iteration)
    from converters.deepspeed.engine import _loss_scaler, scaler_is_dynamic  # lazy: the writer's rule

    clip = float(record.get("gradient_clipping") or 0.0)
    scaler = record.get("loss_scaler")  # fp16: the dynamic scaler, in the state it was saved in
    if scaler is not None and not isinstance(scaler, dict):
        raise UnreadableInput(f"the hook's {HOOK_OBJECT} record is not one ckptool writes "
                              "(loss_scaler)", path=where)
    osd = {"clip_grad": clip, "ds_version": version} if bf16_optimizer else {
        "loss_scaler": _loss_scaler(scaler or 1.0, where),
        "dynamic_loss_scale": scaler_is_dynamic(scaler),
        "overflow": False, "clip_grad": clip, "zero_stage": 1, "ds_version": version}
    optim = Layout(
        tag=f"global_step{iteration}", stage=0 if bf16_optimizer else 1,
        bf16_files=bool(record["bf16_files"]), bf16_optimizer=bf16_optimizer,
        groups=groups[min(groups)], frozen=[], shared={}, module=[], model_states=model_states,
        optim_file={"ds_config": model_states["ds_config"], "ds_version": version}, osd=osd,
        hyper=hyper, steps=steps,  # param_slice_mappings as DeepSpeed writes them
        fragment_type=record_class("deepspeed.utils.tensor_fragment", "fragment_address"))
    index.set_layout(PipeLayout(layers, optim.tag, entries, groups, model_states, bf16_optimizer, optim))
    index.set_layout(ParamGroups(groups, hyper, steps))
    index.objects["args"] = ObjectInfo("args", value=args)
    for key in ("iteration", "global_steps", "global_samples", "skipped_steps", "lr_scheduler"):
        index.objects[key] = ObjectInfo(key, value=model_states[key])


def _group_steps(opened, groups: dict, layers: PipeLayers) -> list:
    """Each param group's Adam step, from the hook's per-parameter steps (which must agree
    within a group); the per-parameter tensors then leave the view."""
    index = opened.index
    steps: list = [None] * len(next(iter(groups.values())))
    for group_list in groups.values():
        for g, group in enumerate(group_list):
            for name, _ in group:
                found = layers.parameter(name)
                legacy = layers.legacy_name(*found) if found else None
                canonical = to_canonical("legacy", legacy, range(layers.num_layers), True)[0] \
                    if legacy else None
                info = index.tensors.get(state_key("step", canonical)) if canonical else None
                if info is None:
                    continue  # the last stage's dead copy of the tied module's other weights
                if tuple(info.shape) != () or not info.pieces:
                    raise UnreadableInput(f"the Adam step {info.key} is not a scalar",
                                          path=opened.store.url)
                value = float(opened.reader.read_piece(opened.store, info.pieces[0], info.dtype))
                if steps[g] is None:
                    steps[g] = value
                elif steps[g] != value:
                    raise UnreadableInput(f"param group {g} holds parameters at steps {steps[g]} and "
                                          f"{value}", path=opened.store.url, key=info.key)
    for key in [k for k in index.tensors if k.startswith("optimizer.state.step.")]:
        del index.tensors[key]
    return [torch.tensor(s if s is not None else 0.0) for s in steps]


def stage_parameters(layout: PipeLayout, lo: int, hi: int) -> list[str]:
    """The parameter names of a stage that builds specs ``[lo, hi)``, in
    ``PipelineModule.named_parameters()`` order: the tied module's (``tied_modules`` is
    registered before the layers; built when the stage holds the embedding or the tied
    head), then each spec's, by index, in its layer file's order."""
    layers = layout.layers
    tied = layers.head is None
    names = []
    if tied and (lo <= layers.embedding < hi or lo <= layers.final_norm + 1 < hi):
        names += [f"tied_modules.{layout.tied_key}.{n}" for n in layout.entries[layers.embedding]]
    for idx in range(lo, hi):
        if idx in layout.entries and not (tied and idx == layers.embedding):
            names += [f"{idx}.{n}" for n in layout.entries[idx]]
    return names


def _round_robin(layout) -> bool:
    """The run flattens its groups in ``round_robin_gradients`` order (ZeRO-1, not BF16_Optimizer)."""
    zero = (layout.model_states.get("ds_config") or {}).get("zero_optimization") or {}
    return bool(zero.get("round_robin_gradients")) and not layout.optim.bf16_optimizer


def _model_order(group, layout, dp: int):
    """A stage's group in the model's order (``param_shapes`` holds the flat order)."""
    return round_robin_undone(group, dp) if _round_robin(layout) else group


def _flat_order(group, layout, dp: int):
    """A stage's group (model order) in the order the engine at ``dp`` flattens it."""
    return round_robin(group, dp) if _round_robin(layout) else group


def _optim_tensors(stage, placed: dict, dp: int, rank: int, index, prefix: str | None = None):
    """One DP rank's partition of every param group of a stage: the Adam moments and the
    fp32 masters (``single_partition_of_fp32_groups`` drops the tail padding, except in
    BF16_Optimizer files), each parameter's slice cut into canonical regions by
    :func:`flat_regions`. Returns the tensors (named ``([prefix,] group, kind)``) and
    each group's padding."""

    tensors, pads = [], []
    for g, group in enumerate(stage.groups):
        shard, pad = zero_partition(group, dp, rank)
        pads.append(pad)
        for kind in (*MOMENTS, "fp32_param"):
            parts = []
            for offset, region in shard.parts:
                canonical, tshard = placed[region.key]
                parts += [(offset + at, piece) for at, piece in
                          flat_regions(tshard.parts, *region.flat, state_key(kind, canonical))]
            length = shard.shape[0] - (pad if kind == "fp32_param" and not stage.bf16_optimizer else 0)
            dtype = index.tensors[parts[0][1].key].dtype if parts else torch.float32
            name = (g, kind) if prefix is None else (prefix, g, kind)
            tensors.append(TargetTensor(name, Shard((length,), tuple(parts)), dtype))
    return tensors, pads


def _optim_tree(stage, topo: Topology, rank: int, pads: list[int], pending: dict) -> dict:
    """The plain writer's optimizer file for a stage, with the per-parameter alignment
    paddings (zeros: non-zero ones are refused on reading) of the stage's own groups."""
    tree = optim_states_tree(stage, topo, rank, pads, pending)
    osd = tree["optimizer_state_dict"]
    if "param_alignment_paddings" in osd:
        osd["param_alignment_paddings"] = [[0] * len(group) for group in stage.groups]
    if "ds_config" in tree:
        tree["ds_config"] = _pipe_config(stage, topo)
    return tree


def _pipe_config(stage, topo: Topology) -> dict:
    """The plain writer's ds_config rule (per-GPU micro batch for the new DP), the ZeRO
    stage left as the source's (a bf16 pipeline's is 0, though it reads as ZeRO-1)."""
    config = ds_config_for(stage, topo)
    source = (stage.model_states.get("ds_config") or {}).get("zero_optimization")
    if isinstance(source, dict) and "stage" in source:
        config["zero_optimization"]["stage"] = source["stage"]
    return config


def _asdict(spec) -> dict:
    return asdict(spec)


__all__ = ["is_pipeline", "read_pipeline", "PipeLayers", "PipeLayout", "PipelineWriter",
           "stage_bounds", "partition_balanced", "partition_uniform", "LAYER_FILE"]
