"""Both hook descriptions of one real Megatron-Core rank, side by side (CPU, gloo).

Each worker builds a GPTModel (the dense harness models of :mod:`tests.harness.mcore` at TP x
PP, or the MoE of :mod:`tests.harness.mcore_moe` at TP x EP) with a torch AdamW over its
param groups, and describes the rank twice: with ``training.megatron.sharded_state`` (ckptool's
layout rules from a ModelSpec built from Megatron-LM's args) and with
``training.megatron.from_sharded_state_dict(model.sharded_state_dict(), ...)`` (Megatron-Core's
own ShardedTensors: SwiGLU factories, stacked layers, expert axes, tied copies). Each
description is reduced to what the hook saves: for every local tensor, its regions and
whether this rank writes them. The workers write both reductions; the test compares them.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

import tests.harness.mcore as M
import tests.harness.mcore_moe as MOE


def _reduced(state: dict) -> dict[str, list]:
    """``{"model"|"optimizer": sorted [(repr of regions, writes, dtype)]}``: the description
    without its dict keys (the two name expert entries differently)."""
    out = {}
    for part in ("model", "optimizer"):
        rows = []
        for entry in state[part].values():
            if hasattr(entry, "shard"):  # objects (none in these models) are not tensors
                rows.append((repr(entry.shard.parts), repr(entry.shard.shape), not entry.replica,
                             str(entry.local.dtype)))
        out[part] = sorted(rows)
    return out


def _both(model, opt, spec, topo, out: Path, rank: int, **ranks) -> None:
    from training.megatron import from_sharded_state_dict, sharded_state

    by_spec = sharded_state(model, spec, topo, optimizer=opt, **ranks)
    by_mcore = from_sharded_state_dict(model.sharded_state_dict(), optimizer=opt)
    torch.save({"spec": _reduced(by_spec), "mcore": _reduced(by_mcore)}, out / f"rank{rank}.pt")


def _dense_worker(rank, m, tp, pp, out, port):
    from converters.schemas.megatron_args import spec_from_args

    ps = M._init(rank, tp * pp, tp, pp, port)
    pp_rank = ps.get_pipeline_model_parallel_rank()
    torch.manual_seed(5)
    model = M._model(m, tp, pp, pp_rank == 0, pp_rank == pp - 1)
    spec, topo, _ = spec_from_args(M.megatron_args(m, tp, pp))
    _both(model, M._optimizer(model), spec, topo, Path(out), rank,
          tp_rank=ps.get_tensor_model_parallel_rank(), pp_rank=pp_rank, dp_rank=0)
    dist.barrier()
    dist.destroy_process_group()


def _moe_worker(rank, m, tp, ep, out, port):
    from converters.schemas.megatron_args import spec_from_args

    ps = MOE._init(rank, tp, ep, None, port)
    torch.manual_seed(5)
    model = MOE._model(m, tp, ep)
    spec, topo, _ = spec_from_args(MOE.moe_args(m, tp, 1, ep))
    _both(model, M._optimizer(model), spec, topo, Path(out), rank,
          tp_rank=ps.get_tensor_model_parallel_rank(), pp_rank=0,
          dp_rank=ps.get_data_parallel_rank(), ep_rank=ps.get_expert_model_parallel_rank())
    dist.barrier()
    dist.destroy_process_group()


def dense(m: dict, tp: int, pp: int, out: Path) -> list[dict]:
    """Each rank's two reductions for the dense model ``m`` at TP x PP."""
    out.mkdir(parents=True, exist_ok=True)
    M._spawn(_dense_worker, tp * pp, m, tp, pp, str(out))
    return [torch.load(out / f"rank{r}.pt") for r in range(tp * pp)]


def moe(m: dict, tp: int, ep: int, out: Path) -> list[dict]:
    """Each rank's two reductions for the MoE model ``m`` at TP x EP (PP1)."""
    out.mkdir(parents=True, exist_ok=True)
    world = MOE.world_size(tp, ep)
    M._spawn(_moe_worker, world, m, tp, ep, str(out))
    return [torch.load(out / f"rank{r}.pt") for r in range(world)]
