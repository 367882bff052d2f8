"""Real Megatron-Core ``torch_dist`` checkpoints holding the distributed optimizer's state
(CPU, gloo, 2 processes).

``train_and_save`` builds a GPTModel (local spec) at the case's TP/PP (DP fills the 2
processes) inside ``DistributedDataParallel(use_distributed_optimizer=True)`` with Megatron's
own optimizer, takes one Adam step from seeded gradients, and saves what Megatron-LM's
``torch_dist`` checkpointing saves: ``dist_checkpointing.save`` of the model's and the
optimizer's sharded state dicts (``metadata["distrib_optim_sharding_type"]`` = the case's
sharding type), with ``content_metadata``. It dumps each process's optimizer shards (the
ground truth, from the optimizer: :func:`tests.harness.mcore_distopt._truth`), then records the loss of a forward
pass before and after a second step (the uninterrupted run).

``resume`` does what Megatron-LM's loader does (``dist_checkpointing.load`` of the model's and
the optimizer's sharded state dicts with ``is_loading=True``, the sharding type taken from the
checkpoint's content metadata, then ``load_state_dict`` of each) at the checkpoint's own
topology, dumps the loaded shards and takes the same second step.

Gradients are seeded per *global* parameter (by global layer index; the tied output layer
as the word embedding) and sliced to this rank's TP shard, so a step at any TP/PP applies
the same update: the loss after it depends on the topology only through float rounding. The vocabulary (256) pads to itself at TP 1 and 2.

Shims: those of :mod:`tests.harness.mcore_distopt`, :func:`tests.harness.mcore_distopt._keep_step_on_load`,
mcore's own dummy optimizer state before loading, and :func:`_unshare_steps`.
"""

from __future__ import annotations

import re
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

from tests.harness import mcore as M
from tests.harness import mcore_distopt as D
from tests.harness.mcore import _spawn

WORLD = D.WORLD
BASE = dict(D.BASE, vocab=256)
CASES = {
    # DP2, several buckets with 64-alignment gaps; the default sharding of Megatron-LM 0.16
    "dp2": dict(BASE, tp=1, pp=1, overlap=True, bucket=6000, sharding="dp_reshardable"),
    "tp2": dict(BASE, tp=2, pp=1, sharding="dp_reshardable"),
    # one bucket: mcore saves fully_reshardable exactly only then
    "full": dict(BASE, tp=2, pp=1, sharding="fully_reshardable"),
    # several buckets: mcore's save shifts the state past the first bucket boundary
    "full-buckets": dict(BASE, tp=1, pp=1, overlap=True, bucket=6000, sharding="fully_reshardable"),
    # PP2, tied embeddings: the word embedding has a bucket of its own on both stages; the
    # first stage's other parameters fill several buckets
    "pp2": dict(BASE, tp=1, pp=2, overlap=True, bucket=6000, sharding="dp_reshardable"),
}
ITERATION = 1


def args_of(c: dict):
    args = D.megatron_args(c)
    args.ckpt_format, args.transformer_impl = "torch_dist", "local"
    return args


def _global_name(name: str, pp_rank: int, c: dict) -> str:
    """A stage's local parameter name with the global layer index (stages split evenly);
    the tied output layer is the word embedding."""
    if c["tied"] and name == "output_layer.weight":
        return "embedding.word_embeddings.weight"
    first = pp_rank * (c["layers"] // c["pp"])
    return re.sub(r"^decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m[1]) + first}.", name)


def _global_grad(name: str, p: torch.Tensor, tp: int, tp_rank: int, step: int) -> torch.Tensor:
    """This rank's slice of a seeded global gradient of parameter ``name``."""
    split = getattr(p, "tensor_model_parallel", False)
    dim = getattr(p, "partition_dim", 0) if split else 0
    shape = list(p.shape)
    if split:
        shape[dim] *= tp
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}/{step}".encode()))
    full = torch.randn(shape, generator=g)
    return full.chunk(tp, dim)[tp_rank] if split else full


def _step(ps, ddp, opt, c: dict, step: int) -> None:
    tp, tp_rank = c["tp"], ps.get_tensor_model_parallel_rank()
    pp_rank = ps.get_pipeline_model_parallel_rank()
    for name, p in D._named(ddp):
        p.main_grad.copy_(_global_grad(_global_name(name, pp_rank, c), p, tp, tp_rank, step))
    ok, _, _ = opt.step()
    assert ok


def _loss(ps, ddp, c: dict) -> float | None:
    """Cross-entropy of a fixed batch after the step (on the first process), or None."""
    m = dict(vocab_size=c["vocab"], hidden_size=c["hidden"])
    logits = M._forward(ps, ddp.module, m, c["tp"], c["pp"])
    if logits is None:
        return None
    labels = M.tokens(c["vocab"]).roll(-1, dims=1)
    return torch.nn.functional.cross_entropy(
        logits.float().transpose(0, 1).reshape(-1, c["vocab"]), labels.reshape(-1)).item()


def _dump_and_continue(rank, ps, ddp, opt, c: dict, out: Path) -> None:
    """This process's optimizer shards, then the loss before and after a second step (saved
    by the first process), all in ``out``; then the case's parallel state is torn down."""
    out.mkdir(exist_ok=True)
    torch.save(D._truth(ps, ddp, opt), out / f"rank{rank}.pt")
    before = _loss(ps, ddp, c)
    _step(ps, ddp, opt, c, 2)
    after = _loss(ps, ddp, c)
    if after is not None:
        torch.save((before, after), out / "loss.pt")
    dist.barrier()
    ps.destroy_model_parallel()


def _sharded(ddp, opt, sharding: str, is_loading: bool = False) -> dict:
    model_sd = ddp.module.sharded_state_dict()
    meta = {"distrib_optim_sharding_type": sharding}
    return {"model": model_sd,
            "optimizer": opt.sharded_state_dict(model_sd, is_loading=is_loading, metadata=meta)}


def _save_worker(rank, cases, root, port):
    from megatron.core import dist_checkpointing

    D._init(rank, port)
    for name, c in cases.items():
        ps, ddp, opt = D._setup(c)
        _step(ps, ddp, opt, c, 1)
        it = Path(root) / name / f"iter_{ITERATION:07d}"
        it.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        meta = {"distrib_optim_sharding_type": c["sharding"]}
        dist_checkpointing.save(
            {**_sharded(ddp, opt, c["sharding"]), "args": args_of(c), "iteration": ITERATION,
             "checkpoint_version": 3.0, "opt_param_scheduler": {"num_steps": ITERATION}},
            str(it), content_metadata=meta)
        if rank == 0:
            (Path(root) / name / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
        _dump_and_continue(rank, ps, ddp, opt, c, Path(root) / f"{name}.truth")
    dist.destroy_process_group()


def _resume_worker(rank, checkpoints, port):
    from megatron.core import dist_checkpointing

    D._init(rank, port)
    D._keep_step_on_load()
    for ckpt in checkpoints:
        it = next(Path(ckpt).glob("iter_*"))
        common = torch.load(it / "common.pt", weights_only=False)
        c = dict(D.case_from_args(common["args"]), vocab=BASE["vocab"])
        sharding = dist_checkpointing.load_content_metadata(str(it))["distrib_optim_sharding_type"]
        ps, ddp, opt = D._setup(c)
        # without TE/Apex (torch Adam) state_dict() needs a step: mcore's own dummy state,
        # which the load replaces in place
        for inner in getattr(opt, "chained_optimizers", [opt]):
            inner._init_optimizer_states_with_dummy_values()
        state = dist_checkpointing.load(_sharded(ddp, opt, sharding, is_loading=True), str(it))
        ddp.module.load_state_dict(state["model"], strict=True)
        with torch.no_grad():  # fp32 masters are views of the parameters (leaves)
            opt.load_state_dict(state["optimizer"])
        _unshare_steps(opt)
        _dump_and_continue(rank, ps, ddp, opt, c, Path(f"{ckpt}.resumed"))
    dist.destroy_process_group()


def _unshare_steps(opt) -> None:
    """Shim for torch Adam (no TE/Apex here): mcore's ``load_state_dict`` gives every
    parameter's state one shared ``step`` tensor, which torch's AdamW then increments once
    per parameter (FusedAdam keeps the step in the param group instead)."""
    for inner in getattr(opt, "chained_optimizers", [opt]):
        for state in inner.optimizer.state.values():
            state["step"] = state["step"].clone()


def train_and_save(root: Path, cases: dict = CASES) -> None:
    """Each case's checkpoint at ``root/<case>``; its truth and loss at ``root/<case>.truth``."""
    _spawn(_save_worker, WORLD, cases, str(root))


def resume(checkpoints: list[Path]) -> None:
    """Load each checkpoint into real mcore at its topology and take the second step; the
    loaded shards and the loss at ``<checkpoint>.resumed`` (see :func:`dumps`)."""
    _spawn(_resume_worker, WORLD, [str(c) for c in checkpoints])


def dumps(folder: Path) -> tuple[list[dict], tuple[float, float]]:
    """The per-process shard dumps and the losses (before, after the second step) saved in
    ``folder``."""
    return ([torch.load(folder / f"rank{r}.pt", weights_only=False) for r in range(WORLD)],
            torch.load(folder / "loss.pt"))
