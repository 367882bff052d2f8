"""The save hook inside a real Megatron-Core job with the distributed optimizer (CPU, gloo,
4 processes).

``save`` builds :mod:`tests.harness.mcore_distopt`'s GPTModel (local spec) at the case's TP/PP
(DP fills the 4 processes) in ``DistributedDataParallel(use_distributed_optimizer=True)`` with
Megatron's own optimizer (bf16 parameters with fp32 main params by default), takes one Adam
step from seeded global gradients (:func:`tests.harness.mcore_distopt_torch_dist._step`) and
saves through ``AsyncCheckpointer`` what ``training.megatron.sharded_state(ddp, spec, topo,
..., optimizer=opt)`` describes. Then it dumps each process's optimizer shards from the
optimizer itself (:func:`tests.harness.mcore_distopt._truth`) and records the loss of a forward
pass before and after a second step (the run that went on).

A case with ``form="sharded_state_dict"`` describes the rank with
``training.megatron.from_sharded_state_dict(model.sharded_state_dict(), optimizer=opt)``
(Megatron-Core's own description) instead of the ModelSpec-based ``sharded_state``.

``resume`` builds the job at another TP/PP/DP, ``load_latest`` into the hook's description
of the fresh optimizer, and does the same dumps and second step. ``native`` does the same
with Megatron-Core's own loader instead of the hook: a ``torch_dist`` run root (what
``ckptool convert --to megatron-dist`` writes from the hook's checkpoint) read as Megatron-LM
reads one (:func:`tests.harness.mcore_distopt_torch_dist._resume_worker`'s steps).
"""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from tests.harness import mcore_distopt as D
from tests.harness import mcore_distopt_torch_dist as TD
from tests.harness.mcore import _spawn

WORLD = 4
CASE = dict(TD.BASE, layers=4, tp=2, pp=2, bf16=True, overlap=True, bucket=6000)
"""TP2 x PP2 x DP1, bf16 weights with fp32 main params, several buckets."""


def _init(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    D._shims()


def _described(ps, ddp, opt, c: dict):
    """The hook's description of this rank, and the manifest fields of the job."""
    from ckptool.core.topology import Topology
    from converters.schemas.megatron_args import spec_from_args
    from training.megatron import from_sharded_state_dict, sharded_state

    spec, _, _ = spec_from_args(D.megatron_args(c), true_vocab_size=c["vocab"])
    topo = Topology(tp=c["tp"], pp=c["pp"], dp=WORLD // (c["tp"] * c["pp"]))
    if c.get("form") == "sharded_state_dict":  # Megatron-Core's own description of the model
        state = from_sharded_state_dict(ddp.module.sharded_state_dict(), optimizer=opt)
    else:
        state = sharded_state(ddp, spec, topo, tp_rank=ps.get_tensor_model_parallel_rank(),
                              pp_rank=ps.get_pipeline_model_parallel_rank(),
                              dp_rank=ps.get_data_parallel_rank(), optimizer=opt)
    return state, dict(topology=topo.to_dict(), model_config=asdict(spec), true_vocab_size=c["vocab"])


def _save_worker(rank, c, root, port):
    from training import AsyncCheckpointer

    _init(rank, port)
    ps, ddp, opt = D._setup(c)
    TD._step(ps, ddp, opt, c, 1)
    state, fields = _described(ps, ddp, opt, c)
    ckpt = AsyncCheckpointer(root, **fields)
    ckpt.save(1, state)
    ckpt.wait()
    TD._dump_and_continue(rank, ps, ddp, opt, c, Path(f"{root}.truth"))
    dist.destroy_process_group()


def _resume_worker(rank, jobs, port):
    from training import AsyncCheckpointer

    _init(rank, port)
    D._keep_step_on_load()
    for root, c, out in jobs:
        ps, ddp, opt = D._setup(c)
        state, _ = _described(ps, ddp, opt, c)
        step = AsyncCheckpointer(root).load_latest(state)
        assert step == 1, step
        TD._dump_and_continue(rank, ps, ddp, opt, c, Path(out))
    dist.destroy_process_group()


def _native_worker(rank, jobs, port):
    from megatron.core import dist_checkpointing

    _init(rank, port)
    D._keep_step_on_load()
    for root, c, out in jobs:
        it = next(Path(root).glob("iter_*"))
        sharding = dist_checkpointing.load_content_metadata(str(it))["distrib_optim_sharding_type"]
        ps, ddp, opt = D._setup(c)
        for inner in getattr(opt, "chained_optimizers", [opt]):
            inner._init_optimizer_states_with_dummy_values()
        state = dist_checkpointing.load(TD._sharded(ddp, opt, sharding, is_loading=True), str(it))
        ddp.module.load_state_dict(state["model"], strict=True)
        with torch.no_grad():
            opt.load_state_dict(state["optimizer"])
        TD._unshare_steps(opt)
        TD._dump_and_continue(rank, ps, ddp, opt, c, Path(out))
    dist.destroy_process_group()


def native(jobs: list[tuple[Path, dict, Path]]) -> None:
    """For each ``(torch_dist run root, case, out)``: Megatron-Core's ``dist_checkpointing.load``
    of the run root into the case's job; the loaded shards and the losses at ``out``."""
    _spawn(_native_worker, WORLD, [(str(r), c, str(o)) for r, c, o in jobs])


def save(root: Path, c: dict = CASE) -> None:
    """The hook's run root at ``root``; the truth and losses at ``root.truth`` (see :func:`dumps`)."""
    _spawn(_save_worker, WORLD, c, str(root))


def resume(jobs: list[tuple[Path, dict, Path]]) -> None:
    """For each ``(run root, case, out)``: resume the case from the run root through the
    hook; the loaded shards and the losses at ``out``."""
    _spawn(_resume_worker, WORLD, [(str(r), c, str(o)) for r, c, o in jobs])


def dumps(folder: Path) -> tuple[list[dict], tuple[float, float]]:
    """The per-process shard dumps and the losses (before, after the second step)."""
    return ([torch.load(folder / f"rank{r}.pt", weights_only=False) for r in range(WORLD)],
            torch.load(folder / "loss.pt"))
