"""Megatron-DeepSpeed-style 3D training on CPU, checkpointed by ckptool's save hook.

A DeepSpeed ``PipelineEngine`` over a GPTModelPipe-shaped ``PipelineModule`` (the spec list
Megatron-DeepSpeed builds: the fp16 cast, the tied embedding, the transformer layers under
their legacy names, the final LayerNorm, the tied head) with Megatron tensor parallelism on
the ``model`` axis of DeepSpeed's topology and ZeRO-1 (or bf16 with DeepSpeed's
BF16_Optimizer) across DP. Run it under torchrun; world size = TP x PP x DP::

    torchrun --nproc_per_node 4 examples/train_megatron_deepspeed.py --save /tmp/mds --tp 2 --pp 2 --steps 6
    # kill it, or let it finish; then resume on another topology:
    torchrun --nproc_per_node 4 examples/train_megatron_deepspeed.py --save /tmp/mds --tp 1 --pp 2 --steps 10

Every ``--save-every`` steps each rank describes its state with
``training.deepspeed.sharded_state(engine, args=ARGS)`` (the layout rules ckptool's offline
pipeline reader uses, from the job's Megatron args) and ``training.AsyncCheckpointer`` saves
it without stalling the step. On start the newest valid checkpoint is loaded into the
engine, whatever topology wrote it, then ``training.deepspeed.restore`` puts back the step
counters, the LR schedule and the loss scaler. The global batch of a step depends only on the
step, so a resumed run continues the same loss curve.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from examples import tp as tensor_parallel  # noqa: E402
from examples.tp import TP, CopyToTP, GatherFromTP, ReduceFromTP  # noqa: E402

ARGS = dict(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
            kv_channels=16, max_position_embeddings=32, seq_length=32, padded_vocab_size=256,
            make_vocab_size_divisible_by=64, layernorm_epsilon=1e-5, normalization="layernorm",
            openai_gelu=True, untie_embeddings_and_output_weights=False, add_bias_linear=True,
            add_position_embedding=True, use_rotary_position_embeddings=False,
            num_key_value_heads=4, swiglu=False, seed=1234)
"""The model's Megatron-DeepSpeed arguments (its own spellings), as ``megatron.get_args()``
holds them: what ``sharded_state`` reads to place each tensor. GPT-2 math: LayerNorm, tanh
GELU, learned positions, tied embeddings, biases; vocab 256 pads to itself at TP 1, 2, 4."""
GLOBAL_BATCH, MICRO = 8, 2


def _column(inputs: int, outputs: int) -> nn.Linear:
    """Column-parallel: this rank's ``outputs // TP`` rows of weight and bias."""
    return nn.Linear(inputs, outputs // TP.size)


class _Row(nn.Linear):
    """Row-parallel: this rank's ``inputs // TP`` columns; the whole bias, added once."""

    def __init__(self, inputs: int, outputs: int):
        super().__init__(inputs // TP.size, outputs)

    def forward(self, x):
        return ReduceFromTP.apply(F.linear(x, self.weight)) + self.bias


class EmbeddingPipe(nn.Module):
    """Vocab-parallel word embeddings (rows ``[rank·n, (rank+1)·n)``) + learned positions."""

    def __init__(self):
        super().__init__()
        h = ARGS["hidden_size"]
        self.word_embeddings = nn.Embedding(ARGS["padded_vocab_size"] // TP.size, h)
        self.position_embeddings = nn.Embedding(ARGS["max_position_embeddings"], h)
        for table in (self.word_embeddings, self.position_embeddings):  # Megatron's init_method_std
            nn.init.normal_(table.weight, std=0.02)

    @property
    def word_embeddings_weight(self):
        return self.word_embeddings.weight

    def forward(self, ids):
        rows = self.word_embeddings.num_embeddings
        local = ids - TP.rank * rows
        outside = (local < 0) | (local >= rows)
        words = self.word_embeddings(local.masked_fill(outside, 0)).masked_fill(outside[..., None], 0.0)
        pos = torch.arange(ids.shape[1], device=ids.device)
        return ReduceFromTP.apply(words) + self.position_embeddings(pos)[None]


class ParallelAttention(nn.Module):
    """This rank's heads; ``query_key_value`` rows per head ``[q_h; k_h; v_h]`` (checkpoint
    version 3.0)."""

    def __init__(self):
        super().__init__()
        h = ARGS["hidden_size"]
        self.query_key_value = _column(h, 3 * h)
        self.dense = _Row(h, h)

    def forward(self, x):
        b, s, _ = x.shape
        d = ARGS["kv_channels"]
        heads = ARGS["num_attention_heads"] // TP.size
        qkv = self.query_key_value(CopyToTP.apply(x)).view(b, s, heads, 3 * d)
        q, k, v = (t.transpose(1, 2) for t in qkv.split(d, dim=-1))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.dense(out.transpose(1, 2).reshape(b, s, heads * d))


class ParallelMLP(nn.Module):
    def __init__(self):
        super().__init__()
        h, f = ARGS["hidden_size"], ARGS["ffn_hidden_size"]
        self.dense_h_to_4h = _column(h, f)
        self.dense_4h_to_h = _Row(f, h)

    def forward(self, x):
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(CopyToTP.apply(x)), approximate="tanh"))


class ParallelTransformerLayerPipe(nn.Module):
    """A pre-LN GPT layer under Megatron-DeepSpeed's legacy local names."""

    def __init__(self):
        super().__init__()
        h, eps = ARGS["hidden_size"], ARGS["layernorm_epsilon"]
        self.input_layernorm = nn.LayerNorm(h, eps=eps)
        self.self_attention = ParallelAttention()
        self.post_attention_layernorm = nn.LayerNorm(h, eps=eps)
        self.mlp = ParallelMLP()

    def forward(self, x):
        x = x + self.self_attention(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


def _to_float16(ids):
    return ids  # GPTModelPipe's first spec (a function: no state, no layer file)


def _logits(embedding, hidden):
    """The tied head: this rank's vocabulary shard of the logits, gathered over TP."""
    return GatherFromTP.apply(CopyToTP.apply(hidden) @ embedding.word_embeddings_weight.t())


def _loss(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


def gpt_model_pipe(topology):
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    specs = [_to_float16,
             TiedLayerSpec("embed", EmbeddingPipe, tied_weight_attr="word_embeddings_weight"),
             *[LayerSpec(ParallelTransformerLayerPipe) for _ in range(ARGS["num_layers"])],
             LayerSpec(nn.LayerNorm, ARGS["hidden_size"], eps=ARGS["layernorm_epsilon"]),
             TiedLayerSpec("embed", EmbeddingPipe, forward_fn=_logits,
                           tied_weight_attr="word_embeddings_weight")]
    return PipelineModule(layers=specs, loss_fn=_loss, topology=topology,
                          partition_method="type:transformer")


def param_groups(model) -> list[dict]:
    """Megatron's two groups: weight decay on the matrices, none on biases and norms."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() == 2], "weight_decay": 0.01},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def mark_tensor_parallel(model) -> None:
    """Megatron's ``tensor_model_parallel`` attribute on the TP-split parameters, so DeepSpeed's
    gradient norm counts the replicated ones once."""
    split = ("word_embeddings.weight", "query_key_value.weight", "query_key_value.bias",
             "dense_h_to_4h.weight", "dense_h_to_4h.bias", "self_attention.dense.weight",
             "dense_4h_to_h.weight")
    for name, p in model.named_parameters():
        p.tensor_model_parallel = name.endswith(split)


def global_batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 250, (GLOBAL_BATCH, ARGS["seq_length"] + 1), generator=g)


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
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--zero", type=int, choices=[0, 1], default=1,
                    help="ZeRO stage: 1, or 0 (bf16: DeepSpeed's BF16_Optimizer)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--loss-log", help="append one JSON line per step (global rank 0)")
    ap.add_argument("--crash-after-save", type=int, default=None,
                    help="simulate a node failure: exit hard right after issuing this step's save")
    args = ap.parse_args(argv)

    import deepspeed
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
    from deepspeed.utils import logger as ds_logger

    from converters.schemas.megatron_args import spec_from_args
    from training import AsyncCheckpointer
    from training.deepspeed import restore, sharded_state

    ds_logger.setLevel("ERROR")
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    dp = args.dp or world // (args.tp * args.pp)
    if args.tp * args.pp * dp != world or GLOBAL_BATCH % (MICRO * dp):
        print(f"error: TP{args.tp} x PP{args.pp} x DP{dp} does not fit world size {world} and the "
              f"global batch {GLOBAL_BATCH}", file=sys.stderr)
        return 2
    topology = PipeModelDataParallelTopology(num_pp=args.pp, num_mp=args.tp, num_dp=dp)
    for ranks in topology.get_axis_comm_lists("model"):  # every rank creates every group
        group = dist.new_group(ranks)
        if rank in ranks:
            tensor_parallel.use(group, ranks.index(rank), len(ranks))
    torch.manual_seed(ARGS["seed"])
    model = gpt_model_pipe(topology)
    mark_tensor_parallel(model)
    config = {
        "train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GLOBAL_BATCH // (MICRO * dp), "gradient_clipping": 1.0,
        "steps_per_print": 10**9, "zero_optimization": {"stage": args.zero},
        "optimizer": {"type": "AdamW", "params": {"torch_adam": True, "lr": args.lr}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": args.lr,
                                                     "warmup_num_steps": 4}},
    }
    if args.precision == "bf16":
        config["bf16"] = {"enabled": True}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(model),
                                           config=config)

    from dataclasses import asdict

    megatron_args = dict(ARGS, tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
                         bf16=args.precision == "bf16")
    spec, _, _ = spec_from_args(argparse.Namespace(**megatron_args))
    ckpt = AsyncCheckpointer(args.save, keep_last=args.keep_last, model_config=asdict(spec),
                             topology={"tp": args.tp, "pp": args.pp, "dp": dp, "zero": args.zero})
    state = sharded_state(engine, args=megatron_args)
    resumed = ckpt.load_latest(state, root=args.load)
    if resumed is not None:
        restore(engine, state)
    start = (resumed or 0) + 1
    if rank == 0:
        print(f"TP{args.tp} PP{args.pp} DP{dp}: "
              + (f"resumed from step {resumed}" if resumed is not None else "starting fresh"), flush=True)
    logger = None
    if args.loss_log and rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(args.loss_log)), exist_ok=True)
        logger = open(args.loss_log, "a")
    share = GLOBAL_BATCH // dp
    for step in range(start, args.steps + 1):
        t0 = time.perf_counter()
        tokens = global_batch(step)[engine.grid.data_parallel_id * share:][:share]
        loss = float(engine.train_batch(iter([(t[:, :-1], t[:, 1:]) for t in tokens.split(MICRO)])))
        if logger:
            logger.write(json.dumps({"step": step, "loss": loss, "tp": args.tp, "pp": args.pp,
                                     "dp": dp}) + "\n")
            logger.flush()
            print(f"step {step:4d}  loss {loss:.6f}  ({time.perf_counter() - t0:.2f} s)", flush=True)
        if step % args.save_every == 0 or step == args.steps:
            ckpt.save(step, sharded_state(engine, args=megatron_args))
            if step == args.crash_after_save:
                os._exit(1)  # a node failure: the save may be half written
    ckpt.wait()
    dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
