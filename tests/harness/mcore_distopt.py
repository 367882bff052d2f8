"""Real Megatron-Core distributed-optimizer checkpoints on CPU (gloo, 2 processes).

``generate`` builds, for each case, a GPTModel (local spec) at the case's TP/PP (DP fills
the 2 processes), wraps it in ``DistributedDataParallel(use_distributed_optimizer=True)``
with Megatron's own optimizer, takes one Adam step from seeded gradients and saves what
Megatron-LM's legacy checkpointing saves: ``model_optim_rng.pt`` from DP rank 0 of each
(TP, PP) rank and ``distrib_optim.pt`` from ``save_parameter_state``.

Ground truth comes from the optimizer itself, not from the file: each process's shard of
every parameter's fp32 master, ``exp_avg`` and ``exp_avg_sq`` (with its range in the
parameter), plus mcore's own buffer map (``param_index_map``, bucket bounds).

``load`` does what Megatron-LM's loader does with a legacy checkpoint (model
``load_state_dict``, optimizer ``load_state_dict`` + ``load_parameter_state``) at the
checkpoint's topology and dumps the same shards.

:func:`canonical_state` joins such dumps into ckptool's canonical view
(``optimizer.state.<kind>.<key>`` -> global tensor), by hand rather than by ckptool's rules.

Shims (test only): CUDA device/synchronize/``Tensor.cuda`` on CPU, the CUDA RNG tracker's
``fork``; ``Tensor.type()`` reports ``torch.cuda.*`` (the distributed optimizer sorts
parameters by it) and factories asked for ``device="cuda"`` make CPU tensors; for loading,
:func:`_keep_step_on_load` and ``torch.no_grad``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

from tests.harness.mcore import _spawn, padded

WORLD = 2
BASE = dict(layers=2, hidden=48, heads=4, ffn=100, vocab=250, divisible_by=2, max_pos=16,
            tied=True, bf16=False, overlap=False, bucket=None)
CASES = {
    # sizes that are not multiples of 64: Megatron leaves 64-alignment gaps in its buffer
    "odd": dict(BASE, tp=1, pp=1),
    # several buckets, bf16 parameters with fp32 grads: the (bf16, fp32) buffer
    "bucketed": dict(BASE, tp=1, pp=1, bf16=True, overlap=True, bucket=10000),
    "tp2": dict(BASE, tp=2, pp=1, tied=False, overlap=True, bucket=6000),
    # tied embeddings at PP2: the word embedding gets a bucket of its own on both stages
    "pp2": dict(BASE, tp=1, pp=2, overlap=True, bucket=8000),
}
ITERATION = 1


def padded_vocab(c: dict, tp: int) -> int:
    return padded(c["vocab"], c["divisible_by"], tp)


def megatron_args(c: dict) -> argparse.Namespace:
    """The Megatron-LM args of the job (the fields ckptool and the DDP setup read)."""
    tp, pp = c["tp"], c["pp"]
    return argparse.Namespace(
        num_layers=c["layers"], hidden_size=c["hidden"], num_attention_heads=c["heads"],
        ffn_hidden_size=c["ffn"], kv_channels=c["hidden"] // c["heads"],
        group_query_attention=False, num_query_groups=None, vocab_size=c["vocab"],
        padded_vocab_size=padded_vocab(c, tp), make_vocab_size_divisible_by=c["divisible_by"],
        max_position_embeddings=c["max_pos"], position_embedding_type="learned_absolute",
        untie_embeddings_and_output_weights=not c["tied"], add_bias_linear=True,
        normalization="LayerNorm", swiglu=False, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, context_parallel_size=1,
        data_parallel_size=WORLD // (tp * pp), world_size=WORLD,
        params_dtype=torch.bfloat16 if c["bf16"] else torch.float32, bf16=c["bf16"],
        use_distributed_optimizer=True, overlap_grad_reduce=c["overlap"],
        ddp_bucket_size=c["bucket"], overlap_param_gather_with_optimizer_step=False,
        accumulate_allreduce_grads_in_fp32=True)


def case_from_args(args: argparse.Namespace) -> dict:
    """The case a checkpoint's args describe (what a resuming job would be launched with)."""
    return dict(BASE, layers=args.num_layers, tp=args.tensor_model_parallel_size,
                pp=args.pipeline_model_parallel_size, tied=not args.untie_embeddings_and_output_weights,
                bf16=args.params_dtype == torch.bfloat16, overlap=args.overlap_grad_reduce,
                bucket=args.ddp_bucket_size)


def rank_dir(tp_rank: int, pp_rank: int, pp: int) -> str:
    return f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def _shims():
    """Megatron-Core on CPU: the example trainer's shims (CUDA device calls, ``Tensor.cuda``,
    ``Tensor.type()`` reporting ``torch.cuda.*``, factories asked for ``device="cuda"``)."""
    from examples.train_megatron_core import cpu_shims

    cpu_shims()


def _setup(c: dict):
    """Parallel state, model, DDP and optimizer of one case on this process."""
    from megatron.core import parallel_state as ps, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig

    ps.initialize_model_parallel(c["tp"], c["pp"])
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    dtype = torch.bfloat16 if c["bf16"] else torch.float32
    pp_rank = ps.get_pipeline_model_parallel_rank()
    torch.manual_seed(1234)
    cfg = TransformerConfig(
        num_layers=c["layers"], hidden_size=c["hidden"], num_attention_heads=c["heads"],
        ffn_hidden_size=c["ffn"], use_cpu_initialization=True, params_dtype=dtype,
        pipeline_dtype=dtype, bf16=c["bf16"], hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=c["tp"], pipeline_model_parallel_size=c["pp"])
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(),
                     vocab_size=padded_vocab(c, c["tp"]), max_sequence_length=c["max_pos"],
                     pre_process=pp_rank == 0, post_process=pp_rank == c["pp"] - 1,
                     share_embeddings_and_output_weights=c["tied"])
    if c["bf16"]:  # as Megatron-LM's get_model: every parameter in bf16
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(cfg, model)
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=c["overlap"], bucket_size=c["bucket"],
        grad_reduce_in_fp32=True), model)
    opt = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=1e-2, weight_decay=0.1, use_distributed_optimizer=True,
        bf16=c["bf16"], params_dtype=dtype), [ddp])
    return ps, ddp, opt


def _named(ddp):
    """The model's named_parameters(), named as in its state dict (no Float16Module prefix)."""
    return [(n.removeprefix("module."), p) for n, p in ddp.module.named_parameters()]


def _seeded_grads(ps, ddp, tied: bool):
    """Deterministic gradients: a TP-split parameter's differ by TP rank; a replicated one's
    (and the two tied embedding copies') are equal, as after Megatron's all-reduces."""
    tp_rank = ps.get_tensor_model_parallel_rank()
    for name, p in _named(ddp):
        if tied and name == "output_layer.weight":
            name = "embedding.word_embeddings.weight"
        split = getattr(p, "tensor_model_parallel", False)
        seed = zlib.crc32(f"{name}/{tp_rank if split else 0}".encode())
        p.main_grad.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)))


def _truth(ps, ddp, opt) -> dict:
    """This process's optimizer shards, per local parameter, and mcore's buffer maps."""
    inner = opt.chained_optimizers[0] if hasattr(opt, "chained_optimizers") else opt
    names = {p: n for n, p in _named(ddp)}
    shards = {}
    for name, p in _named(ddp):
        if p not in inner.model_param_group_index_map:
            continue  # no element of it on this DP rank
        r = inner._get_model_param_range_map(p)["param"]
        state = inner._get_main_param_and_optimizer_states(p)
        shards[name] = (r.start, r.end, tuple(p.shape),
                        {k: state[k].detach().clone() for k in ("param", "exp_avg", "exp_avg_sq")})
    buffers = [{"key": (b.param_dtype, b.grad_dtype), "buckets": list(b.bucket_indices),
                "unpadded": [k.numel_unpadded for k in b.buckets],
                "params": {names[p]: tuple(v) for p, v in b.param_index_map.items()}}
               for b in ddp.buffers]
    return {"tp": ps.get_tensor_model_parallel_rank(), "pp": ps.get_pipeline_model_parallel_rank(),
            "dp": ps.get_data_parallel_rank(), "shards": shards, "buffers": buffers,
            "names": [(n, tuple(p.shape)) for n, p in _named(ddp)]}


def _init(rank: int, port: int):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    _shims()


def _keep_step_on_load():
    """Without TE/Apex, mcore falls back to torch Adam, whose state also holds ``step``;
    mcore's loader of distrib_optim.pt then asks the file for a ``step`` it never holds.
    The step is already in place (``load_state_dict`` set it from the param groups), so the
    shim hands mcore that same tensor; every other element still comes from the file."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    plain = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_states(self, model_param, tensors):
        group, order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group]["params"][order]]
        if "step" in state and "step" not in tensors:
            tensors = {**tensors, "step": state["step"]}
        return plain(self, model_param, tensors)

    DistributedOptimizer._set_main_param_and_optimizer_states = set_states


def _generate_worker(rank, cases, root, port):
    _init(rank, port)
    for name, c in cases.items():
        ps, ddp, opt = _setup(c)
        _seeded_grads(ps, ddp, c["tied"])
        ok, _, _ = opt.step()
        assert ok
        d = Path(root) / name / f"iter_{ITERATION:07d}" / rank_dir(
            ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(), c["pp"])
        d.mkdir(parents=True, exist_ok=True)
        opt.save_parameter_state(str(d / "distrib_optim.pt"))  # collective; DP rank 0 writes
        if ps.get_data_parallel_rank() == 0:
            torch.save({"args": megatron_args(c), "checkpoint_version": 3.0, "iteration": ITERATION,
                        "model": ddp.module.state_dict_for_save_checkpoint(),
                        "optimizer": opt.state_dict(),
                        "opt_param_scheduler": {"num_steps": ITERATION},
                        "rng_state": [{"torch_rng_state": torch.get_rng_state()}]},
                       d / "model_optim_rng.pt")
            (Path(root) / name / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
        truth = Path(root) / f"{name}.truth"
        truth.mkdir(exist_ok=True)
        torch.save(_truth(ps, ddp, opt), truth / f"rank{rank}.pt")
        dist.barrier()
        ps.destroy_model_parallel()
    dist.destroy_process_group()


def _load_worker(rank, checkpoints, port):
    _init(rank, port)
    _keep_step_on_load()
    for ckpt in checkpoints:
        first = next(Path(ckpt).glob("iter_*/mp_rank_*/model_optim_rng.pt"))
        c = case_from_args(torch.load(first, weights_only=False)["args"])
        ps, ddp, opt = _setup(c)
        d = first.parent.parent / rank_dir(ps.get_tensor_model_parallel_rank(),
                                           ps.get_pipeline_model_parallel_rank(), c["pp"])
        state = torch.load(d / "model_optim_rng.pt", weights_only=False)
        assert state["args"].tensor_model_parallel_size == c["tp"]
        ddp.module.load_state_dict(state["model"], strict=True)
        opt.load_state_dict(state["optimizer"])
        with torch.no_grad():  # fp32 masters are views of the parameters (leaves)
            opt.load_parameter_state(str(d / "distrib_optim.pt"))
        torch.save(_truth(ps, ddp, opt), Path(f"{ckpt}.loaded-rank{rank}.pt"))
        dist.barrier()
        ps.destroy_model_parallel()
    dist.destroy_process_group()


def generate(root: Path, cases: dict = CASES) -> None:
    """Write each case's checkpoint at ``root/<case>`` and its truth at ``root/<case>.truth``."""
    _spawn(_generate_worker, WORLD, cases, str(root))


def load(checkpoints: list[Path]) -> list[list[dict]]:
    """Load each checkpoint into real mcore at its own topology; each process's truth dump."""
    _spawn(_load_worker, WORLD, [str(c) for c in checkpoints])
    return [[torch.load(f"{c}.loaded-rank{r}.pt", weights_only=False) for r in range(WORLD)]
            for c in checkpoints]


def truth(root: Path, name: str) -> list[dict]:
    return [torch.load(root / f"{name}.truth" / f"rank{r}.pt", weights_only=False)
            for r in range(WORLD)]


# ------------------------------- the truth in the canonical view (TP shards joined by hand)

KINDS = {"param": "fp32_param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
WORD = "embedding.word_embeddings.weight"
# mcore local-spec names -> canonical names, and the TP split of each (by hand, not ckptool's)
_NORMS = {"input_layernorm": "self_attention.linear_qkv.layer_norm",
          "pre_mlp_layernorm": "mlp.linear_fc1.layer_norm"}
_DIM0 = ("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "linear_fc1.bias",
         "word_embeddings.weight", "output_layer.weight")
_DIM1 = ("linear_proj.weight", "linear_fc2.weight")


def local_state(dumps: list[dict]) -> dict:
    """(tp, pp) -> local name -> kind -> the whole local tensor, from the DP ranks' shards."""
    out: dict = {}
    for dump in dumps:
        rank = out.setdefault((dump["tp"], dump["pp"]), {})
        for name, (start, end, shape, tensors) in dump["shards"].items():
            entry = rank.setdefault(name, {"shape": shape, "seen": 0})
            for kind, t in tensors.items():
                flat = entry.setdefault(kind, torch.zeros(torch.Size(shape).numel()))
                flat[start:end] = t
            entry["seen"] += end - start
    for rank in out.values():
        for name, entry in rank.items():
            assert entry["seen"] == torch.Size(entry["shape"]).numel(), name
    return out


def _canonical(name: str, pp_rank: int, per_stage: int) -> str:
    m = re.match(r"decoder\.layers\.(\d+)\.(\w+)\.(weight|bias)$", name)
    if m and m.group(2) in _NORMS:
        name = f"decoder.layers.{m.group(1)}.{_NORMS[m.group(2)]}_{m.group(3)}"
    return re.sub(r"layers\.(\d+)\.", lambda g: f"layers.{int(g.group(1)) + pp_rank * per_stage}.",
                  name)


def canonical_state(dumps: list[dict], case: dict) -> dict:
    """Canonical ``optimizer.state.<kind>.<key>`` -> global tensor, TP shards joined by hand."""
    local = local_state(dumps)
    tp, pp = case["tp"], case["pp"]
    per_stage = case["layers"] // pp
    out = {}
    for (t, p), params in sorted(local.items()):
        for name, entry in params.items():
            if case["tied"] and name == "output_layer.weight":
                continue  # the last stage's copy of the tied embedding
            key = _canonical(name, p, per_stage)
            for kind, canon in KINDS.items():
                out.setdefault(f"optimizer.state.{canon}.{key}", []).append(
                    entry[kind].view(entry["shape"]))
    for key, parts in out.items():
        if len(parts) == 1:
            out[key] = parts[0]
        elif key.endswith(_DIM0) or key.endswith(_DIM1):
            out[key] = torch.cat(parts, dim=0 if key.endswith(_DIM0) else 1)
        else:  # TP-replicated: every rank holds the same
            assert all(torch.equal(parts[0], x) for x in parts), key
            out[key] = parts[0]
        assert len(parts) in (1, tp), key
    return out
