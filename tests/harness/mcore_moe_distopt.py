"""Real Megatron-Core checkpoints of a MoE GPTModel with Megatron's optimizer (distributed
or not) on CPU (gloo, 2 processes), in Megatron-LM's legacy layout.

``generate`` builds, for each case, the MoE model of :mod:`tests.harness.mcore_moe` (its
``MOE`` sizes, SequentialMLP experts, allgather dispatcher, Mixtral's router) at the case's
TP/EP/ETP (PP = 1, DP fills the 2 processes), every parameter set from a seed of its global
name (:func:`tests.harness.mcore_moe._randomize`, so the global model is the same at any
TP/EP/ETP), wraps it in ``DistributedDataParallel`` with Megatron's own optimizer, takes one
Adam step from gradients seeded per global tensor (:func:`_seeded_grads`) and saves what
Megatron-LM's legacy checkpointing saves, per (tp, pp, ep) directory
``iter_0000001/mp_rank_TT[_EEE]/``. With the distributed optimizer:

- ``distrib_optim.pt`` from ``opt.save_parameter_state`` (collective). At EP > 1 the optimizer
  is a ``ChainedOptimizer`` of two ``DistributedOptimizer`` (dense params sharded over DP,
  expert params over expert-DP) and the file is the list ``[dense_state or None,
  expert_state or None]``, written by a rank whose DP or expert-DP rank is 0, the entry of a
  sub-optimizer whose DP rank is not 0 being None: at EP2 rank 0 writes ``mp_rank_00_000`` =
  [dense, expert(ep0)], rank 1 ``mp_rank_00_001`` = [None, expert(ep1)]. At EP1 mcore marks
  no parameter expert-parallel (``allreduce`` is ``not (is_expert and EP > 1)``): experts sit
  in the dense buffer, there is one ``DistributedOptimizer`` (in a ChainedOptimizer of one,
  which delegates) and rank 0 alone writes ``mp_rank_00`` = one state dict. No two ranks
  write one file.
- ``model_optim_rng.pt`` from the ranks whose DP or expert-DP rank is 0
  (:func:`tests.harness.mcore_moe._writes_legacy`), with ``optimizer`` = ``opt.state_dict()``
  (at EP > 1 a list of the two sub-optimizers' state dicts); the tracker (rank 0).

At TP2, ETP1, EP2 (DP1, expert-DP1) rank 0 is (tp0, ep0) and rank 1 (tp1, ep1): each writes
both files of its own directory, ``mp_rank_00_000`` and ``mp_rank_01_001``, its
``distrib_optim.pt`` being [dense, expert]. At TP2, EP1 (ETP2, DP1) the ranks write
``mp_rank_00`` and ``mp_rank_01``, each one state dict. A TP2 case runs with sequence
parallelism, as Megatron-LM's argument check requires of MoE with TP > 1 (and mcore's
MoELayer raises in training mode without it); of what is saved it changes only
``args.sequence_parallel``.

Without the distributed optimizer (``distopt`` False) the optimizer is a ChainedOptimizer of
``FP32Optimizer`` (dense, expert) at EP > 1, one ``FP32Optimizer`` at EP1, each holding its
parameters whole on every (expert-)DP rank; only ``model_optim_rng.pt`` is written (same
writers), its ``optimizer`` being ``opt.state_dict()``: the torch optimizer's state dict
(``state`` by parameter index, ``param_groups`` with index lists), a list of two at EP > 1.

Ground truth comes from the optimizers themselves: for every sub-optimizer, each process's
shard of every parameter's fp32 master, ``exp_avg`` and ``exp_avg_sq`` (with its range in
the parameter; the whole parameter without the distributed optimizer, whose master is the
parameter itself), keyed by the parameter's global name (an expert's local index made
global), plus mcore's buffer maps (``ddp.buffers`` and ``ddp.expert_parallel_buffers``,
empty at EP1), and ``next_loss``: after the truth is taken, one real training step
(:func:`_next_step`) and its loss.

``load`` does what Megatron-LM's loader does with such a checkpoint, at its own topology,
dumps the same truth and takes the same next step. :func:`canonical_state` joins the dumps
into global tensors by hand.

Shims (test only): those of :mod:`tests.harness.mcore_distopt` (CUDA device/synchronize/
``Tensor.cuda`` on CPU, the CUDA RNG tracker's ``fork``, ``Tensor.type()`` reporting
``torch.cuda.*``, CPU tensors for ``device="cuda"`` factories; for loading
:func:`tests.harness.mcore_distopt._keep_step_on_load` and ``torch.no_grad``), plus
``moe_utils.te_general_gemm = None`` (0.16.1's router names it; it exists only with
Transformer Engine), :func:`_torch_norm_with_sequence_parallel` (torch norms under sequence
parallelism) and :func:`tests.harness.mcore._sliding_window_mask_on_cpu` (unused here: no
sliding window; called as mcore_moe does).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

import tests.harness.mcore as M
import tests.harness.mcore_distopt as D
import tests.harness.mcore_moe as MM

WORLD = 2
MOE = MM.MOE
BASE = dict(tp=1, pp=1, bf16=False, overlap=False, bucket=None, clip=0.0, distopt=True)
"""``clip`` is ``clip_grad``: 0 (no clipping) so that the EP1 and EP2 runs end in bit-identical
global state; with Megatron's default 1.0 the global grad norm differs in its last bits
between EPs (the state by ~1e-10). ``distopt`` is ``use_distributed_optimizer``. A case's
``etp`` (expert TP) is its ``tp`` when absent."""
CASES = {
    # DP2 for the dense params, expert-DP 1: each rank holds its 2 experts whole
    "ep2": dict(BASE, ep=2),
    # DP2 and expert-DP 2: every expert sharded over both ranks
    "ep1": dict(BASE, ep=1),
    # bf16 parameters (Float16Module), fp32 grads and masters
    "ep2_bf16": dict(BASE, ep=2, bf16=True),
    # experts whole (ETP1) on their EP rank, dense params TP-split: (tp0, ep0) and (tp1, ep1)
    "tp2_etp1_ep2": dict(BASE, tp=2, etp=1, ep=2),
    # everything TP-split, experts too (ETP = TP), DP1
    "tp2_ep1": dict(BASE, tp=2, ep=1),
    # the non-distributed optimizer (FP32Optimizer): ep2's and ep1's runs otherwise
    "ep2_plain": dict(BASE, ep=2, distopt=False),
    "ep1_plain": dict(BASE, ep=1, distopt=False),
}
ITERATION = 1


def _etp(c: dict) -> int:
    return c.get("etp", c["tp"])


def megatron_args(c: dict) -> argparse.Namespace:
    """The Megatron-LM args of the job: :func:`tests.harness.mcore_moe.moe_args` on 2
    processes, with the optimizer, DDP and sequence-parallel settings."""
    tp, pp, ep = c["tp"], c["pp"], c["ep"]
    args = MM.moe_args(MOE, tp, pp, ep, _etp(c))
    vars(args).update(
        world_size=WORLD, data_parallel_size=WORLD // (tp * pp), sequence_parallel=tp > 1,
        params_dtype=torch.bfloat16 if c["bf16"] else torch.float32, bf16=c["bf16"],
        use_distributed_optimizer=c["distopt"], overlap_grad_reduce=c["overlap"],
        ddp_bucket_size=c["bucket"], overlap_param_gather_with_optimizer_step=False,
        accumulate_allreduce_grads_in_fp32=True, clip_grad=c["clip"])
    return args


def case_from_args(args: argparse.Namespace) -> dict:
    """The case a checkpoint's args describe (what a resuming job would be launched with)."""
    return dict(BASE, tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
                ep=args.expert_model_parallel_size, etp=args.expert_tensor_parallel_size,
                bf16=args.params_dtype == torch.bfloat16, overlap=args.overlap_grad_reduce,
                bucket=args.ddp_bucket_size, clip=args.clip_grad,
                distopt=args.use_distributed_optimizer)


def _shims():
    D._shims()
    from megatron.core.transformer.moe import moe_utils

    moe_utils.te_general_gemm = None
    _torch_norm_with_sequence_parallel()


def _torch_norm_with_sequence_parallel():
    """Without TE or apex the local spec's norms are torch's (``WrappedTorchNorm``), which
    refuse ``sequence_parallel``; mcore's own norms that take it (FusedLayerNorm, TENorm)
    normalize the local sequence chunk as any norm does and mark their parameters
    ``sequence_parallel`` so that ``finalize_model_grads`` sums their grads over TP. The shim
    builds the torch norm as without sequence parallelism and marks its parameters so."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    plain = WrappedTorchNorm.__new__

    def new(cls, config, hidden_size, *a, **k):
        sp, config.sequence_parallel = config.sequence_parallel, False
        try:
            norm = plain(cls, config, hidden_size, *a, **k)
        finally:
            config.sequence_parallel = sp
        for q in norm.parameters():
            q.sequence_parallel = sp
        return norm

    WrappedTorchNorm.__new__ = staticmethod(new)


def _setup(c: dict):
    """Parallel state, MoE model, DDP and optimizer of one case on this process
    (sequence parallelism at TP > 1)."""
    from megatron.core import parallel_state as ps, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig

    tp, pp, ep, etp = c["tp"], c["pp"], c["ep"], _etp(c)
    assert pp == 1
    ps.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=etp)
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    M._sliding_window_mask_on_cpu()
    dtype = torch.bfloat16 if c["bf16"] else torch.float32
    m = MOE
    torch.manual_seed(1234)
    cfg = TransformerConfig(
        num_layers=m["num_layers"], hidden_size=m["hidden_size"],
        num_attention_heads=m["num_attention_heads"], num_query_groups=m["num_query_groups"],
        ffn_hidden_size=m["ffn_hidden_size"], use_cpu_initialization=True,
        gated_linear_unit=m["swiglu"], activation_func=torch.nn.functional.silu,
        add_bias_linear=m["bias"], normalization=m["norm"], params_dtype=dtype,
        pipeline_dtype=dtype, bf16=c["bf16"], hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=tp > 1,
        num_moe_experts=m["num_experts"], moe_ffn_hidden_size=m["moe_ffn_hidden_size"],
        moe_router_topk=m["topk"], moe_router_score_function="softmax",
        moe_router_pre_softmax=False, moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=False, moe_expert_capacity_factor=None,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    spec = get_gpt_layer_local_spec(num_experts=m["num_experts"], moe_grouped_gemm=False,
                                    normalization=m["norm"])
    model = GPTModel(config=cfg, transformer_layer_spec=spec,
                     vocab_size=M.padded(m["vocab_size"], m["divisible_by"], tp),
                     max_sequence_length=M.SEQ, pre_process=True, post_process=True,
                     share_embeddings_and_output_weights=m["tied"],
                     position_embedding_type=m["pos"])
    MM._randomize(ps, model, m)  # global values (rounded to bf16 if so): the same at any TP/EP
    if c["bf16"]:  # as Megatron-LM's get_model: every parameter in bf16
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(cfg, model)
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(
        use_distributed_optimizer=c["distopt"], overlap_grad_reduce=c["overlap"],
        bucket_size=c["bucket"], grad_reduce_in_fp32=True), model)
    opt = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=1e-2, weight_decay=0.1, use_distributed_optimizer=c["distopt"],
        bf16=c["bf16"], params_dtype=dtype, clip_grad=c["clip"]), [ddp])
    return ps, ddp, opt


def _local_experts(ps) -> int:
    return MOE["num_experts"] // ps.get_expert_model_parallel_world_size()


def _named(ps, ddp):
    """(global name, parameter) of every local parameter: the state-dict name (no
    Float16Module prefix) with an expert's local index made global."""
    ep_rank, local = ps.get_expert_model_parallel_rank(), _local_experts(ps)
    return [(MM.global_name(n.removeprefix("module."), ep_rank, local), p)
            for n, p in ddp.module.named_parameters()]


def _is_expert(p) -> bool:
    return not getattr(p, "allreduce", True)


def _tp(ps, name: str) -> tuple[int, int]:
    """(rank, size) of the group parameter ``name`` is TP-split over: expert TP for an
    expert's (by name: mcore marks experts ``allreduce = False`` only at EP > 1), else TP."""
    if _expert_name(name):
        return ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


def _seeded_grads(ps, ddp):
    """Deterministic gradients: the global tensor's from a seed of the global name, cut for
    this rank as the weight is cut (:func:`tests.harness.mcore_moe._randomize`: stride·world
    chunks on the partition dim, every world-th one), so the global gradient is the same at
    any TP/EP/ETP; a replicated parameter's is the same on every rank, as after Megatron's
    all-reduces."""
    for name, p in _named(ps, ddp):
        shape = list(p.shape)
        split = getattr(p, "tensor_model_parallel", False)
        rank, world = _tp(ps, name)
        if split:
            shape[p.partition_dim] *= world
        seed = zlib.crc32(f"{name}/grad".encode())
        full = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
        if split:
            chunks = full.chunk(p.partition_stride * world, dim=p.partition_dim)
            full = torch.cat(chunks[rank::world], dim=p.partition_dim)
        p.main_grad.copy_(full)


def _inner(opt) -> list:
    return list(opt.chained_optimizers) if hasattr(opt, "chained_optimizers") else [opt]


def _buffer_info(b, names) -> dict:
    return {"key": (b.param_dtype, b.grad_dtype), "buckets": list(b.bucket_indices),
            "numel": b.numel, "unpadded": [k.numel_unpadded for k in b.buckets],
            "numel_unpadded": b.numel_unpadded,
            "params": {names[p]: tuple(v) for p, v in b.param_index_map.items()}}


def _shard(inner, p):
    """(start, end, {kind: flat tensor}) of ``p`` in sub-optimizer ``inner`` on this process,
    or None where it holds none of it: a DistributedOptimizer's range of the fp32 master
    and moments; an FP32Optimizer's whole parameter (its own master) and torch Adam state."""
    if hasattr(inner, "model_param_group_index_map"):
        if p not in inner.model_param_group_index_map:
            return None  # not in this sub-optimizer, or no element of it on this DP rank
        r = inner._get_model_param_range_map(p)["param"]
        state = inner._get_main_param_and_optimizer_states(p)
        return r.start, r.end, {k: state[k].detach().clone() for k in KINDS}
    if not any(p is q for g in inner.optimizer.param_groups for q in g["params"]):
        return None
    state = {"param": p, **inner.optimizer.state[p]}
    return 0, p.numel(), {k: state[k].detach().reshape(-1).clone() for k in KINDS}


def _truth(ps, ddp, opt, c: dict) -> dict:
    """This process's optimizer shards (every sub-optimizer), per local parameter by global
    name, and mcore's buffer maps (dense and expert)."""
    named = _named(ps, ddp)
    names = {p: n for n, p in named}
    shards, owner = {}, {}
    for i, inner in enumerate(_inner(opt)):
        for name, p in named:
            shard = _shard(inner, p)
            if shard is None:
                continue
            assert name not in shards, name
            start, end, tensors = shard
            shards[name] = (start, end, tuple(p.shape), tensors)
            owner[name] = i
    return {"tp": ps.get_tensor_model_parallel_rank(), "pp": ps.get_pipeline_model_parallel_rank(),
            "dp": ps.get_data_parallel_rank(), "ep": ps.get_expert_model_parallel_rank(),
            "edp": ps.get_expert_data_parallel_rank(),
            "etp": ps.get_expert_tensor_parallel_rank(),
            "tp_size": ps.get_tensor_model_parallel_world_size(),
            "etp_size": ps.get_expert_tensor_parallel_world_size(), "distopt": c["distopt"],
            "shards": shards, "optimizer_index": owner,
            "buffers": [_buffer_info(b, names) for b in ddp.buffers],
            "expert_buffers": [_buffer_info(b, names) for b in ddp.expert_parallel_buffers],
            "names": [(n, tuple(p.shape), _is_expert(p), getattr(p, "tensor_model_parallel", False),
                       getattr(p, "partition_dim", -1), getattr(p, "partition_stride", 1))
                      for n, p in named]}


def _next_step(ddp, opt) -> float:
    """One real training step, as Megatron-LM's ``train_step`` takes it, on the fixed batch
    :func:`tests.harness.mcore._batch` (token ids modulo the true vocabulary): zero the grad
    buffers, forward to the per-token loss (mean), backward, ``finalize_model_grads`` (DDP's
    grad sync: every grad scaled by 1/DP and summed over its DP group, expert-DP for the
    experts at EP > 1; the TP all-reduce of sequence-parallel params' grads), the optimizer
    step. Every rank sees the same batch and computes the same loss; returns it (the loss
    of the weights before the step: it does not depend on the optimizer state)."""
    from megatron.core.distributed import finalize_model_grads

    tok, labels = (t % MOE["vocab_size"] for t in M._batch(ITERATION))
    pos = torch.arange(M.SEQ).expand(M.BATCH, M.SEQ)
    mask = torch.triu(torch.ones(1, 1, M.SEQ, M.SEQ, dtype=torch.bool), 1)
    ddp.train()
    ddp.zero_grad_buffer()
    opt.zero_grad()
    loss = ddp(tok, pos, mask, labels=labels).float().mean()
    loss.backward()
    finalize_model_grads([ddp])
    ok, _, _ = opt.step()
    assert ok
    return loss.item()


def _init(rank: int, port: int):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    _shims()


def _dir(ps, root, c: dict) -> Path:
    return Path(root) / f"iter_{ITERATION:07d}" / MM.rank_dir(
        ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
        ps.get_expert_model_parallel_rank(), c["pp"], c["ep"])


TRAIN_ITERS = 2
"""The job's ``--train-iters`` (and ``--lr-decay-iters``): what its LR scheduler records."""


def scheduler(opt, dp: int):
    """Megatron-LM's ``get_optimizer_param_scheduler`` (iteration based) of the job at DP
    ``dp``: constant LR and weight decay, steps counted in samples (``global_batch_size``).
    Building it sets each group's weight decay to ``WD * wd_mult``, as a job's does."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    gbs = M.BATCH * dp
    return OptimizerParamScheduler(
        opt, init_lr=0.0, max_lr=M.LR, min_lr=0.0, lr_warmup_steps=0, lr_decay_steps=TRAIN_ITERS * gbs,
        lr_decay_style="constant", start_wd=M.WD, end_wd=M.WD, wd_incr_steps=TRAIN_ITERS * gbs,
        wd_incr_style="constant", use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=False, wsd_decay_steps=None, lr_wsd_decay_style=None)


def _scheduler_state(opt, dp: int) -> dict:
    """What Megatron-LM saves as ``opt_param_scheduler`` (its loader needs every field): the
    :func:`scheduler`'s state after the one step. Built after the step, so that step is the
    schedule-less one of every case."""
    sched = scheduler(opt, dp)
    sched.step(increment=M.BATCH * dp)
    return sched.state_dict()


def _generate_worker(rank, cases, root, port):
    _init(rank, port)
    for name, c in cases.items():
        ps, ddp, opt = _setup(c)
        _seeded_grads(ps, ddp)
        ok, _, _ = opt.step()
        assert ok
        d = _dir(ps, Path(root) / name, c)
        d.mkdir(parents=True, exist_ok=True)
        scheduler = _scheduler_state(opt, megatron_args(c).data_parallel_size)
        if c["distopt"]:  # collective; written where the dense or the expert DP rank is 0
            opt.save_parameter_state(str(d / "distrib_optim.pt"))
        if MM._writes_legacy(ps):
            torch.save({"args": megatron_args(c), "checkpoint_version": 3.0, "iteration": ITERATION,
                        "model": ddp.module.state_dict_for_save_checkpoint(),
                        "optimizer": opt.state_dict(),
                        "opt_param_scheduler": scheduler,
                        "rng_state": [{"torch_rng_state": torch.get_rng_state()}]},
                       d / "model_optim_rng.pt")
        if rank == 0:
            (Path(root) / name / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
        truth = Path(root) / f"{name}.truth"
        truth.mkdir(exist_ok=True)
        dump = _truth(ps, ddp, opt, c)
        dump["next_loss"] = _next_step(ddp, opt)  # the uninterrupted run goes on
        torch.save(dump, truth / f"rank{rank}.pt")
        dist.barrier()
        ps.destroy_model_parallel()
    dist.destroy_process_group()


def _load_worker(rank, checkpoints, port):
    _init(rank, port)
    D._keep_step_on_load()
    for ckpt in checkpoints:
        tracker = (Path(ckpt) / "latest_checkpointed_iteration.txt").read_text().strip()
        it = Path(ckpt) / f"iter_{int(tracker):07d}"
        first = next(it.glob("mp_rank_*/model_optim_rng.pt"))
        c = case_from_args(torch.load(first, weights_only=False)["args"])
        ps, ddp, opt = _setup(c)
        d = it / MM.rank_dir(ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
                             ps.get_expert_model_parallel_rank(), c["pp"], c["ep"])
        state = torch.load(d / "model_optim_rng.pt", weights_only=False)
        # Megatron-LM's check_checkpoint_args compares TP and PP (not EP); a file of another
        # EP holds other experts under the same local names.
        assert state["args"].tensor_model_parallel_size == c["tp"]
        assert state["args"].pipeline_model_parallel_size == c["pp"]
        assert state["args"].expert_model_parallel_size == c["ep"]
        assert state["args"].expert_tensor_parallel_size == _etp(c)
        ddp.module.load_state_dict(state["model"], strict=True)
        opt.load_state_dict(state["optimizer"])
        if c["distopt"]:
            with torch.no_grad():  # fp32 masters are views of the parameters (leaves)
                opt.load_parameter_state(str(d / "distrib_optim.pt"))
        dump_loaded(ps, ddp, opt, c, ckpt, rank)
    dist.destroy_process_group()


def dump_loaded(ps, ddp, opt, c: dict, ckpt, rank: int, **extra) -> None:
    """After a load: this process's truth, ``extra`` and the ``next_loss`` of one more real
    step, saved as ``<ckpt>.loaded-rank{rank}.pt``; then the model-parallel state ends."""
    dump = {**_truth(ps, ddp, opt, c), **extra}
    dump["next_loss"] = _next_step(ddp, opt)
    torch.save(dump, Path(f"{ckpt}.loaded-rank{rank}.pt"))
    dist.barrier()
    ps.destroy_model_parallel()


def generate(root: Path, cases: dict = CASES) -> None:
    """Write each case's checkpoint at ``root/<case>`` and its truth at ``root/<case>.truth``
    (the state as saved, and the ``next_loss`` of one more real step)."""
    M._spawn(_generate_worker, WORLD, cases, str(root))


def load(checkpoints: list[Path]) -> list[list[dict]]:
    """Load each checkpoint into real mcore at its own topology (with ``distrib_optim.pt``
    where it was written with the distributed optimizer); each process's truth dump, with
    the ``next_loss`` of the step :func:`generate` took after saving."""
    M._spawn(_load_worker, WORLD, [str(c) for c in checkpoints])
    return [[torch.load(f"{c}.loaded-rank{r}.pt", weights_only=False) for r in range(WORLD)]
            for c in checkpoints]


def truth(root: Path, name: str) -> list[dict]:
    """The per-process truth dumps of case ``name`` as generated."""
    return [torch.load(root / f"{name}.truth" / f"rank{r}.pt", weights_only=False)
            for r in range(WORLD)]


# ------------------------------- the truth as global tensors (shards joined by hand)

KINDS = ("param", "exp_avg", "exp_avg_sq")


def canonical_state(dumps: list[dict]) -> dict:
    """(kind, global parameter name) -> the global fp32 tensor, for kind in :data:`KINDS`.

    The distributed optimizer's DP (or expert-DP) ranks' flat shards of one local tensor are
    joined first (their ranges must cover it exactly); the non-distributed optimizer's ranks
    each hold a whole copy, and the copies must be equal. Then a parameter held by several
    (expert-)TP ranks is joined on its partition dim if TP-split, cut back as
    :func:`tests.harness.mcore_moe._randomize` cuts it (each piece is ``stride`` chunks,
    piece r holding global chunks r, r + world, ...: a gated fc1's [gate_r; up_r]), so the
    result is the global tensor; else all copies must be equal. Experts keep one entry per
    global expert name (``...mlp.experts.local_experts.<global>.linear_fc1.weight``);
    nothing is stacked."""
    local: dict = {}  # (tp rank, name, copy) -> entry
    info: dict = {}
    for i, dump in enumerate(dumps):
        for name, _, _, split, dim, stride in dump["names"]:
            world = dump["etp_size"] if _expert_name(name) else dump["tp_size"]
            info[name] = (split, dim, stride, world)
        for name, (start, end, shape, tensors) in dump["shards"].items():
            tp_rank = dump["etp"] if _expert_name(name) else dump["tp"]
            key = (tp_rank, name, 0 if dump["distopt"] else i)
            entry = local.setdefault(key, {"shape": shape, "seen": torch.zeros(
                torch.Size(shape).numel(), dtype=torch.int32)})
            for kind, t in tensors.items():
                flat = entry.setdefault(kind, torch.zeros(torch.Size(shape).numel()))
                flat[start:end] = t
            entry["seen"][start:end] += 1
    parts: dict = {}  # name -> tp rank -> copies
    for (tp_rank, name, _), entry in sorted(local.items()):
        assert torch.all(entry["seen"] == 1), f"{name}: DP shards do not cover it exactly once"
        parts.setdefault(name, {}).setdefault(tp_rank, []).append(entry)
    out = {}
    for name, by_rank in parts.items():
        split, dim, stride, world = info[name]
        for kind in KINDS:
            pieces = []
            for _, copies in sorted(by_rank.items()):
                tensors = [e[kind].view(e["shape"]) for e in copies]
                assert all(torch.equal(tensors[0], x) for x in tensors), f"{name}: copies differ"
                pieces.append(tensors[0])
            if split:
                assert len(pieces) == world, f"{name}: {len(pieces)} of {world} TP pieces"
                chunks = [x.chunk(stride, dim=dim) for x in pieces]
                out[(kind, name)] = torch.cat(
                    [chunks[k % world][k // world] for k in range(stride * world)], dim=dim)
            else:
                assert all(torch.equal(pieces[0], x) for x in pieces), name
                out[(kind, name)] = pieces[0]
    return out


def _expert_name(name: str) -> bool:
    return ".local_experts." in name
