"""DeepSpeed pipeline checkpoints as Megatron-DeepSpeed writes them (``GPTModelPipe``), read.

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
  groups cut by :func:`~converters.deepspeed.zero_partition`, at ZeRO-1, or from
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
does (:mod:`converters.megatron_common`, :mod:`converters.megatron_ranks`).

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
from dataclasses import dataclass

from ckptool.core.errors import BadCheckpoint, UnreadableInput
from ckptool.core.index import CheckpointIndex, ObjectInfo
from ckptool.core.layout import WORD_EMBEDDINGS, split
from ckptool.core.regions import Region
from ckptool.core.topology import Topology
from converters.megatron_common import params_by_key, spec_from_args, to_canonical
from converters.megatron_optimizer import state_key
from converters.megatron_ranks import add_piece, check_legacy_schema

LAYER_FILE = re.compile(r"^layer_(\d+)(?:-model_(\d+))?-model_states\.pt$")
MP_FILE = "mp_rank_{:02d}_model_states.pt"
PIPELINE_KEY = "deepspeed.pipeline"
_TIED = re.compile(r"^tied_modules\.[^.]+\.(.+)$")
_PARAM = re.compile(r"^(\d+)\.(.+)$")
_CARRIED = ("iteration", "checkpoint_version", "tokens", "global_steps", "global_samples",
            "skipped_steps", "lr_scheduler", "ds_config")
MOMENTS = ("exp_avg", "exp_avg_sq")


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


def megatron_args(args: argparse.Namespace) -> argparse.Namespace:
    """Megatron-DeepSpeed's args under Megatron-LM's spellings, which the shared layout
    rules read: ``normalization`` ``layernorm``/``rmsnorm`` -> ``LayerNorm``/``RMSNorm``,
    ``add_position_embedding`` / ``use_rotary_position_embeddings`` ->
    ``position_embedding_type``, ``num_key_value_heads`` -> ``num_query_groups``."""
    out = copy.copy(args)
    norm = str(getattr(args, "normalization", "") or "")
    out.normalization = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}.get(norm.lower(), norm or "LayerNorm")
    if not hasattr(args, "position_embedding_type"):
        rotary = getattr(args, "use_rotary_position_embeddings", False)
        learned = getattr(args, "add_position_embedding", True) and not rotary
        out.position_embedding_type = "learned_absolute" if learned else ("rope" if rotary else "none")
    kv = getattr(args, "num_key_value_heads", None)
    if kv and not getattr(args, "group_query_attention", False) and kv != args.num_attention_heads:
        out.group_query_attention, out.num_query_groups = True, int(kv)
    return out


@dataclass
class _Rank:
    """A file read as one TP rank's (``add_piece``'s view of a rank file)."""

    tp: int
    rel: str


def read_pipeline(reader, store, tag: str, names: list[str]) -> CheckpointIndex:
    """The canonical global view of a pipeline checkpoint in ``tag`` (``names``: its files)."""
    from converters.deepspeed import _OPTIM, _add, _int, _ranks, _stage

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
    args = megatron_args(raw_args)
    spec, topo, vocab_known = spec_from_args(args)
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
    optim = {(int(m.group(2)), int(m.group(3))): join(n) for n in names if (m := _OPTIM.match(n))}
    osd0 = None
    if optim:
        osd0 = reader._load(store, optim[min(optim)]).obj.get("optimizer_state_dict")
    stage = _stage(osd0, ms)
    index = CheckpointIndex(format="deepspeed", url=store.url,
                            topology=Topology(tp=topo.tp, pp=topo.pp, dp=dp, zero=stage),
                            model_config=_asdict(spec), true_vocab_size=spec.vocab_size if vocab_known else None,
                            iteration=_int(ms.get("iteration", ms.get("global_steps"))),
                            format_version=str(ms.get("ds_version") or "") or None,
                            written_by_ckptool="ckptool" in ms)
    index.objects["args"] = ObjectInfo("args", value=args)
    index.objects[PIPELINE_KEY] = ObjectInfo(PIPELINE_KEY, value=layers)
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
                rels = _ranks({r: f for (r, m), f in optim.items() if m == mp}, dp, "optimizer", where)
                _read_optimizer(reader, store, index, rel, rels, mp, layers, params, padded, topo, _add)
        except UnreadableInput as exc:  # the weights stay readable; nothing half-mapped
            index.unmapped = exc.message
            for key in [k for k in index.tensors if k.startswith("optimizer.")]:
                del index.tensors[key]
    for key, info in index.tensors.items():
        if not info.pieces:
            raise BadCheckpoint("tensor has only replicas, no primary copy", path=where, key=key)
    return index


def _pipe_layers(layer_files: dict, spec, topo, where: str) -> PipeLayers:
    """Which spec index is which module, checked against the files found: the embedding is
    the first file, then ``num_layers`` layers, the final norm and, untied, the head."""
    indices = sorted({idx for idx, _ in layer_files})
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
    for idx in indices:
        ranks = sorted(tp for i, tp in layer_files if i == idx)
        if ranks != list(range(topo.tp)):
            raise BadCheckpoint(f"layer {idx:02d} has files for TP ranks {ranks}, args say TP{topo.tp}",
                                path=where)
    return PipeLayers(indices[0], spec.num_layers, indices[-1] if not spec.tied_embeddings else None)


def _read_optimizer(reader, store, index, ms_rel, rels, mp, layers: PipeLayers, params, padded,
                    topo, add) -> None:
    """ZeRO-1: every DP rank's partition of model-parallel rank ``mp``'s param groups. Each
    parameter's flat range of the partition is cut into the canonical regions its TP shard
    holds (the same rule as its weight)."""
    from converters.deepspeed import zero_partition

    tp_rank, pp_rank = mp % topo.tp, mp // topo.tp
    ms = reader._load(store, ms_rel).obj
    source = store.display(ms_rel)
    groups = [[(n, tuple(s)) for n, s in g.items()] for g in ms.get("param_shapes") or []]
    if not groups:  # BF16_Optimizer at stage 0 records no param_shapes: its slice mappings
        groups = _groups_from_mappings(reader, store, rels, layers, pp_rank, tp_rank, params,
                                       padded, topo, source)
    where = {}
    for name, shape in (p for g in groups for p in g):
        where[name] = _place(name, shape, layers, pp_rank, tp_rank, params, padded, topo, source)
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
                    a, b = region.flat
                    for local_offset, box in parts:
                        lo, hi = max(a, local_offset), min(b, local_offset + box.numel)
                        if lo < hi:
                            key = state_key(kind, canonical)
                            add(index, key, ref, Region(key, box.global_shape, box.offsets, box.lengths,
                                                        (lo - local_offset, hi - local_offset)),
                                rel, ("optimizer_state_dict", *path), offset + lo - a, replica=replica)


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


def _place(name, shape, layers: PipeLayers, pp_rank, tp_rank, params, padded, topo, source):
    """(canonical key, is a replica, TP shard parts) of a stage's parameter, or None for
    the last stage's dead copy of the tied embedding module's other weights."""
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
    return canonical, replica, tshard.parts


def _asdict(spec) -> dict:
    from dataclasses import asdict

    return asdict(spec)


__all__ = ["is_pipeline", "read_pipeline", "PipeLayers", "megatron_args", "LAYER_FILE", "PIPELINE_KEY"]
