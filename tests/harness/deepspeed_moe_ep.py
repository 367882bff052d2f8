"""Real DeepSpeed MoE checkpoints with expert parallelism on CPU (gloo): ``deepspeed.moe``
saved at EP 1, 2 (or 4) over DP 2 (or 1, 4) processes, and loaded at another EP/DP.

The model: a dense ``Linear(8, 8)``, then a ``deepspeed.moe.layer.MoE`` of 4 experts (each
``Linear(8, 16), ReLU, Linear(16, 8)``, as :mod:`tests.harness.deepspeed_moe`), top-2 gating
with the second expert chosen without Gumbel noise (``top2_2nd_expert_sampling=False``: no
RNG in the forward) and no token dropping (``drop_tokens=False``: the capacity is the largest
expert load, so no token's routing depends on which rank holds it). The loss is the MSE to a
fixed target, without the gate's ``l_aux`` (a per-rank product of means, which would change
with the DP size). Every parameter is overwritten after the build from a seed of its
GLOBAL name (an expert's by its global index, ``ep_rank * local + local_id``), so the
global model is the same at any EP size; a seeded build alone is not (each EP rank builds
only its local experts).

Each DP rank (DP = the world size: EP splits the experts, not the batch) takes its slice of
one fixed global batch, so a step is the same math at any EP/DP; only float summation order
differs (an expert's gradient is one matmul over both ranks' tokens at EP 2, an all-reduce
of two partial sums at EP 1). AdamW (``torch_adam``), constant learning rate, fp32, the
param groups split by ``split_params_into_different_moe_groups_for_optimizer``.
No gradient clipping unless ``clip`` is given: DeepSpeed's stage-0 clipping (``clip_grad_norm_``
in ``runtime/utils.py``) averages the per-rank LOCAL norms over DP, and at EP > 1 each rank's
local norm covers only its own experts, so a clipped stage-0 step differs with EP (ZeRO-1/2
compute the norm per group over the right process groups and agree).

``save`` trains ONE step and calls ``engine.save_checkpoint(root)`` (tag ``global_step1``),
then dumps the truth per rank and takes one more step (the uninterrupted run). ``load``
builds the engine at a given EP/DP/stage, calls plain ``engine.load_checkpoint(root,
load_optimizer_states=True)`` (recording DeepSpeed's own error if it refuses), dumps the
same truth and takes the same step. A dump per rank::

    {"rank", "ep", "dp", "zero", "ep_rank", "edp_rank", "global_steps", "error",
     "shapes": {global name: shape},
     "fragments": {(kind, global name): [(flat start, 1-D tensor), ...]},
     "loss": float}   # the next step's loss (mean over DP), None on error

kinds: ``param`` (the module's parameter), ``master`` / ``exp_avg`` / ``exp_avg_sq`` (the
fp32 master and Adam moments: at ZeRO-1/2 the pieces of this rank's flat partitions, cut
by the optimizer's own bookkeeping ``round_robin_bit16_groups`` / ``round_robin_bit16_offsets``
/ ``partition_size`` / ``single_partition_of_fp32_groups``; at stage 0 the parameter and the
torch optimizer's state), and ``after`` (the master after the next step). Expert names are
global: ``moe.deepspeed_moe.experts.deepspeed_experts.{global}.…``. :func:`canonical` joins
the ranks' dumps into whole tensors.

Workers run in processes spawned by :func:`tests.conftest.spawn` (DeepSpeed keeps
process-wide group state), set up as :mod:`tests.harness.deepspeed_engine` sets its up.
"""

from __future__ import annotations

import os
import re
import zlib
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch
import torch.nn.functional as F
from torch import nn

from tests.harness.deepspeed_engine import _init, _spawn

NUM_EXPERTS, HIDDEN, FFN, BATCH, SEQ = 4, 8, 16, 4, 3
"""4 experts of 8 -> 16 -> 8; a global batch of 4 sequences of 3 tokens (divides DP 1, 2, 4)."""
LR = 1e-2
TAG = "global_step1"
SAVE_STEP, NEXT_STEP = 0, 1
"""Seeds of the fixed global batches: the step before the save, the step after it."""
EXPERT_PREFIX = "moe.deepspeed_moe.experts.deepspeed_experts."
_EXPERT = re.compile(re.escape(EXPERT_PREFIX) + r"(\d+)\.")
KINDS = ("param", "master", "exp_avg", "exp_avg_sq", "after")


class Net(nn.Module):
    """Dense ``Linear`` -> ``MoE`` (4 experts, top-2, no dropped tokens); loss: MSE to a target
    (``l_aux`` left out: it is not additive over ranks)."""

    def __init__(self, ep: int):
        super().__init__()
        from deepspeed.moe.layer import MoE

        self.inp = nn.Linear(HIDDEN, HIDDEN)
        expert = nn.Sequential(nn.Linear(HIDDEN, FFN), nn.ReLU(), nn.Linear(FFN, HIDDEN))
        self.moe = MoE(hidden_size=HIDDEN, expert=expert, num_experts=NUM_EXPERTS, ep_size=ep, k=2,
                       drop_tokens=False, top2_2nd_expert_sampling=False)

    def forward(self, x, target):
        y, _aux, _ = self.moe(self.inp(x))
        return F.mse_loss(y, target)


def global_name(name: str, ep_rank: int, ep: int) -> str:
    """A parameter's name with its local expert index made global."""
    local = NUM_EXPERTS // ep
    return _EXPERT.sub(lambda m: f"{EXPERT_PREFIX}{ep_rank * local + int(m.group(1))}.", name)


def init_value(gname: str, shape) -> torch.Tensor:
    """The value of the parameter of global name ``gname``: the same at any EP."""
    g = torch.Generator().manual_seed(zlib.crc32(gname.encode()))
    return torch.randn(tuple(shape), generator=g) * 0.3


def batch(step: int, rank: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DP rank ``rank``'s slice of the fixed global batch of ``step``."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, SEQ, HIDDEN, generator=g)
    t = torch.randn(BATCH, SEQ, HIDDEN, generator=g)
    share = BATCH // dp
    return x[rank * share:(rank + 1) * share], t[rank * share:(rank + 1) * share]


def config(dp: int, zero: int, clip: float = 0.0) -> dict:
    return {"train_batch_size": BATCH, "train_micro_batch_size_per_gpu": BATCH // dp,
            "gradient_accumulation_steps": 1, "steps_per_print": 10**9, "gradient_clipping": clip,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "torch_adam": True, "weight_decay": 0.01}},
            "zero_optimization": {"stage": zero}}


def engine(ep: int, dp: int, zero: int, clip: float = 0.0):
    """The engine at EP ``ep``, DP ``dp`` (= world size), ZeRO ``zero``, the global model set
    from :func:`init_value` before DeepSpeed flattens it. Returns ``(engine, names)``:
    names maps each parameter to its global name."""
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from deepspeed.utils import groups as ds_groups

    rank = dist.get_rank()
    ep_rank = rank % ep  # _create_expert_and_data_parallel: EP groups are consecutive ranks
    model = Net(ep)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(init_value(global_name(name, ep_rank, ep), p.shape))
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "params"})
    eng, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=config(dp, zero, clip))
    got = ds_groups._get_expert_parallel_rank(f"ep_size_{ep}")
    assert got == ep_rank, (got, ep_rank)
    names = {p: global_name(n, ep_rank, ep) for n, p in eng.module.named_parameters()}
    return eng, names


def train_step(eng, step: int, dp: int) -> float:
    """One step on the fixed global batch of ``step`` (this rank its slice); the loss of
    its forward, averaged over DP."""
    import deepspeed.comm as dist

    x, t = batch(step, dist.get_rank(), dp)
    loss = eng(x, t)
    eng.backward(loss)
    eng.step()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return (total / dp).item()


def _optimizer_fragments(eng, names) -> dict:
    """``{(kind, name): [(start, fragment)]}`` of the fp32 masters and Adam moments this rank
    holds. ZeRO-1/2: each param group's flat partition cut at the parameters' offsets (the
    optimizer's own ``round_robin_bit16_offsets``; a MoE group is partitioned over its
    expert-data-parallel group, ``real_dp_process_group``); stage 0: whole tensors."""
    import deepspeed.comm as dist

    opt = eng.optimizer
    out = {}
    if not eng.zero_optimization():
        for p, name in names.items():
            state = opt.state[p]
            out[("master", name)] = [(0, p.detach().reshape(-1).clone())]
            for kind in ("exp_avg", "exp_avg_sq"):
                out[(kind, name)] = [(0, state[kind].reshape(-1).clone())]
        return out
    for i, params in enumerate(opt.round_robin_bit16_groups):
        group = opt.real_dp_process_group[i]
        pid = dist.get_rank(group=group)
        size = opt.partition_size[i]
        lo, hi = pid * size, (pid + 1) * size
        master = opt.single_partition_of_fp32_groups[i]
        state = opt.optimizer.state[opt.optimizer.param_groups[i]["params"][0]]
        assert opt.optimizer.param_groups[i]["params"][0] is master
        flats = {"master": master, "exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"]}
        for p, off in zip(params, opt.round_robin_bit16_offsets[i]):
            a, b = max(off, lo), min(off + p.numel(), hi)
            if a >= b:
                continue
            for kind, flat in flats.items():
                out.setdefault((kind, names[p]), []).append(
                    (a - off, flat.detach().reshape(-1)[a - lo:b - lo].clone()))
    return out


def layout(eng, names) -> list[dict]:
    """The ZeRO flat-group bookkeeping of this rank, per param group: its name and ``moe``
    flag, partition count, this rank's partition id and size, padding, and the parameters
    (global names) with their offsets in the flat group, in flat order."""
    import deepspeed.comm as dist

    opt = eng.optimizer
    if not eng.zero_optimization():
        return []
    out = []
    for i, params in enumerate(opt.round_robin_bit16_groups):
        pg = opt.optimizer.param_groups[i]
        out.append({"name": pg.get("name"), "moe": pg.get("moe", False),
                    "partition_count": opt.partition_count[i],
                    "partition_id": dist.get_rank(group=opt.real_dp_process_group[i]),
                    "partition_size": opt.partition_size[i], "flat_numel": opt.bit16_groups_flat[i].numel(),
                    "groups_padding": opt.groups_padding[i],
                    "params": [(names[p], tuple(p.shape), off)
                               for p, off in zip(params, opt.round_robin_bit16_offsets[i])]})
    return out


def dump(eng, names, ep: int, dp: int, zero: int) -> dict:
    """This rank's truth (see the module docstring), before the next step."""
    import deepspeed.comm as dist
    from deepspeed.utils import groups as ds_groups

    group = f"ep_size_{ep}"
    fragments = {("param", n): [(0, p.detach().reshape(-1).clone())] for p, n in names.items()}
    fragments.update(_optimizer_fragments(eng, names))
    return {"rank": dist.get_rank(), "ep": ep, "dp": dp, "zero": zero,
            "ep_rank": ds_groups._get_expert_parallel_rank(group),
            "edp_rank": ds_groups._get_expert_data_parallel_rank(group),
            "global_steps": eng.global_steps, "error": None, "layout": layout(eng, names),
            "shapes": {n: tuple(p.shape) for p, n in names.items()}, "fragments": fragments, "loss": None}


def _next(eng, names, out: dict, dp: int) -> dict:
    """Take the next step; record its loss and the masters after it (kind ``after``)."""
    out["loss"] = train_step(eng, NEXT_STEP, dp)
    for (kind, name), pieces in _optimizer_fragments(eng, names).items():
        if kind == "master":
            out["fragments"][("after", name)] = pieces
    return out


def _truth_path(root: str, rank: int) -> str:
    return f"{root}.truth.rank{rank}.pt"


def _load_path(root: str, ep: int, dp: int, zero: int, rank: int) -> str:
    return f"{root}.load.ep{ep}.dp{dp}.z{zero}.rank{rank}.pt"


def _save_worker(rank: int, dp: int, root: str, ep: int, zero: int, clip: float, port: int) -> None:
    _init(rank, dp, port)
    eng, names = engine(ep, dp, zero, clip)
    train_step(eng, SAVE_STEP, dp)
    eng.save_checkpoint(root, tag=TAG)
    torch.save(_next(eng, names, dump(eng, names, ep, dp, zero), dp), _truth_path(root, rank))


def _load_worker(rank: int, dp: int, root: str, ep: int, zero: int, clip: float, port: int) -> None:
    _init(rank, dp, port)
    eng, names = engine(ep, dp, zero, clip)
    try:
        eng.load_checkpoint(root, load_optimizer_states=True)
    except Exception as exc:  # noqa: BLE001 -- DeepSpeed refusing the topology: the dump
        # says how, and holds the module's parameters as the failed call left them
        torch.save({"rank": rank, "ep": ep, "dp": dp, "zero": zero, "error": f"{type(exc).__name__}: {exc}",
                    "shapes": {n: tuple(p.shape) for p, n in names.items()},
                    "fragments": {("param", n): [(0, p.detach().reshape(-1).clone())] for p, n in names.items()}},
                   _load_path(root, ep, dp, zero, rank))
        return
    torch.save(_next(eng, names, dump(eng, names, ep, dp, zero), dp), _load_path(root, ep, dp, zero, rank))


def save(root, ep: int, dp: int = 2, zero: int = 1, *, clip: float = 0.0) -> None:
    """Train one step at EP ``ep`` × DP ``dp`` (``dp`` processes), ZeRO stage ``zero`` (0, 1
    or 2; ``clip``: DeepSpeed's ``gradient_clipping``, 0 = off), and save with
    ``engine.save_checkpoint(root)`` (tag ``global_step1``); beside ``root`` the saving run's
    truth per rank, ``<root>.truth.rank{r}.pt`` (read with :func:`truth`), whose ``loss`` /
    ``after`` are the uninterrupted next step."""
    assert dp % ep == 0 and NUM_EXPERTS % ep == 0 and BATCH % dp == 0
    for stale in Path(root).parent.glob(f"{Path(root).name}.truth.rank*.pt"):
        stale.unlink()
    _spawn(_save_worker, dp, str(root), ep, zero, clip)


def load(root, ep: int, dp: int = 2, zero: int = 1, *, clip: float = 0.0) -> list[dict]:
    """Build the engine at EP ``ep`` × DP ``dp``, ZeRO ``zero`` (``clip`` as :func:`save`),
    ``load_checkpoint(root, load_optimizer_states=True)``, and take the next step: the
    per-rank dumps (also kept as ``<root>.load.ep{ep}.dp{dp}.z{zero}.rank{r}.pt``). Where
    DeepSpeed refuses, every dump is ``{"error": "<ExceptionType>: <message>", ...}`` whose
    fragments are only the module's parameters after the failed call (DeepSpeed loads the
    module and expert files first; ``canonical(dumps, allow_error=True)`` joins them).

    What DeepSpeed 0.19.8 does (CPU, fp32): the same EP and DP loads exactly, across ZeRO-1
    and 2 too. ZeRO-1/2 at another DP: ``ZeRORuntimeException: The checkpoint being loaded
    used a DP world size of 2 but the current world size is 1. ...``. ZeRO-1/2 at another EP
    (same DP): ``RuntimeError: The ZeRO checkpoint parameter-alignment layout does not match
    ...`` (the per-parameter padding list of the MoE group has one entry per local expert
    parameter, 8 at EP 2 and 16 at EP 1). Stage 0 at another EP: ``ValueError: loaded state
    dict contains a parameter group that doesn't match the size of optimizer's group``, or
    ``FileNotFoundError`` for a missing ``expp_rank_{r}`` file; stage 0 at another DP (same
    EP) loads, exactly: it has no DP check, each rank reads ``expp_rank_{its EP rank}``."""
    assert dp % ep == 0 and NUM_EXPERTS % ep == 0 and BATCH % dp == 0
    for r in range(dp):
        Path(_load_path(str(root), ep, dp, zero, r)).unlink(missing_ok=True)
    _spawn(_load_worker, dp, str(root), ep, zero, clip)
    return [torch.load(_load_path(str(root), ep, dp, zero, r), weights_only=False) for r in range(dp)]


def truth(root) -> list[dict]:
    """The saving run's per-rank dumps, in rank order."""
    out, r = [], 0
    while Path(_truth_path(str(root), r)).exists():
        out.append(torch.load(_truth_path(str(root), r), weights_only=False))
        r += 1
    assert out, f"no truth beside {root}"
    return out


def canonical(dumps: list[dict], allow_error: bool = False) -> dict:
    """``{(kind, global name): whole tensor}`` joined from per-rank dumps, plus
    ``("loss", "next")``: the next step's loss as a 0-d float64 tensor. Pieces that several
    ranks hold (a dense parameter, a replicated expert) must agree bit for bit; every element
    must be covered. Dumps of a refused load raise, unless ``allow_error`` (then no loss)."""
    errors = [d["error"] for d in dumps if d.get("error")]
    if errors and not allow_error:
        raise RuntimeError(errors[0])
    shapes = {}
    for d in dumps:
        shapes.update(d["shapes"])
    out, seen = {}, {}
    for d in dumps:
        for (kind, name), pieces in d["fragments"].items():
            numel = torch.Size(shapes[name]).numel()
            flat = out.setdefault((kind, name), torch.full((numel,), float("nan")))
            mask = seen.setdefault((kind, name), torch.zeros(numel, dtype=torch.bool))
            for start, piece in pieces:
                end = start + piece.numel()
                both = mask[start:end]
                if both.any() and not torch.equal(flat[start:end][both], piece[both]):
                    raise AssertionError(f"ranks disagree on {kind} {name}")
                flat[start:end] = piece
                mask[start:end] = True
    for key, mask in seen.items():
        assert mask.all(), f"{key} not covered by the dumps"
    result = {key: flat.reshape(shapes[key[1]]) for key, flat in out.items()}
    if errors:
        return result
    losses = {d["loss"] for d in dumps}
    assert len(losses) == 1, losses
    result[("loss", "next")] = torch.tensor(losses.pop(), dtype=torch.float64)
    return result
