"""A tiny Llama-style model trained with real TP x PP x DP on CPU, checkpointed by ckptool.

Run it under torchrun; world size = TP x PP x DP::
    torchrun --nproc_per_node 4 examples/train_tiny.py --save /tmp/run --tp 2 --pp 2 --steps 8
    # kill it, or let it finish; then resume on another topology:
    torchrun --nproc_per_node 2 examples/train_tiny.py --save /tmp/run --tp 1 --pp 1 --dp 2 --steps 12

What is real here:

* tensor parallelism: Megatron's column-parallel (QKV grouped per query group with GQA,
  SwiGLU fc1 as ``[gate_r; up_r]``, the output layer) and row-parallel (``linear_proj``,
  ``linear_fc2``) linears and a vocab-parallel embedding, with the all-reduces of the
  forward and backward passes over a gloo TP group;
* pipeline parallelism: each stage is its own process holding its layers; activations go
  forward and gradients back by ``send``/``recv`` (all forward, then all backward, over
  the micro-batches);
* data parallelism: each DP rank takes its part of the global batch; gradients are
  averaged over the DP group.

Each rank builds the global description of its parameters and Adam state with
``training.megatron.sharded_state`` (the layout rules ckptool's offline tools use) and
saves every ``--save-every`` steps with ``training.AsyncCheckpointer``. On start it
resumes from the newest valid checkpoint, whatever topology wrote it. The global batch
of each step depends only on the step, so a resumed run continues the same loss curve.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ckptool.core.layout import ModelSpec, global_params, layout  # noqa: E402
from examples import tp as tensor_parallel  # noqa: E402
from examples.tp import CopyToTP, GatherFromTP, ReduceFromTP  # noqa: E402
from ckptool.core.topology import Topology  # noqa: E402
from training import AsyncCheckpointer  # noqa: E402
from training.megatron import sharded_state  # noqa: E402

SPEC = ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                 ffn_hidden_size=128, vocab_size=250, vocab_rows=256,
                 make_vocab_size_divisible_by=8, swiglu=True, tied_embeddings=False,
                 add_bias=False, normalization="RMSNorm", learned_positions=False)
"""vocab 250 pads to 256 rows at TP 1, 2 and 4 (multiple of 8 x TP); the padding rows take
part in the softmax as in Megatron, so they are part of the checkpoint."""
SEQ = 32
GLOBAL_BATCH = 4


# ----------------------------------------------------------------------------- parallel state


class Groups:
    """Megatron's rank order: TP fastest, then DP, then PP."""

    def __init__(self, tp: int, pp: int, dp: int):
        self.tp, self.pp, self.dp = tp, pp, dp
        rank = dist.get_rank()
        self.tp_rank, rest = rank % tp, rank // tp
        self.dp_rank, self.pp_rank = rest % dp, rest // dp
        self.tp_group = self.dp_group = None
        for p in range(pp):  # every rank must create every group, in the same order
            for d in range(dp):
                ranks = [self.rank_of(t, d, p) for t in range(tp)]
                group = dist.new_group(ranks)
                if rank in ranks:
                    self.tp_group = group
        for p in range(pp):
            for t in range(tp):
                ranks = [self.rank_of(t, d, p) for d in range(dp)]
                group = dist.new_group(ranks)
                if rank in ranks:
                    self.dp_group = group

    def rank_of(self, tp_rank: int, dp_rank: int, pp_rank: int) -> int:
        return tp_rank + self.tp * (dp_rank + self.dp * pp_rank)

    @property
    def first(self) -> bool:
        return self.pp_rank == 0

    @property
    def last(self) -> bool:
        return self.pp_rank == self.pp - 1


G: Groups


# ------------------------------------------------------------------------------------ model


def rms_norm(x, weight, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x):
    """Rotary position embedding over the last dim of ``[b, s, heads, d]``."""
    b, s, h, d = x.shape
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = torch.arange(s, dtype=torch.float32)[:, None] * inv[None, :]
    cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Stage(torch.nn.Module):
    """This rank's part of the model, with Megatron-Core local-spec parameter names."""

    def __init__(self, spec: ModelSpec, topo: Topology, tp_rank: int, pp_rank: int):
        super().__init__()
        self.spec, self.topo, self.tp_rank, self.pp_rank = spec, topo, tp_rank, pp_rank
        rank = layout(spec, topo)[pp_rank * topo.tp + tp_rank]
        self.local = {t.name: t for t in rank.tensors}
        self.layers = sorted({int(n.split(".")[2]) for n in self.local if n.startswith("decoder.layers.")})
        # Parameters come from the global initial tensors, cut by the layout rules: the same
        # model at any topology.
        init = initial_weights(spec)
        from converters.schemas.megatron import SCHEMAS

        self._names = {}
        for name, t in self.local.items():
            local = torch.zeros(t.shard.shape)
            for region, view in t.shard.views(local):
                view.copy_(init[region.key][tuple(slice(o, o + n) for o, n in
                                                  zip(region.offsets, region.lengths))].reshape(-1))
            mname = SCHEMAS["mcore-local"].from_canonical(name, range(0), pp_rank, topo.pp)
            self._names[name] = mname
            self.register_parameter(mname.replace(".", "__"), torch.nn.Parameter(local))

    def named_parameters(self, *args, **kwargs):  # Megatron names, dotted
        for name, p in super().named_parameters(*args, **kwargs):
            yield name.replace("__", "."), p

    def p(self, canonical: str) -> torch.nn.Parameter:
        return getattr(self, self._names[canonical].replace(".", "__"))

    def forward(self, x, tokens):
        spec, tp = self.spec, self.topo.tp
        if self.pp_rank == 0:
            w = self.p("embedding.word_embeddings.weight")
            rows = w.shape[0]
            lo = self.tp_rank * rows
            mask = (tokens < lo) | (tokens >= lo + rows)
            local = F.embedding((tokens - lo).clamp(0, rows - 1), w)
            x = ReduceFromTP.apply(local.masked_fill(mask[..., None], 0.0))
        heads, groups, d = spec.num_attention_heads // tp, spec.groups // tp, spec.head_dim
        per = spec.num_attention_heads // spec.groups
        for i in range(len(self.layers)):
            p = f"decoder.layers.{i}."
            h = CopyToTP.apply(rms_norm(x, self.p(p + "self_attention.linear_qkv.layer_norm_weight")))
            qkv = F.linear(h, self.p(p + "self_attention.linear_qkv.weight"))
            b, s, _ = qkv.shape
            qkv = qkv.view(b, s, groups, per + 2, d)
            q = qkv[:, :, :, :per].reshape(b, s, heads, d)
            k = qkv[:, :, :, per].repeat_interleave(per, dim=2)
            v = qkv[:, :, :, per + 1].repeat_interleave(per, dim=2)
            q, k = rope(q), rope(k)
            att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                 v.transpose(1, 2), is_causal=True)
            att = att.transpose(1, 2).reshape(b, s, heads * d)
            x = x + ReduceFromTP.apply(F.linear(att, self.p(p + "self_attention.linear_proj.weight")))
            h = CopyToTP.apply(rms_norm(x, self.p(p + "mlp.linear_fc1.layer_norm_weight")))
            gate, up = F.linear(h, self.p(p + "mlp.linear_fc1.weight")).chunk(2, dim=-1)
            x = x + ReduceFromTP.apply(F.linear(F.silu(gate) * up, self.p(p + "mlp.linear_fc2.weight")))
        if self.pp_rank == self.topo.pp - 1:
            h = CopyToTP.apply(rms_norm(x, self.p("decoder.final_layernorm.weight")))
            return GatherFromTP.apply(F.linear(h, self.p("output_layer.weight")))
        return x


def initial_weights(spec: ModelSpec, seed: int = 1234) -> dict[str, torch.Tensor]:
    """The global initial tensors, independent of the topology."""
    out = {}
    gen = torch.Generator().manual_seed(seed)
    for param in global_params(spec):
        if "norm" in param.key:
            out[param.key] = torch.ones(param.shape)
        else:
            out[param.key] = torch.randn(param.shape, generator=gen) * 0.02
    return out


def global_batch(step: int) -> torch.Tensor:
    """The step's ``[GLOBAL_BATCH, SEQ + 1]`` tokens: runs of a fixed stride (learnable)."""
    gen = torch.Generator().manual_seed(10_000 + step)
    start = torch.randint(0, SPEC.vocab_size, (GLOBAL_BATCH, 1), generator=gen)
    stride = torch.randint(1, 4, (GLOBAL_BATCH, 1), generator=gen)
    return (start + stride * torch.arange(SEQ + 1)) % SPEC.vocab_size


# ------------------------------------------------------------------------------------ train


def train_step(model: Stage, opt, step: int, micro: int) -> float | None:
    """One step of all-forward, all-backward over micro-batches; the loss on the last stage."""
    tokens = global_batch(step)
    per_dp = GLOBAL_BATCH // G.dp
    local = tokens[G.dp_rank * per_dp:(G.dp_rank + 1) * per_dp]
    micro_batches = local.chunk(micro)
    prev = G.rank_of(G.tp_rank, G.dp_rank, G.pp_rank - 1) if not G.first else None
    nxt = G.rank_of(G.tp_rank, G.dp_rank, G.pp_rank + 1) if not G.last else None
    shape = (per_dp // micro, SEQ, SPEC.hidden_size)
    saved, total = [], 0.0
    for mb in micro_batches:
        inp = None
        if not G.first:
            inp = torch.empty(shape)
            dist.recv(inp, prev)
            inp.requires_grad_()
        out = model(inp, mb[:, :-1])
        if G.last:
            logits = out[..., :SPEC.global_vocab_rows]
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), mb[:, 1:].reshape(-1))
            out = loss / micro
            total += loss.item() / micro
        else:
            dist.send(out.detach().contiguous(), nxt)
        saved.append((inp, out))
    for inp, out in reversed(saved):
        if G.last:
            out.backward()
        else:
            grad = torch.empty(shape)
            dist.recv(grad, nxt)
            out.backward(grad)
        if inp is not None:
            dist.send(inp.grad.contiguous(), prev)
    for param in model.parameters():
        if G.dp > 1:
            dist.all_reduce(param.grad, group=G.dp_group)
            param.grad /= G.dp
    opt.step()
    opt.zero_grad(set_to_none=False)
    if G.last:
        loss = torch.tensor(total)
        if G.dp > 1:
            dist.all_reduce(loss, group=G.dp_group)
            loss /= G.dp
        return loss.item()
    return None


def eval_logits(model: Stage) -> torch.Tensor | None:
    """Full-vocabulary logits of the step-0 batch (forward only, every DP rank the same);
    returned on the last stage."""
    tokens = global_batch(0)[:, :-1]
    x = None
    with torch.no_grad():
        if not G.first:
            x = torch.empty(tokens.shape[0], SEQ, SPEC.hidden_size)
            dist.recv(x, G.rank_of(G.tp_rank, G.dp_rank, G.pp_rank - 1))
        out = model(x, tokens)
        if not G.last:
            dist.send(out.contiguous(), G.rank_of(G.tp_rank, G.dp_rank, G.pp_rank + 1))
            return None
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--save", required=True, help="run root for checkpoints (path or fsspec URL), as Megatron's --save")
    ap.add_argument("--load", help="resume from this run root instead of --save's (e.g. one "
                    "resharded offline); saves still go to --save")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--dp", type=int, default=None, help="default: world / (tp * pp)")
    ap.add_argument("--steps", type=int, default=8, help="train until this step")
    ap.add_argument("--save-every", type=int, default=4)
    ap.add_argument("--keep-last", type=int, default=3)
    ap.add_argument("--micro-batches", type=int, default=None,
                    help="per DP rank (default: its batch, one sequence each)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--loss-log", help="append one JSON line per step (last stage, DP rank 0)")
    ap.add_argument("--eval-logits", metavar="PATH",
                    help="load the newest checkpoint, save the logits of a fixed batch to PATH, exit")
    ap.add_argument("--crash-after-save", type=int, default=None,
                    help="simulate a node failure: exit hard right after issuing this step's save")
    args = ap.parse_args(argv)

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    dp = args.dp or world // (args.tp * args.pp)
    if args.tp * args.pp * dp != world:
        print(f"error: TP{args.tp} x PP{args.pp} x DP{dp} != world size {world}", file=sys.stderr)
        return 2
    if GLOBAL_BATCH % dp:
        print(f"error: the global batch ({GLOBAL_BATCH}) must be divisible by DP ({dp})",
              file=sys.stderr)
        return 2
    global G
    G = Groups(args.tp, args.pp, dp)
    tensor_parallel.use(G.tp_group, G.tp_rank, G.tp)
    topo = Topology(tp=args.tp, pp=args.pp, dp=dp)
    model = Stage(SPEC, topo, G.tp_rank, G.pp_rank)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, foreach=False)
    state = sharded_state(model, SPEC, topo, tp_rank=G.tp_rank, pp_rank=G.pp_rank,
                          dp_rank=G.dp_rank, optimizer=opt)
    state["step"] = 0
    from dataclasses import asdict

    ckpt = AsyncCheckpointer(args.save, keep_last=args.keep_last, topology=topo.to_dict(),
                             model_config=asdict(SPEC), true_vocab_size=SPEC.vocab_size)
    resumed = ckpt.load_latest(state, root=args.load)
    start = (state["step"] if resumed is not None else 0) + 1
    logger = None
    if args.loss_log and G.last and G.tp_rank == 0 and G.dp_rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(args.loss_log)), exist_ok=True)
        logger = open(args.loss_log, "a")
    if dist.get_rank() == 0:
        print(f"TP{args.tp} PP{args.pp} DP{dp}: "
              + (f"resumed from step {start - 1}" if resumed is not None else "starting fresh"),
              flush=True)
    if args.eval_logits:
        logits = eval_logits(model)
        if logits is not None and G.tp_rank == 0 and G.dp_rank == 0:
            torch.save({"step": start - 1, "tokens": global_batch(0)[:, :-1], "logits": logits},
                       args.eval_logits)
        dist.barrier()
        dist.destroy_process_group()
        return 0
    micro = args.micro_batches or GLOBAL_BATCH // dp
    for step in range(start, args.steps + 1):
        t0 = time.perf_counter()
        loss = train_step(model, opt, step, micro)
        if logger:
            logger.write(json.dumps({"step": step, "loss": loss, "tp": args.tp, "pp": args.pp,
                                     "dp": dp}) + "\n")
            logger.flush()
            print(f"step {step:4d}  loss {loss:.6f}  ({time.perf_counter() - t0:.2f} s)", flush=True)
        if step % args.save_every == 0 or step == args.steps:
            state["step"] = step
            ckpt.save(step, state)
            if step == args.crash_after_save:
                os._exit(1)  # a node failure: the save may be half written
    ckpt.wait()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
