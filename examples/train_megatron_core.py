"""Megatron-Core training on CPU with the distributed optimizer, checkpointed by ckptool's hook.

A real Megatron-Core ``GPTModel`` (local layer spec) at TP x PP x DP over gloo, bf16 weights
with fp32 main params in Megatron's ``DistributedOptimizer`` (``DistributedDataParallel``
with ``use_distributed_optimizer=True``, ``get_megatron_optimizer``), trained by Megatron's
own pipeline schedule (``get_forward_backward_func``) and ``finalize_model_grads``. Run it
under torchrun; world size = TP x PP x DP::

    torchrun --nproc_per_node 4 examples/train_megatron_core.py --save /tmp/mc --tp 2 --pp 2 --steps 4
    # kill it, or let it finish; then resume on another topology:
    torchrun --nproc_per_node 4 examples/train_megatron_core.py --save /tmp/mc --tp 1 --pp 2 --steps 8

Every ``--save-every`` steps each rank describes its weights and its DP range of the fp32
main params and Adam moments with ``training.megatron.sharded_state(..., optimizer=opt)``
and ``training.AsyncCheckpointer`` saves them without stalling the step. On start the newest
valid checkpoint is loaded into the model and the optimizer, whatever topology wrote it.
``ckptool convert STEP_DIR OUT --to megatron-dist`` turns a checkpoint into one
Megatron-Core's own ``dist_checkpointing.load`` reads at any TP/PP/DP. The global batch of
a step depends only on the step, so a resumed run continues the same loss curve (within
bf16 rounding where TP changes; ``--fp32`` for exact).

On GPUs drop :func:`cpu_shims`; the rest is what a Megatron-LM job does.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODEL = dict(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
             vocab_size=256, max_position_embeddings=32, seq_length=32)
GLOBAL_BATCH, MICRO = 8, 2
SEED = 1234


def cpu_shims() -> None:
    """Megatron-Core on CPU: CUDA device and synchronize calls, ``Tensor.cuda``, factories
    asked for ``device="cuda"``, and ``Tensor.type()`` reporting ``torch.cuda.*`` (the
    distributed optimizer groups parameters by it)."""
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    torch.Tensor.cuda = lambda self, *a, **k: self
    plain_type = torch.Tensor.type

    def cuda_type(self, *a, **k):
        r = plain_type(self, *a, **k)
        if not a and not k and isinstance(r, str) and ".cuda." not in r:
            return r.replace("torch.", "torch.cuda.", 1)
        return r

    torch.Tensor.type = cuda_type

    def on_cpu(factory):
        def make(*a, **k):
            if str(k.get("device", "")).startswith("cuda"):
                k["device"] = "cpu"
            return factory(*a, **k)
        return make

    for name in ("tensor", "zeros", "ones", "empty", "full"):
        setattr(torch, name, on_cpu(getattr(torch, name)))


def megatron_args(tp: int, pp: int, dp: int, bf16: bool) -> argparse.Namespace:
    """The Megatron-LM args of the job (what ckptool reads to lay the model out)."""
    m = MODEL
    return argparse.Namespace(
        num_layers=m["num_layers"], hidden_size=m["hidden_size"],
        num_attention_heads=m["num_attention_heads"], ffn_hidden_size=m["ffn_hidden_size"],
        kv_channels=m["hidden_size"] // m["num_attention_heads"], group_query_attention=False,
        num_query_groups=None, vocab_size=m["vocab_size"], padded_vocab_size=m["vocab_size"],
        make_vocab_size_divisible_by=64, max_position_embeddings=m["max_position_embeddings"],
        position_embedding_type="learned_absolute", untie_embeddings_and_output_weights=False,
        add_bias_linear=True, normalization="LayerNorm", swiglu=False,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, data_parallel_size=dp,
        world_size=tp * pp * dp, bf16=bf16, seed=SEED, use_distributed_optimizer=True)


def build(tp: int, pp: int, bf16: bool, lr: float):
    """Parallel state, the DDP-wrapped GPTModel and Megatron's distributed optimizer."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig

    ps.initialize_model_parallel(tp, pp)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.fork = lambda *a, **k: contextlib.nullcontext()  # CPU: no CUDA RNG streams
    dtype = torch.bfloat16 if bf16 else torch.float32
    torch.manual_seed(SEED)  # the same global weights at every topology (CPU initialization)
    cfg = TransformerConfig(
        num_layers=MODEL["num_layers"], hidden_size=MODEL["hidden_size"],
        num_attention_heads=MODEL["num_attention_heads"], ffn_hidden_size=MODEL["ffn_hidden_size"],
        use_cpu_initialization=True, params_dtype=dtype, pipeline_dtype=dtype, bf16=bf16,
        hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, finalize_model_grads_func=finalize_model_grads)
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(),
                     vocab_size=MODEL["vocab_size"], max_sequence_length=MODEL["max_position_embeddings"],
                     pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                     share_embeddings_and_output_weights=True)
    if bf16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(cfg, model)
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=True), model)
    opt = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=lr, weight_decay=0.01, use_distributed_optimizer=True, bf16=bf16,
        params_dtype=dtype, clip_grad=1.0), [ddp])
    return ps, ddp, opt


def global_batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 250, (GLOBAL_BATCH, MODEL["seq_length"] + 1), generator=g)


def train_step(ps, ddp, opt, step: int) -> float | None:
    """One step of Megatron's schedule on this DP rank's share of the step's global batch;
    the mean loss on the last stage (None elsewhere)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    share = GLOBAL_BATCH // dp
    tokens = global_batch(step)[dp_rank * share:(dp_rank + 1) * share]
    seq = MODEL["seq_length"]
    positions = torch.arange(seq).expand(MICRO, seq)
    mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), 1)

    def forward_step(batches, model):
        batch = next(batches)
        out = model(batch[:, :-1], positions, mask, labels=batch[:, 1:])

        def loss(output):
            mean = output.float().mean()
            return mean, {"lm loss": mean.detach().clone()}  # the schedule scales `mean` in place
        return out, loss

    ddp.zero_grad_buffer()
    opt.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(tokens.split(MICRO)), model=[ddp],
        num_microbatches=share // MICRO, seq_length=seq, micro_batch_size=MICRO, forward_only=False)
    ok, _, _ = opt.step()
    assert ok, "the optimizer step was skipped"
    if not ps.is_pipeline_last_stage():
        return None
    loss = torch.stack([x["lm loss"] for x in losses]).mean()
    dist.all_reduce(loss, group=ps.get_data_parallel_group())
    return (loss / dp).item()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--save", required=True, help="run root for checkpoints (path or fsspec URL)")
    ap.add_argument("--load", help="resume from this run root instead of --save's")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--dp", type=int, default=None, help="default: world / (tp * pp)")
    ap.add_argument("--steps", type=int, default=6, help="train until this step")
    ap.add_argument("--save-every", type=int, default=2)
    ap.add_argument("--keep-last", type=int, default=3)
    ap.add_argument("--fp32", action="store_true", help="fp32 weights (default: bf16 + fp32 main params)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--loss-log", help="append one JSON line per step (last stage, TP/DP rank 0)")
    ap.add_argument("--crash-after-save", type=int, default=None,
                    help="simulate a node failure: exit hard right after issuing this step's save")
    args = ap.parse_args(argv)

    from dataclasses import asdict

    from ckptool.core.topology import Topology
    from converters.schemas.megatron_args import spec_from_args
    from training import AsyncCheckpointer
    from training.megatron import sharded_state

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cpu_shims()
    world = dist.get_world_size()
    dp = args.dp or world // (args.tp * args.pp)
    if args.tp * args.pp * dp != world or GLOBAL_BATCH % (MICRO * dp):
        print(f"error: TP{args.tp} x PP{args.pp} x DP{dp} does not fit world size {world} and the "
              f"global batch {GLOBAL_BATCH}", file=sys.stderr)
        return 2
    ps, ddp, opt = build(args.tp, args.pp, not args.fp32, args.lr)
    spec, _, _ = spec_from_args(megatron_args(args.tp, args.pp, dp, not args.fp32),
                                true_vocab_size=MODEL["vocab_size"])
    topo = Topology(tp=args.tp, pp=args.pp, dp=dp)

    def describe() -> dict:
        state = sharded_state(ddp, spec, topo, tp_rank=ps.get_tensor_model_parallel_rank(),
                              pp_rank=ps.get_pipeline_model_parallel_rank(),
                              dp_rank=ps.get_data_parallel_rank(), optimizer=opt)
        state["step"] = 0
        return state

    ckpt = AsyncCheckpointer(args.save, keep_last=args.keep_last, topology=topo.to_dict(),
                             model_config=asdict(spec), true_vocab_size=MODEL["vocab_size"])
    state = describe()
    resumed = ckpt.load_latest(state, root=args.load)
    start = (state["step"] if resumed is not None else 0) + 1
    rank = dist.get_rank()
    if rank == 0:
        print(f"TP{args.tp} PP{args.pp} DP{dp}: "
              + (f"resumed from step {start - 1}" if resumed is not None else "starting fresh"), flush=True)
    logger = None
    if args.loss_log and ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0 \
            and ps.get_data_parallel_rank() == 0:
        os.makedirs(os.path.dirname(os.path.abspath(args.loss_log)), exist_ok=True)
        logger = open(args.loss_log, "a")
    for step in range(start, args.steps + 1):
        t0 = time.perf_counter()
        loss = train_step(ps, ddp, opt, step)
        if logger:
            logger.write(json.dumps({"step": step, "loss": loss, "tp": args.tp, "pp": args.pp,
                                     "dp": dp}) + "\n")
            logger.flush()
            print(f"step {step:4d}  loss {loss:.6f}  ({time.perf_counter() - t0:.2f} s)", flush=True)
        if step % args.save_every == 0 or step == args.steps:
            state = describe()
            state["step"] = step
            ckpt.save(step, state)
            if step == args.crash_after_save:
                os._exit(1)  # a node failure: the save may be half written
    ckpt.wait()
    dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
