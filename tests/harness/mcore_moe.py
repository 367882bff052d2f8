"""Real megatron-core MoE GPT models on CPU (gloo): SequentialMLP experts (the local spec),
built at TP/EP/ETP (ETP defaults to TP; PP = 1), saved in Megatron-LM's legacy layout (also trained, with
the optimizer state, and resumed) or in Megatron-Core's ``torch_dist``, and loaded back, with
a real forward. Runs in spawned processes; the dense helpers come from :mod:`tests.harness.mcore`.

Shims (test only, per DESIGN.md "Mixture of Experts"): mcore.py's, plus
``moe_utils.te_general_gemm = None`` (0.16.1's router names it, but it exists only with
Transformer Engine), and the ``allgather`` token dispatcher, which needs nothing more.

Every parameter is overwritten from a seed of its global name (an expert's by its global
index), cut for this rank as Megatron-Core cuts it, so the global model is the same at any
TP and EP; a seeded build alone is not (each rank draws only its local experts from the
global RNG, which shifts every later layer's draws).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

import tests.harness.mcore as M

MOE = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_query_groups": 2,
       "ffn_hidden_size": 48, "vocab_size": 250, "swiglu": True, "tied": False, "bias": False,
       "norm": "RMSNorm", "pos": "rope", "max_pos": M.SEQ, "divisible_by": 128,
       "num_experts": 4, "moe_ffn_hidden_size": 24, "topk": 2}
"""A tiny Llama-style MoE (Mixtral-like): every layer's MLP is E experts, top-k routed."""

ITERATION = 10
_EXPERT = re.compile(r"(\.local_experts\.)(\d+)(\.)")


def world_size(tp: int, ep: int, etp: int | None = None) -> int:
    """The fewest processes (PP = 1) that run TP=tp, EP=ep, ETP=etp: TP x DP with the least
    DP that Megatron-Core's rule ``etp * ep | tp * dp`` allows (DP = EP when ETP = TP)."""
    need = (etp or tp) * ep
    return tp * need // math.gcd(tp, need)


def moe_args(m: dict, tp: int, pp: int, ep: int, etp: int | None = None) -> argparse.Namespace:
    """The args Megatron-LM stores for a MoE run on :func:`world_size` processes per stage."""
    args = M.megatron_args(m, tp, pp)
    world = world_size(tp, ep, etp) * pp
    vars(args).update(
        num_experts=m["num_experts"], moe_ffn_hidden_size=m["moe_ffn_hidden_size"],
        moe_router_topk=m["topk"], moe_layer_freq=1, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp or tp, moe_router_score_function="softmax",
        moe_router_pre_softmax=m.get("pre_softmax", False), moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=False, moe_expert_capacity_factor=None,
        moe_shared_expert_intermediate_size=m.get("shared"), moe_shared_expert_gate=bool(m.get("shared")),
        add_qkv_bias=m.get("qkv_bias", False), qk_layernorm=m.get("qk_layernorm", False), world_size=world,
        data_parallel_size=world // (tp * pp))
    return args


def rank_dir(tp_rank: int, pp_rank: int, ep_rank: int, pp: int, ep: int) -> str:
    """Megatron-LM's legacy rank directory: ``mp_rank_TT`` [``_PPP`` if PP>1] [``_EEE`` if EP>1]."""
    return f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "") + \
        (f"_{ep_rank:03d}" if ep > 1 else "")


def _init(rank, tp, ep, etp, port):
    """mcore.py's shims, with expert parallelism (EP=ep, ETP=etp or TP) on
    :func:`world_size` processes."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size(tp, ep, etp))
    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda self, *a, **k: self
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.transformer.moe import moe_utils

    moe_utils.te_general_gemm = None
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             expert_model_parallel_size=ep,
                                             expert_tensor_parallel_size=etp or tp)
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    M._sliding_window_mask_on_cpu()
    return parallel_state


def _model(m: dict, tp: int, ep: int, etp: int | None = None):
    """:func:`tests.harness.mcore._model` with ``m``'s experts (SequentialMLP, Mixtral's or
    Qwen2-MoE's router, a gated shared expert when ``m["shared"]``), EP=ep, ETP=etp or TP."""
    return M._model(m, tp, 1, True, True, config=dict(
        num_moe_experts=m["num_experts"], moe_ffn_hidden_size=m["moe_ffn_hidden_size"],
        moe_router_topk=m["topk"], moe_router_score_function="softmax",
        moe_router_pre_softmax=m.get("pre_softmax", False), moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=False, moe_expert_capacity_factor=None,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp or tp,
        moe_shared_expert_intermediate_size=m.get("shared"), moe_shared_expert_gate=bool(m.get("shared"))),
        layer_spec=dict(num_experts=m["num_experts"], moe_grouped_gemm=False))


def global_name(name: str, ep_rank: int, local_experts: int) -> str:
    """A parameter's name with its local expert index made global (``ep_rank*E/EP + j``)."""
    return _EXPERT.sub(lambda x: f"{x[1]}{ep_rank * local_experts + int(x[2])}{x[3]}", name)


def _global_value(name: str, shape: list[int], m: dict) -> torch.Tensor:
    """The global tensor ``name`` of the harness model: norms 1 + 0.1·N, matrices N/sqrt(fan in);
    vocab rows past the true vocabulary (padding) are zero."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    if "norm" in name:
        return 1 + 0.1 * torch.randn(shape, generator=g)
    rows = min(shape[0], m["vocab_size"]) if name in ("embedding.word_embeddings.weight",
                                                      "output_layer.weight") else shape[0]
    out = torch.zeros(shape)
    out[:rows] = torch.randn([rows, *shape[1:]], generator=g) / shape[-1] ** 0.5
    return out


def _randomize(ps, model, m: dict) -> None:
    """Overwrite every parameter with its global value's piece for this rank (TP pieces cut as
    ``_initialize_affine_weight_cpu`` cuts them: stride·TP chunks, every TP-th one)."""
    ep_rank = ps.get_expert_model_parallel_rank()
    local = m["num_experts"] // ps.get_expert_model_parallel_world_size()
    with torch.no_grad():
        for name, p in model.named_parameters():
            expert = ".local_experts." in name
            if expert:
                rank, world = ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
            else:
                rank, world = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
            shape = list(p.shape)
            split = getattr(p, "tensor_model_parallel", False)
            if split:
                shape[p.partition_dim] *= world
            full = _global_value(global_name(name, ep_rank, local), shape, m)
            if split:
                chunks = full.chunk(p.partition_stride * world, dim=p.partition_dim)
                full = torch.cat(chunks[rank::world], dim=p.partition_dim)
            p.copy_(full)


def _randomized_model(ps, m: dict, tp: int, ep: int, etp: int | None = None):
    """The harness MoE model at (tp, ep, etp), every parameter its global value's piece."""
    torch.manual_seed(1234)
    model = _model(m, tp, ep, etp)
    _randomize(ps, model, m)
    return model


def _rank_file(ps, root, ep: int, iteration: int | None = None) -> Path:
    """This rank's legacy file ``root/iter_N/mp_rank_TT[_EEE]/model_optim_rng.pt`` (PP = 1);
    N is the tracker's when not given."""
    if iteration is None:
        iteration = int((Path(root) / "latest_checkpointed_iteration.txt").read_text().strip())
    return Path(root) / f"iter_{iteration:07d}" / rank_dir(
        ps.get_tensor_model_parallel_rank(), 0, ps.get_expert_model_parallel_rank(), 1, ep) / \
        "model_optim_rng.pt"


def _writes_legacy(ps) -> bool:
    """Megatron-LM's legacy writers: the ranks whose DP or expert-DP rank is 0 (together they
    hold every (tp, ep) shard; either alone does not when ETP < TP)."""
    return ps.get_data_parallel_rank() == 0 or ps.get_expert_data_parallel_rank() == 0


def _save_moe_worker(rank, m, tp, ep, etp, root, port):
    ps = _init(rank, tp, ep, etp, port)
    model = _randomized_model(ps, m, tp, ep, etp)
    if _writes_legacy(ps):
        f = _rank_file(ps, root, ep, ITERATION)
        f.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"args": moe_args(m, tp, 1, ep, etp), "iteration": ITERATION,
                    "checkpoint_version": 3.0, "model": model.state_dict()}, f)
    if rank == 0:
        (Path(root) / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    _save_logits(ps, model, m, tp, rank, Path(root).parent / f"{Path(root).name}.logits.pt")


def _load_rank_state(ps, model, tp: int, ep: int, etp: int | None, root) -> dict:
    """Load this rank's legacy file (the tracker's iteration) into ``model`` strictly; the
    file's whole state."""
    state = torch.load(_rank_file(ps, root, ep), weights_only=False)
    # Megatron-LM's loader asserts TP; it does not compare EP (check_checkpoint_args), but a
    # file of another EP holds other experts under the same local names.
    assert state["args"].tensor_model_parallel_size == tp
    assert state["args"].expert_model_parallel_size == ep
    assert state["args"].expert_tensor_parallel_size == (etp or tp)
    assert "iteration" in state
    model.load_state_dict(state["model"], strict=True)
    return state


def _save_logits(ps, model, m: dict, tp: int, rank: int, out) -> None:
    """Rank 0 saves the model's full-vocab logits at ``out``; then the group ends."""
    logits = M._forward(ps, model, m, tp, 1)
    if rank == 0:
        torch.save(logits, out)
    dist.barrier()
    dist.destroy_process_group()


def _load_moe_worker(rank, m, tp, ep, etp, root, out, port):
    ps = _init(rank, tp, ep, etp, port)
    model = _model(m, tp, ep, etp)
    _load_rank_state(ps, model, tp, ep, etp, root)
    _save_logits(ps, model, m, tp, rank, out)


def save_moe(m: dict, tp: int, ep: int, root: Path, etp: int | None = None) -> torch.Tensor:
    """Build the MoE model at TP=tp, EP=ep, ETP=etp on :func:`world_size` processes, save it
    in the legacy layout (``root/iter_0000010/mp_rank_TT[_EEE]/model_optim_rng.pt``, the
    files Megatron-LM's writers write); return its logits."""
    M._spawn(_save_moe_worker, world_size(tp, ep, etp), m, tp, ep, etp, str(root))
    return torch.load(root.parent / f"{root.name}.logits.pt")


def load_moe_logits(m: dict, tp: int, ep: int, root: Path, etp: int | None = None) -> torch.Tensor:
    """Load a legacy MoE checkpoint into real mcore models at TP=tp, EP=ep, ETP=etp (each
    rank its own file, strictly); return logits."""
    out = root.parent / f"{root.name}.loaded-logits.pt"
    M._spawn(_load_moe_worker, world_size(tp, ep, etp), m, tp, ep, etp, str(root), str(out))
    return torch.load(out)


# ---------------------------------------------------------------- training with an optimizer


def _average_expert_grads(ps, model) -> None:
    """What Megatron's DDP does to expert gradients, on a run without DDP: every rank here
    trains on the same batch, so a dense gradient is already the data-parallel mean, but an
    expert's sums the losses of all EP ranks (their tokens all reach it): scaled by 1/DP
    (DDP's ``expert_gradient_scaling_factor``; expert-DP is 1), training is the same at any EP."""
    dp = ps.get_data_parallel_world_size()
    for p in model.parameters():
        if not getattr(p, "allreduce", True):
            p.register_hook(lambda g: g / dp)


class _Chained:
    """What Megatron-Core's ``ChainedOptimizer`` of two FP32Optimizers is to a checkpoint at
    EP > 1: a dense and an expert optimizer (torch AdamW over mcore's param groups, split by
    ``is_expert_parallel``), whose state dict is the list of the two."""

    def __init__(self, model):
        groups = M._optimizer(model).param_groups
        self.parts = [torch.optim.AdamW([g for g in groups if g["is_expert_parallel"] == expert], lr=M.LR)
                      for expert in (False, True)]

    def zero_grad(self):
        for p in self.parts:
            p.zero_grad()

    def step(self):
        for p in self.parts:
            p.step()

    def state_dict(self):
        return [p.state_dict() for p in self.parts]

    def load_state_dict(self, states):
        for p, s in zip(self.parts, states, strict=True):
            p.load_state_dict(s)


def _moe_optimizer(model, ep: int):
    """Megatron-LM's non-distributed optimizer of the MoE model at EP ``ep``: one torch AdamW
    over mcore's param groups at EP1, the :class:`_Chained` pair at EP > 1."""
    return _Chained(model) if ep > 1 else M._optimizer(model)


def _step(model, opt, m: dict, step: int) -> float:
    """:func:`tests.harness.mcore._step` on token ids modulo the true vocabulary (MOE has 250)."""
    return M._step(model, opt, step, m["vocab_size"])


def _train_save_moe_worker(rank, m, tp, ep, root, port):
    ps = _init(rank, tp, ep, None, port)
    model = _randomized_model(ps, m, tp, ep)
    _average_expert_grads(ps, model)
    opt = _moe_optimizer(model, ep)
    for step in range(2):
        _step(model, opt, m, step)
    if _writes_legacy(ps):
        f = _rank_file(ps, root, ep, 2)
        f.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"args": moe_args(m, tp, 1, ep), "iteration": 2, "checkpoint_version": 3.0,
                    "model": model.state_dict(), "optimizer": opt.state_dict(),
                    "rng_state": [{"torch_rng_state": torch.get_rng_state()}]}, f)
    if rank == 0:
        (Path(root) / "latest_checkpointed_iteration.txt").write_text("2")
    loss = _step(model, opt, m, 2)  # the uninterrupted run goes on
    logits = M._forward(ps, model, m, tp, 1)
    if rank == 0:
        torch.save({"loss": loss, "logits": logits}, Path(root).parent / f"{Path(root).name}.after.pt")
    dist.barrier()
    dist.destroy_process_group()


def _resume_moe_worker(rank, m, tp, ep, root, out, port):
    ps = _init(rank, tp, ep, None, port)
    model = _model(m, tp, ep)
    state = _load_rank_state(ps, model, tp, ep, None, root)
    _average_expert_grads(ps, model)
    opt = _moe_optimizer(model, ep)
    opt.load_state_dict(state["optimizer"])
    loss = _step(model, opt, m, 2)
    logits = M._forward(ps, model, m, tp, 1)
    if rank == 0:
        torch.save({"loss": loss, "logits": logits}, out)
    dist.barrier()
    dist.destroy_process_group()


def train_and_save_moe(m: dict, tp: int, ep: int, root: Path) -> dict:
    """Train the MoE model of :func:`save_moe` 2 steps (:func:`_step`) at TP=tp, EP=ep, with a
    torch AdamW over Megatron-Core's param groups (:func:`tests.harness.mcore._optimizer`);
    save it in the legacy layout with the optimizer state (``iter_0000002``), train one more
    step; that step's loss and the logits after it."""
    M._spawn(_train_save_moe_worker, tp * ep, m, tp, ep, str(root))
    return torch.load(root.parent / f"{root.name}.after.pt")


def resume_one_step_moe(m: dict, tp: int, ep: int, root: Path) -> dict:
    """Load a legacy MoE checkpoint's model (strictly) and optimizer state at TP=tp, EP=ep
    and take the step :func:`train_and_save_moe` takes after saving; its loss and logits."""
    out = root.parent / f"{root.name}.resumed.pt"
    M._spawn(_resume_moe_worker, tp * ep, m, tp, ep, str(root), str(out))
    return torch.load(out)


# ---------------------------------------------------------------- torch_dist


def _save_moe_dist_worker(rank, m, tp, ep, etp, root, port):
    """The model of _save_moe_worker, saved by Megatron-Core's own dist_checkpointing."""
    ps = _init(rank, tp, ep, etp, port)
    torch.cuda.synchronize = lambda *a, **k: None
    from megatron.core import dist_checkpointing

    model = _randomized_model(ps, m, tp, ep, etp)
    it = Path(root) / f"iter_{ITERATION:07d}"
    if rank == 0:
        it.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save({"model": model.sharded_state_dict(), "args": moe_args(m, tp, 1, ep, etp),
                             "iteration": ITERATION, "checkpoint_version": 3.0}, str(it))
    if rank == 0:
        (Path(root) / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    _save_logits(ps, model, m, tp, rank, Path(root).parent / f"{Path(root).name}.logits.pt")


def _load_moe_dist_worker(rank, m, tp, ep, etp, root, out, port):
    """Megatron-Core's own dist_checkpointing.load at TP=tp, EP=ep, ETP=etp (any: it
    reshards itself), then a forward."""
    ps = _init(rank, tp, ep, etp, port)
    torch.cuda.synchronize = lambda *a, **k: None
    from megatron.core import dist_checkpointing

    model = _model(m, tp, ep, etp)
    tracker = (Path(root) / "latest_checkpointed_iteration.txt").read_text().strip()
    it = Path(root) / f"iter_{int(tracker):07d}"
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(it))
    model.load_state_dict(state["model"], strict=True)
    common = torch.load(it / "common.pt", weights_only=False)
    # Megatron-LM compares TP and PP only for a legacy checkpoint (check_checkpoint_args).
    assert common["iteration"] == int(tracker) and "args" in common
    _save_logits(ps, model, m, tp, rank, out)


def save_moe_dist(m: dict, tp: int, ep: int, root: Path, etp: int | None = None) -> torch.Tensor:
    """Save the MoE model of :func:`save_moe` at TP=tp, EP=ep as a real Megatron-Core
    ``torch_dist`` checkpoint (``root/iter_0000010``, ``common.pt`` with the args, the
    tracker); return its logits."""
    M._spawn(_save_moe_dist_worker, world_size(tp, ep, etp), m, tp, ep, etp, str(root))
    return torch.load(root.parent / f"{root.name}.logits.pt")


def load_moe_dist_logits(m: dict, tp: int, ep: int, root: Path, etp: int | None = None) -> torch.Tensor:
    """Load a ``torch_dist`` MoE checkpoint with ``dist_checkpointing.load`` into real mcore
    models at TP=tp, EP=ep, ETP=etp; return logits."""
    out = root.parent / f"{root.name}.dist-logits.pt"
    M._spawn(_load_moe_dist_worker, world_size(tp, ep, etp), m, tp, ep, etp, str(root), str(out))
    return torch.load(out)


# ---------------------------------------------------------------- the training hook


def _hook_state(ps, model, opt, m: dict, tp: int, ep: int):
    """(the spec, the topology, this rank's hook state) of the MoE run at (tp, ep): its
    parameters and Adam state described by ``training.megatron.sharded_state``."""
    # Imported here on purpose: the fork server preloads this module (conftest.PRELOAD), and
    # these import fsspec, which reads its FSSPEC_* configuration once, at import.
    from converters.schemas.megatron_args import spec_from_args
    from training.megatron import sharded_state

    spec, topo, _ = spec_from_args(moe_args(m, tp, 1, ep))
    state = sharded_state(model, spec, topo, tp_rank=ps.get_tensor_model_parallel_rank(), pp_rank=0,
                          dp_rank=ps.get_data_parallel_rank(), ep_rank=ps.get_expert_model_parallel_rank(),
                          optimizer=opt)
    return spec, topo, state


def _checkpointer(root, spec, topo, m: dict):
    from dataclasses import asdict

    from training import AsyncCheckpointer

    return AsyncCheckpointer(str(root), topology=topo.to_dict(), model_config=asdict(spec),
                             true_vocab_size=m["vocab_size"])


def _hook_train_save_worker(rank, m, tp, ep, root, port):
    ps = _init(rank, tp, ep, None, port)
    model = _randomized_model(ps, m, tp, ep)
    _average_expert_grads(ps, model)
    opt = M._optimizer(model)
    for step in range(2):
        _step(model, opt, m, step)
    spec, topo, state = _hook_state(ps, model, opt, m, tp, ep)
    ckpt = _checkpointer(root, spec, topo, m)
    ckpt.save(2, state)
    saved = {k: v.local.clone() for k, v in state["optimizer"].items()}
    ckpt.wait()
    logits = M._forward(ps, model, m, tp, 1)
    loss = _step(model, opt, m, 2)  # the uninterrupted run goes on
    if rank == 0:
        torch.save({"loss": loss, "state": saved, "logits": logits},
                   Path(root).parent / f"{Path(root).name}.after.pt")
    dist.barrier()
    dist.destroy_process_group()


def _hook_resume_worker(rank, m, tp, ep, root, out, port):
    ps = _init(rank, tp, ep, None, port)
    torch.manual_seed(99)  # not the saved weights: the load must fill every one
    model = _model(m, tp, ep)
    _average_expert_grads(ps, model)
    opt = M._optimizer(model)
    spec, topo, state = _hook_state(ps, model, opt, m, tp, ep)
    step = _checkpointer(root, spec, topo, m).load_latest(state)
    loaded = {k: v.local.clone() for k, v in state["optimizer"].items()}
    loss = _step(model, opt, m, 2)
    if rank == 0:
        torch.save({"step": step, "loss": loss, "state": loaded}, out)
    dist.barrier()
    dist.destroy_process_group()


def hook_train_save_moe(m: dict, tp: int, ep: int, root: Path) -> dict:
    """Train the MoE model 2 steps at TP=tp, EP=ep (as :func:`train_and_save_moe`), save it
    through the training hook (``AsyncCheckpointer`` at step 2), take one more step; that
    step's loss, rank 0's optimizer state as saved and the saved model's logits."""
    M._spawn(_hook_train_save_worker, tp * ep, m, tp, ep, str(root))
    return torch.load(root.parent / f"{root.name}.after.pt")


def hook_resume_moe(m: dict, tp: int, ep: int, root: Path) -> dict:
    """Build the MoE model at TP=tp, EP=ep from another seed, ``load_latest`` the hook's
    checkpoint into it and its optimizer, and take the next step: the loaded step, that
    step's loss, and rank 0's optimizer state as loaded."""
    out = root.parent / f"{root.name}.hook-resumed.pt"
    M._spawn(_hook_resume_worker, tp * ep, m, tp, ep, str(root), str(out))
    return torch.load(out)
