"""Real Megatron-Core ``torch_dist`` checkpoints of a MoE GPTModel with the distributed
optimizer (CPU, gloo, 2 processes), as Megatron-LM 0.16 saves them with default flags for
``--ckpt-format torch_dist --use-distributed-optimizer`` (``dp_reshardable``) and with
``--dist-ckpt-optim-fully-reshardable`` (``fully_reshardable``).

The runs are :mod:`tests.harness.mcore_moe_distopt`'s (its model, ``_setup``, seeded
gradients, one Adam step, ``_truth``, ``_next_step``, ``canonical_state``); only the save and
the load differ. ``generate`` writes, for every case of :data:`CASES` (a case of
mcore_moe_distopt with a ``sharding``), a Megatron-LM run root ``root/<case>-<form>/``:
``latest_checkpointed_iteration.txt`` and ``iter_0000001/`` (``metadata.json``,
``.metadata``, ``common.pt``, ``__<rank>_<n>.distcp``), written as Megatron-LM's
``save_checkpoint`` writes it (:func:`_save`):

- the state dict of ``generate_state_dict`` (:func:`_state_dict`): ``args``,
  ``checkpoint_version`` 3.0, ``iteration``, ``model`` = the unwrapped GPTModel's
  ``sharded_state_dict(metadata=...)``, ``optimizer`` = ``opt.sharded_state_dict(state_dict,
  is_loading=False, metadata=...)``, ``opt_param_scheduler`` (a real
  ``OptimizerParamScheduler``: constant lr and weight decay, so the run is mcore_moe_distopt's),
  ``rng_state`` (:func:`_rng_state`: a ``ShardedObject`` ``rng_state`` of shape (PP, TP, DP) at
  EP > 1, (PP, TP) with replica id the DP rank at EP1), ``num_floating_point_operations_so_far``;
  no ``rerun_state_machine`` (its ``state_dict`` is None while no step is to be rerun);
- ``metadata`` = ``_build_sharded_state_dict_metadata`` (:func:`sharded_sd_metadata`):
  ``distrib_optim_sharding_type`` ('dp_reshardable', or 'fully_reshardable' with
  ``distrib_optim_fully_reshardable_mem_efficient`` False), ``singleton_local_shards`` False,
  ``chained_optim_avoid_prefix`` True, ``dp_cp_group``; ``content_metadata`` = the same
  without ``dp_cp_group``;
- ``dist_checkpointing.save`` with the default ``torch_dist`` strategy wrapped in
  ``FullyParallelSaveStrategyWrapper`` over the DP(-CP) group (``ckpt_fully_parallel_save``
  is True by default), access-integrity validation on; the tracker from rank 0.

At EP > 1 the optimizer is a ChainedOptimizer of a dense and an expert DistributedOptimizer;
with ``dp_reshardable`` mcore prefixes their sharded keys ``chained_0.`` / ``chained_1.``
(they would collide: both are ``optimizer.distributed.dp_group_idx_<i>...``), with
``fully_reshardable`` not (``chained_optim_avoid_prefix``; the keys are model-space
``optimizer.state.<kind>.<model key>``). At EP1 there is one DistributedOptimizer (a
ChainedOptimizer of one delegates) and no prefix either way.

``load`` does what Megatron-LM's ``load_checkpoint`` does with such a checkpoint (:func:`_load`):
the common state dict, the content metadata (``load_content_metadata``) with this job's
``dp_cp_group`` added, the sharded state dict built with ``is_loading=True`` (``rng_state`` only
where TP and PP match, as Megatron-LM), ``dist_checkpointing.load`` with the default load
strategy and ``strict='assume_ok_unexpected'``, ``ddp.load_state_dict(model)``,
``opt.load_state_dict(optimizer)``, the scheduler's and the RNG's; at the checkpoint's own
topology (its ``args``) unless ``at`` overrides it (Megatron-LM checks neither EP nor, for
dist checkpoints, TP/PP args; only TP/PP against a non-fully-reshardable sharding type).
Then it dumps mcore_moe_distopt's truth and ``next_loss``.

At another EP (``at={"ep": 1}`` for an EP2 checkpoint, or the reverse) mcore 0.16.1 does not
load these checkpoints itself: with ``dp_reshardable`` the bucket keys differ (``chained_<i>.``
prefixes, other buffers) and ``dist_checkpointing.load`` raises a KeyError in its global shape
validation; with ``fully_reshardable`` the ``rng_state`` ShardedObject's shape depends on EP
("Missing key in checkpoint state_dict: rng_state/shard_..."), and with ``no_rng`` the tensors
load but ``opt.load_state_dict`` fails on the common part (``{0: ..., 1: ...}`` of the
ChainedOptimizer against one optimizer's dict: ``KeyError: 'optimizer'`` at EP1, "Expected 2
entries in state dict, but got 4." at EP2). ``num_floating_point_operations_so_far`` is 0.0
(a placeholder).

Shims (test only): those of :mod:`tests.harness.mcore_moe_distopt` (and, for loading,
:func:`tests.harness.mcore_distopt._keep_step_on_load`); without TE/Apex (torch Adam):
mcore's own ``_init_optimizer_states_with_dummy_values`` before the load's sharded state dict
and :func:`tests.harness.mcore_distopt_torch_dist._unshare_steps` after
``load_state_dict``; in the RNG state, ``cuda_rng_state`` and the CUDA tracker's states are
CPU generator states (no CUDA; seeded as ``model_parallel_cuda_manual_seed`` seeds them),
and on load the CUDA ones are not set.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import tests.harness.mcore as M
import tests.harness.mcore_distopt as D
import tests.harness.mcore_distopt_torch_dist as TD
import tests.harness.mcore_moe_distopt as MD

WORLD = MD.WORLD
ITERATION = MD.ITERATION
FORMS = ("dp_reshardable", "fully_reshardable")
BASES = ("ep2", "ep1", "tp2_etp1_ep2")
SEED = 1234
TRAIN_ITERS = MD.TRAIN_ITERS
STRICTNESS = "assume_ok_unexpected"  # Megatron-LM's default --dist-ckpt-strictness


def cases(bases=BASES, forms=FORMS) -> dict:
    """``<case>-<form>`` -> mcore_moe_distopt's case with ``sharding`` = form."""
    return {f"{b}-{f}": dict(MD.CASES[b], sharding=f) for b in bases for f in forms}


CASES = cases()


def megatron_args(c: dict) -> argparse.Namespace:
    """mcore_moe_distopt's args with the checkpoint, schedule and RNG settings of the job."""
    args = MD.megatron_args(c)
    dp = args.data_parallel_size
    vars(args).update(
        ckpt_format="torch_dist", use_dist_ckpt=True, transformer_impl="local",
        dist_ckpt_optim_fully_reshardable=c.get("sharding") == "fully_reshardable",
        distrib_optim_fully_reshardable_mem_efficient=False, ckpt_fully_parallel_save=True,
        ckpt_fully_parallel_load=False, dist_ckpt_strictness=STRICTNESS,
        context_parallel_size=1, expert_tensor_parallel_size=MD._etp(c),
        seed=SEED, data_parallel_random_init=False, no_save_optim=None, no_save_rng=None,
        optimizer="adam", lr=M.LR, min_lr=0.0, lr_warmup_init=0.0, lr_warmup_iters=0,
        lr_decay_style="constant", lr_decay_iters=TRAIN_ITERS, train_iters=TRAIN_ITERS,
        weight_decay=M.WD, start_weight_decay=M.WD, end_weight_decay=M.WD,
        weight_decay_incr_style="constant", micro_batch_size=M.BATCH,
        global_batch_size=M.BATCH * dp)
    return args


def case_from_args(args: argparse.Namespace) -> dict:
    """The case a checkpoint's args describe; ``sharding`` from its flag (the loader reads
    the sharding type from the content metadata, not from here)."""
    sharding = "fully_reshardable" if getattr(args, "dist_ckpt_optim_fully_reshardable", False) \
        else "dp_reshardable"  # args of a legacy run converted by ckptool lack the flag
    return dict(MD.case_from_args(args), sharding=sharding)


def sharded_sd_metadata(ps, c: dict) -> dict:
    """Megatron-LM's ``_build_sharded_state_dict_metadata`` for the job."""
    meta = {}
    if c["distopt"]:
        if c["sharding"] == "fully_reshardable":
            meta["distrib_optim_sharding_type"] = "fully_reshardable"
            meta["distrib_optim_fully_reshardable_mem_efficient"] = False
        else:
            meta["distrib_optim_sharding_type"] = "dp_reshardable"
    meta["singleton_local_shards"] = False
    meta["chained_optim_avoid_prefix"] = True
    meta["dp_cp_group"] = ps.get_data_parallel_group(with_context_parallel=True)
    return meta


def _unwrap(ddp):
    """Megatron-LM's ``unwrap_model``: the GPTModel inside DDP (and Float16Module)."""
    from megatron.core.transformer.module import Float16Module

    m = ddp.module
    return m.module if isinstance(m, Float16Module) else m


def _scheduler(opt, args):
    """Megatron-LM's ``get_optimizer_param_scheduler`` for ``args`` (:func:`mcore_moe_distopt.scheduler`)."""
    return MD.scheduler(opt, args.data_parallel_size)

def _rng_state(ps):
    """Megatron-LM's ``get_rng_state("torch_dist", ...)``. Shim: no CUDA, so
    ``cuda_rng_state`` and the tracker's three states are CPU generator states, seeded as
    ``model_parallel_cuda_manual_seed(SEED)`` seeds the CUDA ones."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    def gen(seed):
        return torch.Generator().manual_seed(seed).get_state()

    tp_rank, ep_rank = ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank()
    state = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": gen(SEED),
             "rng_tracker_states": {
                 "data-parallel-rng": gen(SEED), "model-parallel-rng": gen(SEED + 2718 + tp_rank),
                 "expert-parallel-rng": gen(SEED + 1024 + 100 * ep_rank
                                            + ps.get_expert_tensor_parallel_rank())}}
    states = [state]
    pp_rank, pp = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    tp = ps.get_tensor_model_parallel_world_size()
    if ps.get_expert_model_parallel_world_size() > 1:
        dp_rank = ps.get_data_parallel_rank(with_context_parallel=True)
        dp = ps.get_data_parallel_world_size(with_context_parallel=True)
        return ShardedObject("rng_state", states, (pp, tp, dp), (pp_rank, tp_rank, dp_rank),
                             replica_id=0)
    return ShardedObject("rng_state", states, (pp, tp), (pp_rank, tp_rank),
                         replica_id=ps.get_data_parallel_rank(with_context_parallel=True))


def _state_dict(ddp, opt, sched, args, rng, metadata: dict, is_loading: bool,
                iteration: int | None = None) -> dict:
    """Megatron-LM's ``generate_state_dict`` for ``torch_dist`` (one model chunk)."""
    sd = {"args": args, "checkpoint_version": 3.0}
    if iteration is not None:
        sd["iteration"] = iteration
    sd["model"] = _unwrap(ddp).sharded_state_dict(metadata=metadata)
    if opt is not None:
        sd["optimizer"] = opt.sharded_state_dict(sd, is_loading=is_loading, metadata=metadata)
        sd["opt_param_scheduler"] = sched.state_dict()
    if rng is not None:
        sd["rng_state"] = rng
    return sd


def _save(ps, ddp, opt, sched, c: dict, run: Path) -> None:
    """Megatron-LM's ``save_checkpoint`` for ``torch_dist`` (collective)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import (
        get_default_save_sharded_strategy,
    )
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper,
    )
    from megatron.core.dist_checkpointing.utils import _clean_metadata_for_serialization

    args = megatron_args(c)
    it = run / f"iter_{ITERATION:07d}"
    rng = _rng_state(ps)
    meta = sharded_sd_metadata(ps, c)
    sd = _state_dict(ddp, opt, sched, args, rng, meta, is_loading=False, iteration=ITERATION)
    sd["num_floating_point_operations_so_far"] = 0.0
    if dist.get_rank() == 0:
        it.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    strategy = FullyParallelSaveStrategyWrapper(
        get_default_save_sharded_strategy(args.ckpt_format),
        ps.get_data_parallel_group(with_context_parallel=True), False)
    dist_checkpointing.save(sd, str(it), strategy, async_sharded_save=False,
                            validate_access_integrity=True,
                            preprocess_common_before_consistancy_check=None,
                            content_metadata=_clean_metadata_for_serialization(meta))
    dist.barrier()
    if dist.get_rank() == 0:
        (run / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    dist.barrier()


def _groups(cases: dict) -> list[list[str]]:
    """Names of cases that differ only in ``sharding``: one run saves them all."""
    out: dict = {}
    for name, c in cases.items():
        key = tuple(sorted((k, v) for k, v in c.items() if k != "sharding"))
        out.setdefault(key, []).append(name)
    return list(out.values())


def _generate_worker(rank, cases, root, port):
    MD._init(rank, port)
    for names in _groups(cases):
        c = cases[names[0]]
        ps, ddp, opt = MD._setup(c)
        sched = _scheduler(opt, megatron_args(c))
        MD._seeded_grads(ps, ddp)
        ok, _, _ = opt.step()
        assert ok
        sched.step(increment=megatron_args(c).global_batch_size)  # as train_step
        for name in names:
            _save(ps, ddp, opt, sched, cases[name], Path(root) / name)
        dump = MD._truth(ps, ddp, opt, c)
        dump["next_loss"] = MD._next_step(ddp, opt)  # the uninterrupted run goes on
        for name in names:
            truth = Path(root) / f"{name}.truth"
            truth.mkdir(exist_ok=True)
            torch.save(dump, truth / f"rank{rank}.pt")
        dist.barrier()
        ps.destroy_model_parallel()
    dist.destroy_process_group()


def iteration_dir(run: Path) -> Path:
    tracker = (Path(run) / "latest_checkpointed_iteration.txt").read_text().strip()
    return Path(run) / f"iter_{int(tracker):07d}"


def _load(ps, ddp, opt, sched, c: dict, it: Path, common: dict, no_rng: bool) -> dict:
    """Megatron-LM's ``load_checkpoint`` for ``torch_dist``; returns the loaded state dict."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import (
        get_default_load_sharded_strategy,
    )
    from megatron.core.optimizer import DistributedOptimizer

    ckpt_args = common["args"]
    _check_checkpoint_args(ckpt_args, megatron_args(c))
    same_tp_pp = (ckpt_args.tensor_model_parallel_size, ckpt_args.pipeline_model_parallel_size) \
        == (c["tp"], c["pp"])
    meta = dist_checkpointing.load_content_metadata(preloaded_state_dict=common) or {}
    if not same_tp_pp and meta.get("distrib_optim_sharding_type") not in \
            DistributedOptimizer.checkpoint_fully_reshardable_formats:
        raise RuntimeError(f"(TP, PP) mismatch: not supported for DistributedOptimizer with "
                           f"sharding type {meta['distrib_optim_sharding_type']}")
    meta = dict(meta, dp_cp_group=ps.get_data_parallel_group(with_context_parallel=True))
    # Megatron-LM 0.16.1: RNG only at the same (TP, PP), without --no-load-rng, and when the
    # checkpoint's args do not say no_save_rng
    rng = _rng_state(ps) if same_tp_pp and not no_rng and not getattr(ckpt_args, "no_save_rng", False) \
        else None
    # shim: torch Adam has no state before a step; mcore's own dummy state, replaced in place
    for inner in MD._inner(opt):
        inner._init_optimizer_states_with_dummy_values()
    sd = _state_dict(ddp, opt, sched, megatron_args(c), rng, meta, is_loading=True)
    state = dist_checkpointing.load(sd, str(it), get_default_load_sharded_strategy(str(it)),
                                    strict=STRICTNESS)
    ddp.load_state_dict(state["model"], strict=True)
    with torch.no_grad():  # fp32 masters are views of the parameters (leaves)
        opt.load_state_dict(state["optimizer"])
    TD._unshare_steps(opt)
    sched.load_state_dict(state["opt_param_scheduler"])
    if rng is not None:
        r = state["rng_state"][0]
        random.setstate(r["random_rng_state"])
        np.random.set_state(r["np_rng_state"])
        torch.set_rng_state(r["torch_rng_state"])
        if not r["rng_tracker_states"]:
            raise KeyError("rng_tracker_states")  # Megatron-LM exits here
    return state


def _check_checkpoint_args(ckpt, job) -> None:
    """Megatron-LM 0.16.1's ``check_checkpoint_args`` for a torch_dist load (checkpoint
    version 3): the model fields must equal the job's (TP/PP are not compared)."""
    for name, default in (("num_layers", None), ("hidden_size", None), ("num_attention_heads", None),
                          ("add_position_embedding", True), ("max_position_embeddings", None),
                          ("make_vocab_size_divisible_by", None)):
        saved, own = getattr(ckpt, name, default), getattr(job, name, default)
        if saved != own:
            raise RuntimeError(f"{name} value from checkpoint ({saved}) is not equal to the input "
                               f"argument value ({own})")  # Megatron-LM asserts
    if getattr(ckpt, "checkpoint_version", 3.0) < 3.0:
        raise RuntimeError("a torch_dist checkpoint of version < 3")


def _load_worker(rank, checkpoints, at, no_rng, port):
    from megatron.core import dist_checkpointing

    MD._init(rank, port)
    D._keep_step_on_load()
    for ckpt in checkpoints:
        it = iteration_dir(ckpt)
        common = dist_checkpointing.load_common_state_dict(str(it))
        # the resuming job's own launch flags: those of the checkpoint's args, or (``at`` with
        # "sharding") a whole case, for checkpoints whose args hold only the model's fields
        c = at if at and "sharding" in at else dict(case_from_args(common["args"]), **(at or {}))
        ps, ddp, opt = MD._setup(c)
        sched = _scheduler(opt, megatron_args(c))
        state = _load(ps, ddp, opt, sched, c, it, common, no_rng)
        MD.dump_loaded(ps, ddp, opt, c, ckpt, rank, iteration=state["iteration"])
    dist.destroy_process_group()


def generate(root: Path, cases: dict = CASES) -> None:
    """Write each case's run root at ``root/<name>`` and its truth at ``root/<name>.truth``
    (the state as saved, and the ``next_loss`` of one more real step)."""
    M._spawn(_generate_worker, WORLD, cases, str(root))


def load(checkpoints: list[Path], at: dict | None = None, no_rng: bool = False) -> list[list[dict]]:
    """Load each run root into real mcore as Megatron-LM's loader does, at the topology of
    its args (``at`` overrides case keys: ``{"ep": 1}``, or is the whole case when it has
    ``sharding``; ``no_rng`` is ``--no-load-rng``);
    each process's truth dump, with ``iteration`` and the ``next_loss`` of one more step."""
    M._spawn(_load_worker, WORLD, [str(c) for c in checkpoints], at, no_rng)
    return [[torch.load(f"{c}.loaded-rank{r}.pt", weights_only=False) for r in range(WORLD)]
            for c in checkpoints]


def truth(root: Path, name: str) -> list[dict]:
    """The per-process truth dumps of case ``name`` as generated."""
    return MD.truth(root, name)


canonical_state = MD.canonical_state


# ---------------------------------------------------------------- the training hook


def _hook_worker(rank, c, root, port):
    """The run of :func:`_generate_worker`, saved through the training hook instead: the rank
    described by Megatron-Core's own ``sharded_state_dict`` (``from_sharded_state_dict``,
    the ChainedOptimizer at EP > 1), with Megatron's ``opt_param_scheduler`` state beside it,
    as docs/hook.md says."""
    from dataclasses import asdict

    from converters.schemas.megatron_args import spec_from_args
    from training import AsyncCheckpointer
    from training.megatron import from_sharded_state_dict

    MD._init(rank, port)
    ps, ddp, opt = MD._setup(c)
    args = megatron_args(c)
    sched = _scheduler(opt, args)
    MD._seeded_grads(ps, ddp)
    ok, _, _ = opt.step()
    assert ok
    sched.step(increment=args.global_batch_size)
    spec, topo, _ = spec_from_args(args)
    state = from_sharded_state_dict(_unwrap(ddp).sharded_state_dict(), optimizer=opt)
    state["opt_param_scheduler"] = sched.state_dict()
    ckpt = AsyncCheckpointer(root, topology=topo.to_dict(), model_config=asdict(spec),
                             true_vocab_size=MD.MOE["vocab_size"])
    ckpt.save(ITERATION, state)
    ckpt.wait()
    truth = Path(f"{root}.truth")
    truth.mkdir(exist_ok=True)
    dump = MD._truth(ps, ddp, opt, c)
    dump["next_loss"] = MD._next_step(ddp, opt)
    torch.save(dump, truth / f"rank{rank}.pt")
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def hook_save(root: Path, c: dict) -> None:
    """Case ``c``'s run saved by the training hook at ``root``, its truth at ``root.truth``."""
    M._spawn(_hook_worker, WORLD, c, str(root))
