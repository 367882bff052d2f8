"""Real megatron-core GPT models on CPU (gloo), saved in Megatron's legacy layout and loaded
back at any TP/PP, with a real pipelined forward. Runs in spawned processes.

Shims (test only, per DESIGN.md): ``torch.cuda.current_device`` returns "cpu", the CUDA RNG
tracker's ``fork`` is a null context, and the attention mask is an explicit causal mask;
also ``Tensor.cuda`` is the identity, for the tied-embedding all-reduce at PP > 1.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from tests.conftest import free_port, spawn

SEQ, BATCH = 8, 2

LLAMA = dict(num_layers=4, hidden_size=32, num_attention_heads=8, num_query_groups=4,
             ffn_hidden_size=48, vocab_size=1000, swiglu=True, tied=False, bias=False,
             norm="RMSNorm", pos="rope", max_pos=SEQ, divisible_by=128)
GPT = dict(num_layers=4, hidden_size=32, num_attention_heads=8, num_query_groups=None,
           ffn_hidden_size=64, vocab_size=1003, swiglu=False, tied=True, bias=True,
           norm="LayerNorm", pos="learned_absolute", max_pos=SEQ, divisible_by=128)


def padded(vocab: int, divisible_by: int, tp: int) -> int:
    m = divisible_by * tp
    return -(-vocab // m) * m


def megatron_args(m: dict, tp: int, pp: int) -> argparse.Namespace:
    """The args Megatron-LM stores in every rank file (the fields ckptool reads)."""
    return argparse.Namespace(
        num_layers=m["num_layers"], hidden_size=m["hidden_size"],
        num_attention_heads=m["num_attention_heads"],
        group_query_attention=m["num_query_groups"] is not None,
        num_query_groups=m["num_query_groups"], ffn_hidden_size=m["ffn_hidden_size"],
        kv_channels=m.get("kv_channels") or m["hidden_size"] // m["num_attention_heads"],
        padded_vocab_size=padded(m["vocab_size"], m["divisible_by"], tp),
        make_vocab_size_divisible_by=m["divisible_by"], swiglu=m["swiglu"],
        untie_embeddings_and_output_weights=not m["tied"], add_bias_linear=m["bias"],
        normalization=m["norm"], position_embedding_type=m["pos"],
        max_position_embeddings=m["max_pos"], tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, world_size=tp * pp, data_parallel_size=1,
        params_dtype=torch.float32, seq_length=SEQ, **_feature_args(m))


FEATURES = dict(qkv_bias=False, qk_layernorm=False, window=None, rope_scaling=False, kv_channels=None,
                gelu_fusion=False, openai_gelu=False)
"""Optional model features of a harness model dict (absent: off)."""


def _feature_args(m: dict) -> dict:
    """Megatron-LM's args for the features ``m`` turns on (none when all are off, as an
    older Megatron-LM stores them)."""
    f = {**FEATURES, **{k: m[k] for k in FEATURES if k in m}}
    out = {}
    if f["qkv_bias"]:
        out["add_qkv_bias"] = True
    if f["qk_layernorm"]:
        out["qk_layernorm"] = True
    if f["window"]:
        out["window_size"] = (f["window"] - 1, 0)
    if f["rope_scaling"]:
        out.update(use_rope_scaling=True, rope_scaling_factor=8.0)
    if f["gelu_fusion"]:  # Megatron-LM's default; the harness models run without it unless asked
        out["bias_gelu_fusion"] = True
    if f["openai_gelu"]:  # stored by Megatron-LM; Megatron-Core's model never reads it
        out["openai_gelu"] = True
    return out


def tokens(vocab: int = 997) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, min(997, vocab), (BATCH, SEQ), generator=g)


def _init(rank, world, tp, pp, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.cuda.current_device = lambda: "cpu"
    # Tied embeddings with PP > 1: mcore moves the last stage's copy to CUDA before its
    # all-reduce with the first stage. On CPU that copy stays where it is.
    torch.Tensor.cuda = lambda self, *a, **k: self
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             pipeline_model_parallel_size=pp)
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    _sliding_window_mask_on_cpu()
    return parallel_state


def _sliding_window_mask_on_cpu():
    """Megatron-Core's sliding-window mask is allocated on "cuda"; fused_softmax imports the
    function by name, so it is replaced there: the same mask, on the CPU."""
    import megatron.core.fusions.fused_softmax as fused_softmax

    def mask(sq, skv, window_size):
        m = torch.ones(sq, skv, dtype=torch.bool)
        return ~torch.tril(torch.triu(m, diagonal=skv - sq - window_size[0]),
                           diagonal=skv - sq + window_size[1])

    fused_softmax.get_sliding_window_causal_mask = mask


def _model(m: dict, tp: int, pp: int, pre: bool, post: bool, config: dict | None = None,
           layer_spec: dict | None = None):
    """The harness dict ``m``'s GPTModel at TP/PP; ``config`` and ``layer_spec`` add
    TransformerConfig fields and get_gpt_layer_local_spec arguments (a MoE's)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    act = torch.nn.functional.silu if m["swiglu"] else torch.nn.functional.gelu
    f = {**FEATURES, **{k: m[k] for k in FEATURES if k in m}}
    cfg = TransformerConfig(
        num_layers=m["num_layers"], hidden_size=m["hidden_size"],
        num_attention_heads=m["num_attention_heads"], num_query_groups=m["num_query_groups"],
        ffn_hidden_size=m["ffn_hidden_size"], use_cpu_initialization=True,
        gated_linear_unit=m["swiglu"], activation_func=act, add_bias_linear=m["bias"],
        normalization=m["norm"], params_dtype=torch.float32, pipeline_dtype=torch.float32,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, hidden_dropout=0.0, attention_dropout=0.0,
        add_qkv_bias=f["qkv_bias"], qk_layernorm=f["qk_layernorm"], kv_channels=f["kv_channels"],
        window_size=(f["window"] - 1, 0) if f["window"] else None,
        bias_activation_fusion=f["gelu_fusion"], **(config or {}))
    spec = get_gpt_layer_local_spec(normalization=m["norm"], qk_layernorm=f["qk_layernorm"], **(layer_spec or {}))
    return GPTModel(config=cfg, transformer_layer_spec=spec,
                    vocab_size=padded(m["vocab_size"], m["divisible_by"], tp), max_sequence_length=SEQ,
                    pre_process=pre, post_process=post,
                    share_embeddings_and_output_weights=m["tied"], position_embedding_type=m["pos"],
                    rope_scaling=f["rope_scaling"])


def _forward(ps, model, m: dict, tp: int, pp: int) -> torch.Tensor | None:
    """Pipelined forward; returns the full-vocab logits on the last stage's TP rank 0."""
    pp_rank, tp_rank = ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()
    tok = tokens(m["vocab_size"])
    pos = torch.arange(SEQ).expand(BATCH, SEQ)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), 1)
    model.eval()
    with torch.no_grad():
        if pp_rank > 0:
            # a stage's input is in the model's dtype (bf16 under Float16Module)
            hidden = torch.empty(SEQ, BATCH, m["hidden_size"], dtype=next(model.parameters()).dtype)
            dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        out = model(tok, pos, mask)
        if pp_rank < pp - 1:
            dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
            return None
        parts = [torch.empty_like(out) for _ in range(tp)]
        dist.all_gather(parts, out.contiguous(), group=ps.get_tensor_model_parallel_group())
        return torch.cat(parts, dim=-1)[..., :m["vocab_size"]] if tp_rank == 0 else None


def _seeded_model(m, tp):
    torch.manual_seed(1234)
    model = _model(m, tp, 1, True, True)
    with torch.no_grad():  # non-trivial norms, so a norm mix-up cannot hide
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    return model


def _save_worker(rank, m, tp, root, port):
    ps = _init(rank, tp, tp, 1, port)
    model = _seeded_model(m, tp)
    it = Path(root) / "iter_0000010" / f"mp_rank_{rank:02d}"
    it.mkdir(parents=True, exist_ok=True)
    state = {"args": megatron_args(m, tp, 1), "iteration": 10, "checkpoint_version": 3.0,
             "model": model.state_dict(),
             "rng_state": [{"random_rng_state": None, "torch_rng_state": torch.get_rng_state()}],
             "opt_param_scheduler": {"num_steps": 10, "max_lr": 3e-4}}
    torch.save(state, it / "model_optim_rng.pt")
    (Path(root) / "latest_checkpointed_iteration.txt").write_text("10")
    logits = _forward(ps, model, m, tp, 1)
    if logits is not None:
        torch.save(logits, Path(root).parent / f"{Path(root).name}.logits.pt")
    dist.barrier()
    dist.destroy_process_group()


def _load_worker(rank, m, tp, pp, root, out, no_rng, port):
    ps = _init(rank, tp * pp, tp, pp, port)
    pp_rank, tp_rank = ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()
    model = _model(m, tp, pp, pp_rank == 0, pp_rank == pp - 1)
    rank_dir = f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    tracker = (Path(root) / "latest_checkpointed_iteration.txt").read_text().strip()
    state = torch.load(Path(root) / f"iter_{int(tracker):07d}" / rank_dir / "model_optim_rng.pt",
                       weights_only=False)
    # What Megatron-LM's loader asserts and does.
    assert state["args"].tensor_model_parallel_size == tp
    assert state["args"].pipeline_model_parallel_size == pp
    assert "iteration" in state
    assert "rng_state" in state or no_rng  # else Megatron needs --no-load-rng
    model.load_state_dict(state["model"], strict=True)
    logits = _forward(ps, model, m, tp, pp)
    if logits is not None:
        torch.save(logits, out)
    dist.barrier()
    dist.destroy_process_group()


def _hook_save_worker(rank, m, tp, root, port):
    """The training hook on a real mcore model: ``training.megatron.sharded_state`` describes
    its local TP parameters; ``AsyncCheckpointer`` writes them."""
    # Imported here on purpose: the fork server preloads this module (conftest.PRELOAD), and
    # these import fsspec, which reads its FSSPEC_* configuration once, at import.
    from converters.schemas.megatron_args import spec_from_args
    from training import AsyncCheckpointer
    from training.megatron import sharded_state

    ps = _init(rank, tp, tp, 1, port)
    model = _seeded_model(m, tp)
    spec, topo, _ = spec_from_args(megatron_args(m, tp, 1))
    state = sharded_state(model, spec, topo, tp_rank=ps.get_tensor_model_parallel_rank(), pp_rank=0)
    ckpt = AsyncCheckpointer(root, topology=topo.to_dict(), model_config=asdict(spec),
                             true_vocab_size=m["vocab_size"])
    ckpt.save(10, state)
    ckpt.wait()
    logits = _forward(ps, model, m, tp, 1)
    if logits is not None:
        torch.save(logits, Path(root).parent / f"{Path(root).name}.logits.pt")
    dist.barrier()
    dist.destroy_process_group()


def hook_save_real(m: dict, tp: int, root: Path) -> torch.Tensor:
    """Save a real mcore model at TP=tp through the training hook; return its logits."""
    _spawn(_hook_save_worker, tp, m, tp, str(root))
    return torch.load(root.parent / f"{root.name}.logits.pt")


def load_common(root: Path) -> dict:
    """The ``common.pt`` of a ``torch_dist`` run root's (one) iteration: ``iter_*/common.pt``."""
    return torch.load(next(Path(root).glob("iter_*/common.pt")), weights_only=False)


def _spawn(fn, nprocs, *args):
    spawn(fn, nprocs, (*args, free_port()), "mcore harness")


def save_real(m: dict, tp: int, root: Path) -> torch.Tensor:
    """Build a real mcore model at TP=tp, save it in the legacy layout, return its logits."""
    _spawn(_save_worker, tp, m, tp, str(root))
    return torch.load(root.parent / f"{root.name}.logits.pt")


def load_logits(m: dict, tp: int, pp: int, root: Path, no_rng: bool = False) -> torch.Tensor:
    """Load a legacy checkpoint into real mcore stage models at TP/PP; return logits."""
    out = root.parent / f"{root.name}.loaded-logits.pt"
    _spawn(_load_worker, tp * pp, m, tp, pp, str(root), str(out), no_rng)
    return torch.load(out)


# ---------------------------------------------------------------- training with an optimizer

LR, WD = 1e-2, 0.1


def _batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    tok = torch.randint(0, 997, (BATCH, SEQ + 1), generator=g)
    return tok[:, :-1], tok[:, 1:]


def _optimizer(model):
    """torch AdamW over Megatron's own param groups (what FP32Optimizer wraps)."""
    from megatron.core.optimizer import OptimizerConfig, _get_param_groups

    groups = _get_param_groups([model], OptimizerConfig(optimizer="adam", lr=LR, weight_decay=WD), None)
    for g in groups:
        g["weight_decay"] = WD * g["wd_mult"]
    return torch.optim.AdamW(groups, lr=LR)


def _step(model, opt, step: int, vocab: int | None = None):
    """One training step on ``_batch(step)`` (token ids taken modulo ``vocab`` when given:
    the batch draws them up to 997)."""
    tok, labels = _batch(step)
    if vocab:
        tok, labels = tok % vocab, labels % vocab
    pos = torch.arange(SEQ).expand(BATCH, SEQ)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), 1)
    model.train()
    loss = model(tok, pos, mask, labels=labels).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def _train_save_worker(rank, m, tp, root, port):
    ps = _init(rank, tp, tp, 1, port)
    torch.manual_seed(1234)
    model = _model(m, tp, 1, True, True)
    opt = _optimizer(model)
    for step in range(2):
        _step(model, opt, step)
    it = Path(root) / "iter_0000002" / f"mp_rank_{rank:02d}"
    it.mkdir(parents=True, exist_ok=True)
    torch.save({"args": megatron_args(m, tp, 1), "iteration": 2, "checkpoint_version": 3.0,
                "model": model.state_dict(), "optimizer": opt.state_dict(),
                "rng_state": [{"torch_rng_state": torch.get_rng_state()}]}, it / "model_optim_rng.pt")
    (Path(root) / "latest_checkpointed_iteration.txt").write_text("2")
    loss = _step(model, opt, 2)  # the uninterrupted run goes on
    logits = _forward(ps, model, m, tp, 1)
    if logits is not None:
        torch.save({"loss": loss, "logits": logits}, Path(root).parent / f"{Path(root).name}.after.pt")
    dist.barrier()
    dist.destroy_process_group()


def _resume_worker(rank, m, tp, root, out, port):
    ps = _init(rank, tp, tp, 1, port)
    model = _model(m, tp, 1, True, True)
    tracker = (Path(root) / "latest_checkpointed_iteration.txt").read_text().strip()
    state = torch.load(Path(root) / f"iter_{int(tracker):07d}" / f"mp_rank_{rank:02d}" / "model_optim_rng.pt",
                       weights_only=False)
    model.load_state_dict(state["model"], strict=True)
    opt = _optimizer(model)
    opt.load_state_dict(state["optimizer"])
    loss = _step(model, opt, 2)
    logits = _forward(ps, model, m, tp, 1)
    if logits is not None:
        torch.save({"loss": loss, "logits": logits}, out)
    dist.barrier()
    dist.destroy_process_group()


def train_and_save(m: dict, tp: int, root: Path) -> dict:
    """Train 2 steps at TP=tp, save (with optimizer state), train one more; that step's result."""
    _spawn(_train_save_worker, tp, m, tp, str(root))
    return torch.load(root.parent / f"{root.name}.after.pt")


def resume_one_step(m: dict, tp: int, root: Path) -> dict:
    """Load model and optimizer at TP=tp (PP=1) and take the same next step."""
    out = root.parent / f"{root.name}.resumed.pt"
    _spawn(_resume_worker, tp, m, tp, str(root), str(out))
    return torch.load(out)


def _save_dist_worker(rank, m, tp, root, port):
    """The same model as _save_worker, saved by Megatron-Core's own dist_checkpointing."""
    _init(rank, tp, tp, 1, port)
    torch.cuda.synchronize = lambda *a, **k: None
    from megatron.core import dist_checkpointing

    model = _seeded_model(m, tp)
    it = Path(root) / "iter_0000010"
    if rank == 0:
        it.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    state = {"model": model.sharded_state_dict(), "args": megatron_args(m, tp, 1), "iteration": 10,
             "checkpoint_version": 3.0}
    dist_checkpointing.save(state, str(it))
    if rank == 0:
        (Path(root) / "latest_checkpointed_iteration.txt").write_text("10")
    dist.barrier()
    dist.destroy_process_group()


def save_dist(m: dict, tp: int, root: Path) -> None:
    """Save a real Megatron-Core torch_dist checkpoint of the model save_real builds."""
    _spawn(_save_dist_worker, tp, m, tp, str(root))


def _load_dist_worker(rank, m, tp, root, out, port):
    """Megatron-Core's own dist_checkpointing.load at TP=tp (PP=1), then a forward."""
    ps = _init(rank, tp, tp, 1, port)
    torch.cuda.synchronize = lambda *a, **k: None
    from megatron.core import dist_checkpointing

    model = _model(m, tp, 1, True, True)
    tracker = (Path(root) / "latest_checkpointed_iteration.txt").read_text().strip()
    it = Path(root) / f"iter_{int(tracker):07d}"
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(it))
    model.load_state_dict(state["model"], strict=True)
    common = torch.load(it / "common.pt", weights_only=False)
    assert common["args"].tensor_model_parallel_size == tp
    logits = _forward(ps, model, m, tp, 1)
    if logits is not None:
        torch.save(logits, out)
    dist.barrier()
    dist.destroy_process_group()


def load_dist_logits(m: dict, tp: int, root: Path) -> torch.Tensor:
    out = root.parent / f"{root.name}.dist-logits.pt"
    _spawn(_load_dist_worker, tp, m, tp, str(root), str(out))
    return torch.load(out)


# ------------------------- torch_dist with Megatron-Core's own (non-distributed) optimizer


def _cpu_tensors_for_cuda():
    """CPU shim (test only): the tensors mcore's optimizers create on "cuda" (loss scale,
    found-inf flag) stay on the CPU; and bf16 parameters count as CUDA ones for
    Float16OptimizerWithFloat16Params, which checks ``param.type()``."""
    if getattr(torch, "_ckptool_cpu_shim", False):
        return
    tensor, type_ = torch.tensor, torch.Tensor.type

    def cpu_tensor(*a, device=None, **k):
        return tensor(*a, device=None if str(device).startswith("cuda") else device, **k)

    def cuda_type(self, *a, **k):
        name = type_(self, *a, **k)
        return name.replace("torch.", "torch.cuda.", 1) if not a and not k else name

    torch.tensor, torch.Tensor.type = cpu_tensor, cuda_type
    torch._ckptool_cpu_shim = True


def _mcore_optimizer(model, bf16: bool):
    """What get_megatron_optimizer builds without TE/apex (torch AdamW over Megatron's param
    groups): FP32Optimizer, or Float16OptimizerWithFloat16Params for a bf16 model. The
    scheduler's per-group weight decay (wd_mult) is set once; no gradient clipping."""
    from megatron.core.optimizer import (OptimizerConfig, _get_megatron_optimizer_based_on_param_groups,
                                         _get_param_groups)

    _cpu_tensors_for_cuda()
    config = OptimizerConfig(optimizer="adam", lr=LR, weight_decay=WD, clip_grad=0.0, bf16=bf16,
                             params_dtype=torch.bfloat16 if bf16 else torch.float32)
    groups = _get_param_groups([model], config, None)
    opt = _get_megatron_optimizer_based_on_param_groups(config, [model], groups)
    for g in opt.param_groups:
        g["weight_decay"] = WD * g["wd_mult"]
    return opt


def _dist_model(m, tp, bf16):
    model = _model(m, tp, 1, True, True)
    return model.to(torch.bfloat16) if bf16 else model


def _mcore_step(model, opt, step: int):
    tok, labels = _batch(step)
    pos = torch.arange(SEQ).expand(BATCH, SEQ)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), 1)
    model.train()
    opt.zero_grad()
    loss = model(tok, pos, mask, labels=labels).float().mean()
    loss.backward()
    opt.step()
    return loss.item()


def _local_optimizer_state(model, opt) -> dict:
    """This rank's Adam moments (and fp32 masters) by local parameter name."""
    out = {}
    for name, p in model.named_parameters():
        main = getattr(p, "main_param", p)
        state = opt.optimizer.state[main]
        out[name] = {k: v.clone() for k, v in state.items() if k in ("exp_avg", "exp_avg_sq", "step")}
        if main is not p:
            out[name]["fp32_param"] = main.detach().clone()
    return out


def _dist_sharded(model, opt, is_loading=False):
    model_sd = model.sharded_state_dict()
    return {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, is_loading=is_loading)}


def _train_save_dist_worker(rank, m, tp, root, bf16, port):
    ps = _init(rank, tp, tp, 1, port)
    torch.cuda.synchronize = lambda *a, **k: None
    from megatron.core import dist_checkpointing

    torch.manual_seed(1234)
    model = _dist_model(m, tp, bf16)
    opt = _mcore_optimizer(model, bf16)
    for step in range(2):
        _mcore_step(model, opt, step)
    it = Path(root) / "iter_0000002"
    if rank == 0:
        it.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    args = megatron_args(m, tp, 1)
    if bf16:
        args.params_dtype, args.bf16 = torch.bfloat16, True
    dist_checkpointing.save({**_dist_sharded(model, opt), "args": args, "iteration": 2,
                             "checkpoint_version": 3.0,
                             "opt_param_scheduler": {"num_steps": 2, "max_lr": LR}}, str(it))
    if rank == 0:
        (Path(root) / "latest_checkpointed_iteration.txt").write_text("2")
    torch.save(_local_optimizer_state(model, opt),
               Path(root).parent / f"{Path(root).name}.optim-rank{rank}.pt")
    loss = _mcore_step(model, opt, 2)  # the uninterrupted run goes on
    logits = _forward(ps, model, m, tp, 1)
    if logits is not None:
        torch.save({"loss": loss, "logits": logits.float()},
                   Path(root).parent / f"{Path(root).name}.after.pt")
    dist.barrier()
    dist.destroy_process_group()


def _resume_dist_worker(rank, m, tp, root, out, bf16, port):
    """Megatron-LM's load path: dist_checkpointing.load of the model's and the optimizer's
    sharded state dicts (is_loading=True), then load_state_dict of each; one more step."""
    ps = _init(rank, tp, tp, 1, port)
    torch.cuda.synchronize = lambda *a, **k: None
    from megatron.core import dist_checkpointing

    model = _dist_model(m, tp, bf16)
    opt = _mcore_optimizer(model, bf16)
    tracker = (Path(root) / "latest_checkpointed_iteration.txt").read_text().strip()
    it = Path(root) / f"iter_{int(tracker):07d}"
    state = dist_checkpointing.load(_dist_sharded(model, opt, is_loading=True), str(it))
    model.load_state_dict(state["model"], strict=True)
    opt.load_state_dict(state["optimizer"])
    loaded = _local_optimizer_state(model, opt)
    loss = _mcore_step(model, opt, 2)
    logits = _forward(ps, model, m, tp, 1)
    torch.save(loaded, Path(out).parent / f"{Path(out).name}.optim-rank{rank}.pt")
    if logits is not None:
        torch.save({"loss": loss, "logits": logits.float()}, out)
    dist.barrier()
    dist.destroy_process_group()


def train_and_save_dist(m: dict, tp: int, root: Path, bf16: bool = False) -> dict:
    """Train 2 steps at TP=tp with Megatron-Core's own optimizer (FP32, or bf16 with fp32
    masters), save torch_dist with the optimizer by ``dist_checkpointing.save``, train one
    more step; that step's loss and logits."""
    _spawn(_train_save_dist_worker, tp, m, tp, str(root), bf16)
    return torch.load(root.parent / f"{root.name}.after.pt")


def resume_one_step_dist(m: dict, tp: int, root: Path, bf16: bool = False) -> dict:
    """Load a torch_dist checkpoint with its optimizer at TP=tp the way Megatron-LM does, take
    the next step; its loss and logits, and (``"optimizer"``) the loaded state per rank."""
    out = root.parent / f"{root.name}.resumed-dist.pt"
    _spawn(_resume_dist_worker, tp, m, tp, str(root), str(out), bf16)
    result = torch.load(out)
    result["optimizer"] = [torch.load(root.parent / f"{out.name}.optim-rank{r}.pt") for r in range(tp)]
    return result
