"""Real DeepSpeed ``PipelineEngine``s at TP > 1: :mod:`tests.harness.deepspeed_pipe`'s
GPTModelPipe-shaped model made tensor-parallel over the ``model`` axis of DeepSpeed's
``PipeModelDataParallelTopology``, with plain ``torch.distributed`` collectives (gloo), as
Megatron's legacy ``ParallelTransformerLayerPipe`` splits it:

* ``word_embeddings.weight``: vocab-parallel (rows split over TP); the lookup masks the ids
  outside this rank's rows and all-reduces. The tied head computes this rank's vocabulary
  shard of the logits, all-gathered so the loss is the TP1 one on every TP rank.
* column-parallel (dim 0 split, input copied: its gradient is all-reduced):
  ``query_key_value`` (weight and bias; rows grouped per head ``[q_h; k_h; v_h]``, the
  checkpoint_version 3.0 layout, so each rank holds whole heads), ``dense_h_to_4h``.
* row-parallel (dim 1 split, output all-reduced, then the whole bias added once):
  ``self_attention.dense``, ``dense_4h_to_h``.
* replicated: layer norms, position embeddings, the row-parallel biases.

Parameter names and per-rank shapes are those of the TP1 model's (``named_parameters()``,
layer files) with the TP shard shapes: what ``ckptool reshard --to-tp N`` writes.
:func:`split_dim` is the rule by name; each split parameter carries Megatron's
``tensor_model_parallel`` attribute (DeepSpeed's gradient norm counts the others once).
"""

from __future__ import annotations

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tests.harness import deepspeed_engine as H  # noqa: E402
from tests.harness import deepspeed_pipe as P  # noqa: E402

_TP: dict = {"group": None, "rank": 0, "size": 1}
"""This process's tensor-parallel group, rank and size, set by :func:`engine` before the
layers are built."""

_DIM0 = ("word_embeddings.weight", "query_key_value.weight", "query_key_value.bias",
         "dense_h_to_4h.weight", "dense_h_to_4h.bias")
_DIM1 = ("self_attention.dense.weight", "dense_4h_to_h.weight")


def split_dim(name: str) -> int | None:
    """The dimension a parameter is split on over TP (None: every TP rank holds it whole)."""
    if name.endswith(_DIM0):
        return 0
    if name.endswith(_DIM1):
        return 1
    return None


class _Copy(torch.autograd.Function):
    """Identity forward; the gradient summed over TP (the input of a column-parallel op)."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=_TP["group"])
        return grad


class _Reduce(torch.autograd.Function):
    """Sum over TP forward (the partial outputs of a row-parallel op); identity backward."""

    @staticmethod
    def forward(ctx, x):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=_TP["group"])
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


class _Gather(torch.autograd.Function):
    """All-gather along the last dim (TP rank order); backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x):
        parts = [torch.empty_like(x) for _ in range(_TP["size"])]
        dist.all_gather(parts, x.contiguous(), group=_TP["group"])
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(_TP["size"], dim=-1)[_TP["rank"]].contiguous()


def _mark(*params) -> None:
    for p in params:
        p.tensor_model_parallel = True


class _Column(nn.Linear):
    """Column-parallel Linear: this rank's ``out // TP`` output rows (weight and bias)."""

    def __init__(self, inputs: int, outputs: int):
        super().__init__(inputs, outputs // _TP["size"])
        _mark(self.weight, self.bias)

    def forward(self, x):
        return super().forward(_Copy.apply(x))


class _Row(nn.Linear):
    """Row-parallel Linear: this rank's ``in // TP`` input columns; the bias is whole."""

    def __init__(self, inputs: int, outputs: int):
        super().__init__(inputs // _TP["size"], outputs)
        _mark(self.weight)

    def forward(self, x):
        return _Reduce.apply(F.linear(x, self.weight)) + self.bias


class _Embedding(H._Embedding):
    """Vocab-parallel EmbeddingPipe: rows ``[rank * n, (rank + 1) * n)`` of the padded vocab."""

    def __init__(self):
        super().__init__()
        a = H.PIPE_ARGS
        self.word_embeddings = nn.Embedding(a["padded_vocab_size"] // _TP["size"], a["hidden_size"])
        _mark(self.word_embeddings.weight)

    def forward(self, ids):
        rows = self.word_embeddings.num_embeddings
        local = ids - _TP["rank"] * rows
        outside = (local < 0) | (local >= rows)
        words = self.word_embeddings(local.masked_fill(outside, 0)).masked_fill(outside[..., None], 0.0)
        pos = torch.arange(ids.shape[1], device=ids.device)
        return _Reduce.apply(words) + self.position_embeddings(pos)[None]


class _Attention(H._Attention):
    """This rank's ``heads // TP`` heads, each ``[q_h; k_h; v_h]`` rows of query_key_value."""

    def __init__(self):
        super().__init__()
        h = H.PIPE_ARGS["hidden_size"]
        self.query_key_value = _Column(h, 3 * h)
        self.dense = _Row(h, h)

    def forward(self, x):
        b, s, h = x.shape
        heads = H.PIPE_ARGS["num_attention_heads"]
        d, nh = h // heads, heads // _TP["size"]
        q, k, v = (t.transpose(1, 2) for t in self.query_key_value(x).view(b, s, nh, 3 * d).split(d, dim=-1))
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        probs = (q @ k.transpose(-1, -2) / d ** 0.5).masked_fill(mask, float("-inf")).softmax(-1)
        return self.dense((probs @ v).transpose(1, 2).reshape(b, s, nh * d))


class _MLP(H._MLP):
    def __init__(self):
        super().__init__()
        h, f = H.PIPE_ARGS["hidden_size"], H.PIPE_ARGS["ffn_hidden_size"]
        self.dense_h_to_4h = _Column(h, f)
        self.dense_4h_to_h = _Row(f, h)


class ParallelTransformerLayerPipe(H.ParallelTransformerLayerPipe):
    """The TP1 layer (its forward, names and order) with the tensor-parallel submodules."""

    def __init__(self):
        super().__init__()
        self.self_attention = _Attention()  # replaced in place: the state-dict order stays
        self.mlp = _MLP()


def _logits_helper(embedding, hidden):
    """The tied head: this rank's vocabulary shard of the logits, gathered over TP."""
    return _Gather.apply(_Copy.apply(hidden) @ embedding.word_embeddings_weight.t())


def pipe_specs() -> list:
    """:func:`tests.harness.deepspeed_engine.pipe_specs` (same indices, ties and partition weights) with
    the tensor-parallel modules."""
    swap = {H._Embedding: _Embedding, H.ParallelTransformerLayerPipe: ParallelTransformerLayerPipe}
    specs = H.pipe_specs()
    for spec in specs[1:]:
        spec.typename = swap.get(spec.typename, spec.typename)
        if getattr(spec, "forward_fn", None) is H._logits_helper:
            spec.forward_fn = _logits_helper
    return specs


def _tp_group(topo) -> None:
    rank = dist.get_rank()
    for ranks in topo.get_axis_comm_lists("model"):
        group = dist.new_group(ranks)  # every rank creates every group, in the same order
        if rank in ranks:
            _TP.update(group=group, rank=ranks.index(rank), size=len(ranks))


def engine(tp: int, pp: int, dp: int, stage: int = 1, precision: str = "fp32"):
    """:func:`tests.harness.deepspeed_pipe.engine`'s engine at TP ``tp`` (fp32 ZeRO-1 by
    default; bf16 at stage 0 is DeepSpeed's BF16_Optimizer)."""
    import deepspeed
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    torch.manual_seed(0)
    topo = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
    _tp_group(topo)
    model = PipelineModule(layers=pipe_specs(), loss_fn=H._cross_entropy, topology=topo,
                           partition_method="type:transformer")
    for name, p in model.named_parameters():
        assert getattr(p, "tensor_model_parallel", False) == (split_dim(name) is not None), name
    groups = H.decay_groups(model)
    cfg = H.config(stage, dp, precision)
    cfg.update(train_batch_size=P.GLOBAL, train_micro_batch_size_per_gpu=H.PIPE_MICRO,
               gradient_accumulation_steps=P.GLOBAL // (H.PIPE_MICRO * dp))
    eng, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=cfg)
    return eng


def adam_steps(eng) -> list[float]:
    """The Adam step of each of the engine's torch optimizer states (one per param group)."""
    return [float(st["step"]) for st in eng.optimizer.optimizer.state.values() if "step" in st]


def hyper(eng) -> list[dict]:
    """Each param group's hyperparameters (weight decay, lr, betas...), without its params."""
    return [{k: v for k, v in g.items() if k != "params"} for g in eng.optimizer.optimizer.param_groups]


def whole(shards: list[torch.Tensor], name: str) -> torch.Tensor:
    """The full tensor from its TP shards (rank order); a replicated one must be the same on
    every rank."""
    dim = split_dim(name)
    if dim is not None:
        return torch.cat(shards, dim)
    assert all(torch.equal(s, shards[0]) for s in shards[1:]), name
    return shards[0]


def _load_worker(rank: int, world: int, jobs: list, port: int) -> None:
    H._init(rank, world, port)
    for ckpt, tp, pp, result, *kind in jobs:  # kind: (precision[, ZeRO stage])
        precision, stage = (kind + ["fp32", 1][len(kind):])[:2]
        eng = engine(tp, pp, world // (tp * pp), stage, precision)
        path, _ = eng.load_checkpoint(ckpt)
        assert path is not None, f"DeepSpeed found no checkpoint in {ckpt}"
        record = P._record(eng)
        record.update(tp=_TP["rank"], dp=eng.grid.data_parallel_id, adam_steps=adam_steps(eng),
                      hyper=hyper(eng), scaler=H.scaler_state(eng),
                      module={n: p.detach().clone() for n, p in eng.module.named_parameters()})
        record["loss"] = P.train_batch(eng, H.NEXT_STEP)
        torch.save(record, f"{result}.rank{rank}.pt")


def load(world: int, jobs: list[tuple]) -> None:
    """For each ``(checkpoint, tp, pp, result[, precision[, stage]])``: build the engine at TP
    ``tp``, PP ``pp`` (DP ``world // (tp * pp)``; fp32 ZeRO-1 by default), ``load_checkpoint``, and record in ``{result}.rank{r}.pt``
    this rank's fp32 masters and Adam moments (``state``: its TP shards, by parameter name),
    the module's own weights (``module``: what the forward uses, read from the layer files),
    its stage, TP and DP ranks, and the loss of the next ``train_batch``."""
    P._spawn(_load_worker, world, [(str(c), tp, pp, str(r), *rest) for c, tp, pp, r, *rest in jobs])
