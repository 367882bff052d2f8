"""DeepSpeed universal checkpoints, read and written: what ``ds_to_universal.py`` makes and
what DeepSpeed loads with ``{"checkpoint": {"load_universal": true}}`` at any DP size and
ZeRO stage 1, 2 or 3 (BF16_Optimizer too; stage 0 ignores it and loads nothing).

A run root has ``latest_universal`` (the tag; DeepSpeed reads it instead of ``latest``)
and ``<tag>/`` with:

* ``zero/<param>/{fp32,exp_avg,exp_avg_sq}.pt``: per trainable parameter (tied ones once,
  under their owner), the whole fp32 master and Adam moments. ds_to_universal writes
  ``{"cat_dim": 0, "param": tensor}`` from ZeRO-1/2 and a bare flat tensor from ZeRO-3;
  every stage's loader accepts the dict and takes ``.view(-1)`` of it.
* ``zero/<param>/step.pt``: the optimizer step as it is (a bare tensor). ZeRO-1/2 loaders
  take the step from it; ds_to_universal writes none from ZeRO-3.
* ``zero/<name>/fp32.pt`` ``{"param": module[name].float()}`` for every other ``module``
  entry (frozen parameters, tied aliases, buffers): ds_to_universal's rule from ZeRO-1/2
  (from ZeRO-3 it writes none). DeepSpeed does not load them: a universal load restores
  the trainable parameters and leaves the rest to the model's own initialisation.
* ``zero/optimizer_state.pt``: rank 0's global optimizer entries and ``param_groups``.
  ZeRO-1/2 loaders read ``param_groups``, ``loss_scaler``, ``clip_grad``, ``ds_version``
  (asserted); the ZeRO-3 loader reads ``optimizer_state_dict["state"][0]["step"]`` and
  ``optimizer_state_dict["param_groups"]``.
* the model states: ZeRO-1/2 engines glob ``mp_rank_*_model_states.pt``, ZeRO-3 engines
  ``zero_pp_rank_0_mp_rank_*_model_states.pt``; only the scalars are read
  (``global_steps``, ``lr_scheduler``, ``dp_world_size``...), never ``module``.

ds_to_universal copies the source's own model states and optimizer globals, so its output
loads at the source's stage family only. ckptool writes both model-states names and both
optimizer-state forms, so its output loads at every stage.

The global view is :mod:`converters.deepspeed`'s: ``module`` entries by name,
``optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.<name>`` for trainable parameters, and
no separate ``fp32_param`` where the model states hold no weights (a ZeRO-3 origin).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
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
from ckptool.core.lazy import lazy
from ckptool.core.optimizer import state_key
from ckptool.core.regions import Region, Shard
from ckptool.core.storage import Store, pointed_dir
from ckptool.core.topology import Topology
from ckptool.core.torchfile import Pending, TensorRef
from ckptool.core.torchreader import save_target
from converters.deepspeed.pipe import PipeLayout
from converters.deepspeed.zero import (
    MARK,
    Layout,
    ZeroReader,
    add_region,
    int_or_none,
    param_groups,
    source_state_key,
    zero3_partition,
)
from converters.schemas.hf import CONFIG

torch = lazy("torch", globals())

NAME = "deepspeed-universal"
LATEST_UNIVERSAL = "latest_universal"
ZERO = "zero"
OPTIMIZER_STATE = "optimizer_state.pt"
MP_STATES = "mp_rank_00_model_states.pt"
ZERO3_STATES = "zero_pp_rank_{}_mp_rank_00_model_states.pt"
PARAM, CAT_DIM = "param", "cat_dim"
FILES = {"fp32_param": "fp32", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
"""Global-view kind -> file stem under ``zero/<param>/``."""


def _tag(store: Store) -> str:
    """The directory (relative) that holds ``zero/``: the store itself or ``latest_universal``'s tag."""
    if store.isdir(ZERO):
        return ""
    tag = pointed_dir(store, LATEST_UNIVERSAL)
    if tag is not None and store.isdir(f"{tag}/{ZERO}"):
        return tag
    raise UnreadableInput("no DeepSpeed universal checkpoint (zero/ directory) found", path=store.url)


class UniversalReader(ZeroReader):
    """Reads ckptool's and ds_to_universal's output (mp=1). ``canonical`` (an HF model's
    names, ``config.json`` beside ``latest_universal``) is the DeepSpeed reader's: both are
    :class:`~converters.deepspeed.zero.ZeroReader`."""

    name = NAME

    @classmethod
    def detect(cls, store: Store) -> bool:
        try:
            _tag(store)
        except UnreadableInput:
            return False
        return True

    def accepts_non_dict(self, rel: str) -> bool:
        return f"{ZERO}/" in rel  # step.pt and ZeRO-3's fp32.pt are bare tensors

    def read_index(self, store: Store) -> CheckpointIndex:
        tag = _tag(store)
        join = (lambda n: f"{tag}/{n}") if tag else (lambda n: n)
        names = {n for n, d in store.ls(tag) if not d}
        if any(n.endswith("_model_states.pt") and "mp_rank_00" not in n for n in names):
            raise UnreadableInput("model-parallel universal checkpoints (mp_rank > 00) are not "
                                  "supported yet", path=store.display(tag))
        first = next((join(n) for n in (MP_STATES, ZERO3_STATES.format(0)) if n in names), None)
        if first is None:
            raise BadCheckpoint("the model-states file is missing (mp_rank_00_model_states.pt or "
                                "zero_pp_rank_0_mp_rank_00_model_states.pt)", path=store.display(tag))
        archive = self._load(store, first)
        ms = archive.obj
        module = ms.get("module")
        if not isinstance(module, dict) or not all(isinstance(v, TensorRef) for v in module.values()):
            raise BadCheckpoint("model states have no `module` state dict of tensors",
                                path=store.display(first))
        groups = param_groups(ms)
        if not groups:
            raise BadCheckpoint("model states have no param_shapes", path=store.display(first))
        index = CheckpointIndex(format=NAME, url=store.url, topology=Topology(),
                                iteration=int_or_none(ms.get("global_steps")),
                                format_version=str(ms.get("ds_version") or "") or None,
                                written_by_ckptool=MARK in ms)
        for key in ("global_steps", "global_samples", "skipped_steps", "lr_scheduler", "ds_config"):
            if key in ms:
                index.objects[key] = ObjectInfo(key, value=archive.materialize(ms[key]))
        name, shape = groups[0][0]
        # the model states hold the weights (a ZeRO-1/2 origin), else the masters are them
        weights = name in module and module[name].numel == math.prod(shape)
        optim_rel = join(f"{ZERO}/{OPTIMIZER_STATE}")
        osd = self._load(store, optim_rel).obj
        index.files[optim_rel] = 1
        hyper = osd.get("param_groups")
        if not isinstance(hyper, list) or len(hyper) != len(groups) \
                or not all(isinstance(h, dict) for h in hyper):
            raise BadCheckpoint(f"optimizer_state.pt has no param_groups for the {len(groups)} "
                                "groups of param_shapes", path=store.display(optim_rel))
        steps = [self._step(store, join, g, group, osd) for g, group in enumerate(groups)]
        for group in groups:
            for name, shape in group:
                for kind, stem in FILES.items():
                    key = state_key(kind, name) if weights or kind != "fp32_param" else name
                    self._add_whole(store, index, join(f"{ZERO}/{name}/{stem}.pt"), key, shape)
        index.objects["optimizer.step"] = ObjectInfo("optimizer.step", value=steps)
        index.objects["optimizer.param_groups"] = ObjectInfo("optimizer.param_groups", value=[
            {k: v for k, v in self._load(store, optim_rel).materialize(h).items() if k != "params"}
            for h in hyper])
        self._read_module(store, index, join, names, first, ms, {n for g in groups for n, _ in g},
                          weights)
        return index

    def _tensor(self, store: Store, rel: str) -> tuple[TensorRef, tuple]:
        """The tensor of a ``zero/`` file: the ``param`` entry, or the file's bare tensor."""
        obj = self._load(store, rel).obj
        if isinstance(obj, TensorRef):
            return obj, ()
        if isinstance(obj, dict) and isinstance(obj.get(PARAM), TensorRef):
            return obj[PARAM], (PARAM,)
        raise BadCheckpoint("file holds no tensor (nor a dict with one under 'param')",
                            path=store.display(rel))

    def _add_whole(self, store, index, rel, key, shape) -> None:
        """``rel`` holds all of ``key`` (as shaped, or flat as ZeRO-3's ds_to_universal writes)."""
        ref, path = self._tensor(store, rel)
        n = math.prod(shape)
        if tuple(ref.shape) == tuple(shape):
            region = Region.whole(key, shape)
        elif ref.numel == n and len(ref.shape) == 1:
            region = Region.whole(key, shape, (0, n))
        else:
            raise BadCheckpoint(f"tensor is {list(ref.shape)}, param_shapes say {list(shape)}",
                                path=store.display(rel), key=key)
        add_region(index, key, ref, region, rel, path, 0)

    def _step(self, store, join, g, group, osd):
        """Param group ``g``'s optimizer step: its parameters' ``step.pt`` (all equal), else the
        ZeRO-3 globals' ``optimizer_state_dict``, else None (the optimizer keeps no step)."""
        found = []
        for name, _ in group:
            rel = join(f"{ZERO}/{name}/step.pt")
            if store.exists(rel):
                archive = self._load(store, rel)
                found.append((rel, archive.materialize(archive.obj)))
        for rel, value in found[1:]:
            if not _same(value, found[0][1]):
                raise BadCheckpoint(f"step differs from {found[0][0]}'s within param group {g}",
                                    path=store.display(rel))
        if found:
            return found[0][1]
        state = (osd.get("optimizer_state_dict") or {}).get("state") or {}
        step = (state.get(g) or {}).get("step")
        archive = self._load(store, join(f"{ZERO}/{OPTIMIZER_STATE}"))
        return archive.materialize(step)

    def _read_module(self, store, index, join, names, first, ms, trainable, weights) -> None:
        """``module`` entries: the weights where the model states hold them, aliases as
        replicas of their owners, buffers; frozen parameters from ``module``, else (a ZeRO-3
        origin: empty entries) from ``zero/<name>/fp32.pt`` or ``frozen_param_fragments``."""
        shared = dict(ms.get("shared_params") or {})
        buffers = set(ms.get("buffer_names") or ())
        frozen_shapes = dict(ms.get("frozen_param_shapes") or {})
        for name, ref in ms["module"].items():
            owner = shared.get(name)
            if owner is not None or (name in trainable and not weights):
                if owner is not None and ref.numel:
                    add_region(index, owner, ref, Region.whole(owner, ref.shape), first, ("module", name), 0,
                         replica=True)
                continue  # an alias, or a weight whose master is the weight itself
            if ref.numel or name in trainable or name in buffers:
                add_region(index, name, ref, Region.whole(name, ref.shape), first, ("module", name), 0)
                continue
            shape = tuple(frozen_shapes.get(name) or ())
            rel = join(f"{ZERO}/{name}/fp32.pt")
            if not shape:
                raise BadCheckpoint("frozen parameter is empty in the model states and has no "
                                    "frozen_param_shapes entry", path=store.display(first), key=name)
            if store.exists(rel):
                self._add_whole(store, index, rel, name, shape)
            else:
                self._read_frozen_fragments(store, index, join, names, name, shape)

    def _read_frozen_fragments(self, store, index, join, names, name, shape) -> None:
        """A frozen parameter of a ZeRO-3 origin, cut across the copied rank files."""
        rels = []
        while ZERO3_STATES.format(len(rels)) in names:
            rels.append(join(ZERO3_STATES.format(len(rels))))
        for rank, rel in enumerate(rels):
            ref = (self._load(store, rel).obj.get("frozen_param_fragments") or {}).get(name)
            shard = zero3_partition([(name, shape)], len(rels), rank)
            if not isinstance(ref, TensorRef) or ref.numel != shard.shape[0]:
                raise BadCheckpoint(f"frozen parameter is in no zero/ file and its fragment is not "
                                    f"this rank's ZeRO-3 slice ({shard.shape[0]} elements)",
                                    path=store.display(rel), key=name)
            for offset, region in shard.parts:
                add_region(index, name, ref, region, rel, ("frozen_param_fragments", name), offset)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


# ------------------------------------------------------------------------- writing


@dataclass(frozen=True, slots=True)
class TreeFile:
    """One file of the universal layout: the object tree written, its tensors ``Pending``
    (converted to ``dtype`` as they are produced, when set)."""

    tree: Any
    dtype: torch.dtype | None = None


class UniversalWriter(Writer):
    """Writes a universal run root from a DeepSpeed ZeRO-1/2/3 checkpoint: every tensor whole,
    so there is no DP size or stage to choose."""

    name = NAME
    reshards = False
    canonical_source = False  # the module's own names, as DeepSpeed loads them
    _config: bytes | None = None

    def bind(self, opened) -> None:
        """An HF Trainer run's config.json goes beside ``latest_universal`` too."""
        if opened.store.exists(CONFIG):
            self._config = opened.store.read_small(CONFIG)

    def target_topology(self, source: Topology, changes: dict) -> Topology:
        if changes:
            flags = ", ".join(f"--{k}" for k in changes)
            raise TopologyError(f"{flags} does not apply to {NAME} output: it holds every tensor "
                                "whole and DeepSpeed loads it at any DP size and ZeRO stage 1-3",
                                hint="Drop the topology flags")
        if source.tp != 1 or source.pp != 1:
            raise TopologyError(f"{NAME} output from a {source} source is not supported yet",
                                hint="Only mp=1 engines without pipeline are written")
        return Topology()

    def target_spec(self, index, source, target, true_vocab_size):
        if index.layout(PipeLayout) is not None:
            raise UsageError(f"writing {NAME} from DeepSpeed pipeline checkpoints (layer files) is "
                             "not supported yet", path=index.url)
        if index.layout(Layout) is None:
            raise UsageError(f"{NAME} output is written only from a DeepSpeed ZeRO-1/2/3 checkpoint, "
                             f"not from {index.format}", path=index.url,
                             hint="A stage-0 checkpoint holds no ZeRO optimizer layout to convert")
        layout = index.layout(Layout)
        names = [n for group in layout.groups for n, _ in group]
        if any(source_state_key(index, "fp32_param", n) not in index.tensors for n in names):
            raise UsageError(f"the source's optimizer state does not hold an fp32 master of every "
                             f"trainable parameter, which {NAME} output needs", path=index.url)
        return None

    def source_schema(self, opened) -> str:
        return NAME

    def plan(self, index: CheckpointIndex, topo: Topology, spec, schema: str,
             with_optimizer: bool = True) -> list[TargetFile]:
        if not with_optimizer:
            raise UsageError(f"{NAME} checkpoints restore the weights from the fp32 masters, so "
                             "--drop-optimizer cannot apply", path=index.url,
                             hint="Convert to hf or dcp for the weights alone")
        layout = index.layout(Layout)
        zero = f"{layout.tag}/{ZERO}"
        files = [self._model_file(f"{layout.tag}/{MP_STATES}", index, layout, layout.stage < 3),
                 self._model_file(f"{layout.tag}/{ZERO3_STATES.format(0)}", index, layout, False),
                 TargetFile(f"{zero}/{OPTIMIZER_STATE}", context=TreeFile(_optimizer_state(layout)))]
        for g, group in enumerate(layout.groups):
            for name, shape in group:
                for kind, stem in FILES.items():
                    key = source_state_key(index, kind, name)
                    files.append(_whole_file(f"{zero}/{name}/{stem}.pt", index, key, shape,
                                             {CAT_DIM: 0}))
                files.append(TargetFile(f"{zero}/{name}/step.pt", context=TreeFile(layout.steps[g])))
        for name, shape, _ in layout.module:  # frozen, aliases, buffers: ds_to_universal's rule
            if name not in layout.trainable:
                key = layout.shared.get(name, name)
                files.append(_whole_file(f"{zero}/{name}/fp32.pt", index, key,
                                         index.tensors[key].shape, {}))
        return files

    def _model_file(self, path, index, layout: Layout, weights: bool) -> TargetFile:
        """Model states: the source's entries; ``module`` with the weights (``weights``) or,
        as ZeRO-3 writes it, with empty parameters and the buffers only."""
        tensors = []
        module = OrderedDict()
        for name, shape, dtype in layout.module:
            if not weights and name in layout.params:
                module[name] = torch.empty(0, dtype=dtype)
                continue
            key = layout.shared.get(name, name)
            info = index.tensors[key]
            shard = Shard.of(Region.whole(key, info.shape))
            tensors.append(TargetTensor(name, shard, info.dtype))
            module[name] = Pending(name, info.shape, info.dtype)
        tree = dict(layout.model_states)
        tree.update(module=module, frozen_param_fragments=None, **{MARK: {"version": VERSION}},
                    param_shapes=[OrderedDict((n, torch.Size(s)) for n, s in group)
                                  for group in layout.groups])  # DeepSpeed calls .numel() on them
        return TargetFile(path, tensors, TreeFile(tree))

    def write_file(self, store: Store, target: TargetFile, produce, index: CheckpointIndex,
                   true_vocab_size: int | None) -> tuple[int, str]:
        ctx: TreeFile = target.context
        fill = (lambda t: produce(t).to(ctx.dtype)) if ctx.dtype is not None else produce
        return save_target(store, target, ctx.tree, fill)

    def finalize(self, store: Store, index: CheckpointIndex) -> list[str]:
        store.write_bytes(LATEST_UNIVERSAL, index.layout(Layout).tag.encode())
        if self._config is None:
            return [LATEST_UNIVERSAL]
        store.write_bytes(CONFIG, self._config)
        return [LATEST_UNIVERSAL, CONFIG]

    def notes(self, index: CheckpointIndex) -> list[str]:
        return ['load it with {"checkpoint": {"load_universal": true}} in the DeepSpeed config, '
                "at any DP size and ZeRO stage 1-3; DeepSpeed restores the trainable parameters "
                "and optimizer from it, frozen parameters and buffers from the model's own init"]


def _whole_file(path: str, index: CheckpointIndex, key: str, shape, head: dict) -> TargetFile:
    """A ``zero/`` file: ``{**head, "param": <all of key, as fp32>}``."""
    info = index.tensors[key]
    return TargetFile(path, [TargetTensor(PARAM, Shard.of(Region.whole(key, info.shape)), info.dtype)],
                      TreeFile({**head, PARAM: Pending(PARAM, tuple(shape), torch.float32)}, torch.float32))


def _optimizer_state(layout: Layout) -> dict:
    """``zero/optimizer_state.pt``: rank 0's global entries, in the form of each stage's loader.

    DeepSpeed 0.19.8's ZeRO-3 loader sets ``optimizer_state_dict["param_groups"][0]`` on
    every group, which would give every group the first one's weight decay: its form holds
    only the hyperparameters all groups share, the others stay as the job configures them.
    """
    osd = dict(layout.osd)
    config = layout.model_states.get("ds_config") or {}
    osd.setdefault("clip_grad", float(config.get("gradient_clipping", 0.0)))
    osd.setdefault("ds_version", layout.model_states.get("ds_version"))
    shared = {k: v for k, v in layout.hyper[0].items()
              if all(k in h and _same(h[k], v) for h in layout.hyper)} if layout.hyper else {}
    osd["optimizer_state_dict"] = {
        "state": {g: {"step": step} for g, step in enumerate(layout.steps)},
        "param_groups": [dict(shared, params=[g]) for g in range(len(layout.groups))]}
    osd["param_groups"] = [dict(h, params=[g]) for g, h in enumerate(layout.hyper)]
    return osd


__all__ = ["UniversalReader", "UniversalWriter", "NAME", "LATEST_UNIVERSAL"]
