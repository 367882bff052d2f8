"""Megatron's distributed optimizer state (``distrib_optim.pt``), mapped to parameters.

Not a format: the rules shared by the Megatron reader and writer, written once.

Beside each ``model_optim_rng.pt`` of a (TP, PP) rank, DP rank 0 writes (Megatron-Core
``DistributedOptimizer.save_parameter_state``, the "coalesced" form used since 2024)::
    {"buckets_coalesced": True,
     gbuf: {(param_dtype, grad_dtype): {"param": fp32 1-D, "exp_avg": fp32 1-D,
                                        "exp_avg_sq": fp32 1-D, "numel_unpadded": int}}}

``gbuf`` numbers the grad buffers: model chunk 0's, then chunk 1's (virtual pipeline);
a chunk has one buffer per parameter dtype, in first-seen ``named_parameters()`` order.
The file holds no names and no shapes, so the map from parameters to elements is rebuilt
from Megatron's buffer rule (``_ParamAndGradBuffer``), in file coordinates:

* a buffer holds its parameters in **reverse** ``named_parameters()`` order;
* each parameter starts at a multiple of 64 elements from its bucket's start; the gaps
  are stored (as zeros);
* a bucket closes after the parameter that brings it to ``>= bucket_size`` elements; the
  tied word embedding at PP > 1 (``shared_embedding``) gets a bucket of its own (the open
  bucket closes before it, at the 64-aligned start);
* each bucket's tail padding (to ``lcm(DP, 128)``) is cut out of the file, so buckets
  follow one another and neither the DP size nor ``pad_buckets_for_high_nccl_busbw``
  shows;
* ``bucket_size`` is None (one bucket) unless ``overlap_grad_reduce``; it is also None on
  pipeline ranks > 0, on virtual chunks > 0 and with
  ``overlap_param_gather_with_optimizer_step``; otherwise ``ddp_bucket_size``, by default
  ``max(4e7, 1e6 * DP)`` (DP without context parallelism).

``numel_unpadded`` checks the result. The Adam step and the param groups are in
``model_optim_rng.pt["optimizer"]`` (``DistributedOptimizer.state_dict()``). What the rule
cannot fix (missing args, a size that does not add up, pre-2024 files) is refused with
the reason, never mapped by guess.

Mixture of Experts at EP > 1: the experts (``allreduce=False``) have grad buffers of their
own, sharded over the expert-data-parallel group, and a DistributedOptimizer of their own
in a ``ChainedOptimizer`` [dense, expert]. ``distrib_optim.pt`` is then the list of the two
states, each in the form above over its own parameters (same bucket size), ``None`` where
the writing rank is not DP rank 0 of that group (the dense state lives in the EP rank 0
directories); ``model_optim_rng.pt["optimizer"]`` is the list of the two state dicts. At
EP1 the experts are ordinary parameters of the one buffer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterable

from ckptool.core.errors import UnreadableInput
from ckptool.core.layout import WORD_EMBEDDINGS, LocalTensor, ModelSpec, expert_of, stage_layers
from ckptool.core.layout import layout as model_layout
from ckptool.core.lazy import lazy
from ckptool.core.topology import Topology
from converters.schemas.megatron import SCHEMAS, parameter_order

torch = lazy("torch", globals())

ALIGN = 64
"""Parameter starts are padded to this many elements from their bucket's start."""
DEFAULT_BUCKET = 40_000_000
FILE_KEYS = {"fp32_param": "param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
"""Canonical kind (``optimizer.state.<kind>.<param>``) -> key in the file."""
HINT = "Pass --drop-optimizer to carry the weights only"
"""For callers that refuse because of these rules (the errors here name only the cause)."""


@dataclass(frozen=True, slots=True)
class Param:
    """One parameter of a rank file, as the buffer rule needs it."""

    name: str
    numel: int
    dtype: torch.dtype
    shared: bool = False
    """Megatron's ``shared_embedding`` (see :func:`shared_embedding`)."""


@dataclass(frozen=True, slots=True)
class Buffer:
    """One grad buffer of a rank: where each parameter starts in the file's tensors."""

    chunk: int
    dtype: torch.dtype
    """The parameters' dtype (the first half of the file's key)."""
    offsets: dict[str, int]
    numel_unpadded: int
    bucket_size: int | None
    buckets: tuple[int, ...] = ()
    """Each bucket's length in the file's tensors (tail padding cut), in order."""


@dataclass(slots=True)
class Meta:
    """The layout record of a distributed optimizer's source: what a writer needs besides
    the tensors."""

    keys: dict[torch.dtype, tuple]
    """Parameter dtype -> the file's ``(param_dtype, grad_dtype)`` key."""
    state: dict
    """``model_optim_rng.pt["optimizer"]``: param groups (with the step), grad scaler."""
    sharding: str | None = None
    """The ``torch_dist`` source's ``param_state_sharding_type``; None for ``distrib_optim.pt``,
    :data:`HOOK_SHARDING` for a save-hook checkpoint."""
    expert_state: dict | None = None
    """The expert DistributedOptimizer's state dict of an EP > 1 source (ChainedOptimizer)."""


@dataclass(frozen=True, slots=True)
class RankParams:
    """One (TP, PP) rank's parameters as its grad buffers see them."""

    tp: int
    pp: int
    chunks: list[list[Param]]
    """Each model chunk's parameters in named_parameters() order; ``Param.name`` is
    ``"<chunk>/<local name>"``."""
    tensors: dict[str, LocalTensor]
    """``Param.name`` -> the layout's local tensor (its canonical regions), in the same order."""
    ep: int = 0
    """Expert-parallel rank (its files hold that rank's experts)."""

    def named(self) -> list[tuple[int, str, LocalTensor]]:
        """``(chunk, local name, local tensor)`` of every parameter, in named_parameters() order."""
        return [(t.chunk, name.split("/", 1)[1], t) for name, t in self.tensors.items()]

    def optimizer_chunks(self, chained: bool) -> list[list[list[Param]]]:
        """The chunks of each of the rank's distributed optimizers' grad buffers: ``[all]``,
        or for a ChainedOptimizer (experts at EP > 1) ``[dense, expert]`` (:func:`split_experts`)."""
        if not chained:
            return [self.chunks]
        return split_experts(self.chunks, lambda name: expert_of(self.tensors[name].name) is not None)


def rank_params(spec: ModelSpec, topo: Topology, schema: str,
                dtype_of: Callable[[LocalTensor], torch.dtype]) -> list[RankParams]:
    """Every (TP, PP) rank's parameters under ``schema``'s names, in the order Megatron
    registers them (which its grad buffers follow, reversed)."""
    stages = stage_layers(spec, topo.pp, topo.vpp)
    out = []
    for rank in model_layout(spec, topo):
        named = []
        for t in rank.tensors:
            layers = stages[rank.pp_rank][t.chunk]
            name = SCHEMAS[schema].from_canonical(t.name, layers, rank.pp_rank, topo.pp, t.replica)
            named.append((t.chunk, parameter_order(schema, name), f"{t.chunk}/{name}", t))
        named.sort(key=lambda x: (x[0], x[1]))
        chunks = chunk_params(((chunk, uname, t.name, math.prod(t.shard.shape), dtype_of(t))
                               for chunk, _, uname, t in named), spec.tied_embeddings, topo.pp)
        tensors = {uname: t for _, _, uname, t in named}
        assert len(tensors) == len(named), "a schema gives two parameters of a rank one name"
        out.append(RankParams(rank.tp_rank, rank.pp_rank, chunks, tensors, rank.ep_rank))
    return out


def chunk_params(entries: Iterable[tuple[Hashable, str, str, int, torch.dtype]], tied: bool,
                 pp: int) -> list[list[Param]]:
    """Each model chunk's parameters, from ``(chunk, name, canonical name, numel, dtype)``
    in named_parameters() order, chunk after chunk."""
    chunks: dict[Hashable, list[Param]] = {}
    for chunk, name, canonical, numel, dtype in entries:
        chunks.setdefault(chunk, []).append(
            Param(name, numel, dtype, shared_embedding(canonical, tied, pp)))
    return list(chunks.values())


def shared_embedding(canonical: str, tied: bool, pp: int) -> bool:
    """Megatron marks the word embeddings ``shared_embedding`` (both the first stage's and
    the last stage's copy) when they are tied to the output layer and PP > 1."""
    return tied and pp > 1 and canonical == WORD_EMBEDDINGS


def bucket_size(args: Any, dp: int, pp_rank: int, chunk: int) -> int | None:
    """The bucket size of one model chunk's buffers (None: one bucket), from Megatron args.

    Raises UnreadableInput naming the field when the args do not say.
    """
    if pp_rank > 0 or chunk > 0:
        return None
    if not hasattr(args, "overlap_grad_reduce"):
        raise UnreadableInput("Megatron args lack overlap_grad_reduce, which decides the "
                              "bucket boundaries of distrib_optim.pt")
    if not args.overlap_grad_reduce or getattr(args, "overlap_param_gather_with_optimizer_step",
                                               False):
        return None
    if not hasattr(args, "ddp_bucket_size"):
        raise UnreadableInput("Megatron args lack ddp_bucket_size, which decides the bucket "
                              "boundaries of distrib_optim.pt")
    return int(args.ddp_bucket_size) if args.ddp_bucket_size is not None else \
        max(DEFAULT_BUCKET, 1_000_000 * dp)


def offsets(params: list[Param], size: int | None) -> tuple[dict[str, int], int]:
    """Where each of ``params`` (one buffer, named_parameters() order) starts in the file's
    coalesced tensors, and their length (``numel_unpadded``)."""
    where, lengths = _walk(params, size)
    return where, sum(lengths)


def _walk(params: list[Param], size: int | None) -> tuple[dict[str, int], list[int]]:
    """:func:`offsets`, and the length of each bucket (tail padding cut)."""
    out: dict[str, int] = {}
    lengths: list[int] = []  # the closed buckets'
    pos = 0  # next element, from the open bucket's start
    count = 0  # parameters in the open bucket
    for p in reversed(params):
        pos = -(-pos // ALIGN) * ALIGN
        if p.shared and count:
            lengths.append(pos)
            pos, count = 0, 0
        out[p.name] = sum(lengths) + pos  # few buckets: the sum is cheap
        pos += p.numel
        count += 1
        if p.shared or (size is not None and pos >= size):
            lengths.append(pos)
            pos, count = 0, 0
    if count:
        lengths.append(pos)
    return out, lengths


def layout(chunks: list[list[Param]], args: Any, dp: int, pp_rank: int) -> list[Buffer]:
    """The buffers of one (TP, PP) rank, in the file's order.

    ``chunks`` holds each model chunk's parameters in named_parameters() order; ``dp`` is
    the data-parallel size without context parallelism. When the args do not fix the buckets, the layout is still known if every size is a multiple of
    64 (no gaps: the file is the plain reversed concatenation); otherwise it is refused.
    """
    buffers = []
    for chunk, params in enumerate(chunks):
        try:
            size = bucket_size(args, dp, pp_rank, chunk)
        except UnreadableInput as exc:
            if any(p.numel % ALIGN for p in params):
                raise UnreadableInput(exc.message + ", and with parameter sizes that are not "
                                      "multiples of 64 the layout depends on it") from None
            size = None
        for dtype in dict.fromkeys(p.dtype for p in params):
            mine = [p for p in params if p.dtype == dtype]
            where, lengths = _walk(mine, size)
            buffers.append(Buffer(chunk, dtype, where, sum(lengths), size, tuple(lengths)))
    return buffers


GROUP_KEYS = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")
"""How Megatron-Core's DistributedOptimizer.load_state_dict matches a stored param group to
its own (``param_group_identifier_keys``)."""


def optimizers(obj: Any, expert_parallel: bool, source: str) -> list:
    """The optimizer states a ``distrib_optim.pt`` (or a ``model_optim_rng.pt["optimizer"]``)
    holds: ``[the one]``, or at EP > 1 ``[dense, expert]`` (either may be None in a file)."""
    if not expert_parallel:
        if isinstance(obj, list):
            raise UnreadableInput("the distributed optimizer holds the states of several "
                                  "optimizers, but the args say EP1", path=source)
        return [obj]
    if not (isinstance(obj, list) and len(obj) == 2):
        raise UnreadableInput("at EP > 1 Megatron's ChainedOptimizer stores a list of two "
                              "optimizer states (dense, expert); this is not one", path=source)
    return obj


def split_experts(chunks: list[list[Param]], is_expert: Callable[[str], bool]) -> list[list[list[Param]]]:
    """``[dense chunks, expert chunks]``: the parameters of each of the two grad buffer sets
    at EP > 1, each chunk's in named_parameters() order."""
    return [[[p for p in chunk if is_expert(p.name) == flag] for chunk in chunks] for flag in (False, True)]


HOOK_SHARDING = "hook"
HOOK_OBJECT = "megatron.distributed_optimizer"
"""Where the save hook records a DistributedOptimizer's common state: the objects
``<HOOK_OBJECT>.states`` and ``.buffer_dtypes`` (``training.megatron.distributed_common``)."""


def adopt_hook_state(opened) -> None:
    """Give a save-hook checkpoint of a Megatron-Core job with the distributed optimizer its
    :class:`Meta` (the optimizers' ``state_dict()`` and grad-buffer dtypes, from the hook's
    :data:`HOOK_OBJECT`), so the Megatron writers carry its optimizer state as they carry a
    Megatron source's. Nothing happens for any other source."""
    index = opened.index
    found = [index.objects.get(f"{HOOK_OBJECT}.{name}") for name in ("states", "buffer_dtypes")]
    if None in found or index.layout(Meta) is not None:
        return
    where = opened.store.url
    states, dtypes = (opened.reader.read_object(opened.store, obj) for obj in found)
    if not isinstance(states, list) or len(states) not in (1, 2) or not isinstance(dtypes, list):
        raise UnreadableInput(f"the hook's {HOOK_OBJECT} record is not one ckptool writes",
                              path=where)
    checked = [check_state(s, where) for s in states]
    keys = {}
    for pair in dtypes:
        if not (isinstance(pair, tuple) and len(pair) == 2 and all(isinstance(d, torch.dtype) for d in pair)):
            raise UnreadableInput(f"the hook's {HOOK_OBJECT} record names grad buffers "
                                  f"{repr(pair)[:60]}", path=where)
        keys[pair[0]] = pair
    _steps_in_groups(opened, checked)
    index.set_layout(Meta(keys, checked[0], HOOK_SHARDING,
                          expert_state=checked[1] if len(checked) == 2 else None))


def _steps_in_groups(opened, states: list[dict]) -> None:
    """The hook stores each parameter's Adam step (``optimizer.state.step.<key>``); Megatron
    keeps one step per optimizer, in its param groups. Each stored step must be that one;
    then the param groups carry them and the per-parameter tensors leave the view."""
    index = opened.index
    try:
        steps = {float(g["step"]) for s in states for g in s["optimizer"]["param_groups"] if "step" in g}
    except (TypeError, ValueError, KeyError) as exc:
        raise UnreadableInput(f"the hook's {HOOK_OBJECT} param groups hold no step ({exc})",
                              path=opened.store.url) from None
    keys = [k for k in index.tensors if k.startswith("optimizer.state.step.")]
    for key in keys:
        info = index.tensors[key]
        if tuple(info.shape) != () or not info.pieces:
            raise UnreadableInput(f"the Adam step {key} is not a scalar", path=opened.store.url)
        value = opened.reader.read_piece(opened.store, info.pieces[0], info.dtype)
        if float(value) not in steps:
            raise UnreadableInput(f"{key} is {float(value)}, but the optimizer's param groups say "
                                  f"step {sorted(steps)}", path=opened.store.url)
        del index.tensors[key]


def target_state(meta: Meta, expert_parallel: bool) -> Any:
    """``model_optim_rng.pt["optimizer"]`` for a target with or without expert parallelism.
    Megatron-Core finds each of its param groups in the stored ones by :data:`GROUP_KEYS`, so
    a target optimizer gets the source's groups plus, for every identity it may ask for that
    the source lacks (the experts joining or leaving the expert-parallel group), a copy of
    the matching group of the other side (the same hyperparameters and step)."""
    dense = meta.state
    expert = meta.expert_state
    if not expert_parallel:
        return dense if expert is None else _with_groups(dense, expert, False)
    return [_with_groups(dense, expert, False) if expert is not None else dense,
            _with_groups(expert if expert is not None else dense, dense, True)]


def _with_groups(state: dict, other: dict | None, expert: bool) -> dict:
    """``state`` with its groups marked ``is_expert_parallel=expert``, plus (so marked)
    ``other``'s groups of identities ``state`` lacks."""
    groups, have = [], set()
    for g in [*state["optimizer"]["param_groups"], *(other["optimizer"]["param_groups"] if other else [])]:
        g = {**g, "is_expert_parallel": expert}
        ident = tuple(g.get(k) for k in GROUP_KEYS)
        if ident not in have:
            have.add(ident)
            groups.append(g)
    return {**state, "optimizer": {**state["optimizer"], "param_groups": groups}}


def check_file(obj: Any, buffers: list[Buffer], source: str) -> list[tuple]:
    """The file's key of each buffer, after checking the file against ``buffers``."""
    if not isinstance(obj, dict):
        raise UnreadableInput("distrib_optim.pt does not hold a distributed optimizer state",
                              path=source)
    if obj.get("buckets_coalesced") is not True:
        raise UnreadableInput("distrib_optim.pt is in the pre-2024 per-bucket format, which "
                              "ckptool does not read", path=source,
                              hint="Megatron's --ckpt-convert-update-legacy-dist-opt-format "
                                   "updates it")
    found = sorted(k for k in obj if isinstance(k, int))
    if found != list(range(len(buffers))):
        raise UnreadableInput(f"distrib_optim.pt has grad buffers {found}, the model file's "
                              f"parameters give {len(buffers)} (one per model chunk and dtype)",
                              path=source)
    keys = []
    for i, buffer in enumerate(buffers):
        entry = obj[i]
        if not (isinstance(entry, dict) and len(entry) == 1):
            raise UnreadableInput(f"grad buffer {i} of distrib_optim.pt does not hold one dtype",
                                  path=source)
        (key, state), = entry.items()
        if not (isinstance(key, tuple) and len(key) == 2 and key[0] == buffer.dtype):
            raise UnreadableInput(f"grad buffer {i} of distrib_optim.pt is keyed {key}, the "
                                  f"model file's parameters are {buffer.dtype}",
                                  path=source)
        stored = state.get("numel_unpadded") if isinstance(state, dict) else None
        if stored != buffer.numel_unpadded:
            raise UnreadableInput(
                f"grad buffer {i} of distrib_optim.pt holds {stored} elements, Megatron's "
                f"layout rule gives {buffer.numel_unpadded} (bucket size {buffer.bucket_size}); "
                "ckptool cannot map it to parameters", path=source)
        for name in FILE_KEYS.values():
            t = state.get(name)
            if getattr(t, "shape", None) != (stored,) or getattr(t, "dtype", None) != torch.float32:
                raise UnreadableInput(f"grad buffer {i} of distrib_optim.pt: {name!r} is not a "
                                      f"float32 vector of {stored} elements", path=source)
        keys.append(key)
    return keys


def check_state(optimizer: Any, source: str) -> dict:
    """``model_optim_rng.pt["optimizer"]`` beside a distrib_optim.pt: it must be
    ``DistributedOptimizer.state_dict()`` (param groups without params, no tensor state)."""
    inner = optimizer.get("optimizer") if isinstance(optimizer, dict) else None
    if not (isinstance(inner, dict) and isinstance(inner.get("param_groups"), list)
            and "state" not in inner):
        raise UnreadableInput("model_optim_rng.pt has no distributed optimizer entry (param "
                              "groups and step) beside distrib_optim.pt", path=source)
    return optimizer


def build(buffers: list[Buffer], keys: dict[torch.dtype, tuple],
          tensor: Callable[[int, str], Any]) -> dict:
    """The object tree of one optimizer's state in a distrib_optim.pt; ``tensor(buffer,
    file_key)`` gives each vector."""
    out: dict = {"buckets_coalesced": True}
    for i, buffer in enumerate(buffers):
        state = {name: tensor(i, name) for name in FILE_KEYS.values()}
        out[i] = {keys[buffer.dtype]: {**state, "numel_unpadded": buffer.numel_unpadded}}
    return out
