"""``ckptool convert <DeepSpeed> DST --to megatron`` with the optimizer state, resumed by real
Megatron-Core.

The source is a Megatron-DeepSpeed pipeline checkpoint (GPTModelPipe's layer files, legacy
names) trained by a real DeepSpeed ``PipelineEngine`` at a constant learning rate
(``tests/harness/deepspeed_pipe.py``); the truth is the engine's own state at the save, and its
next step (loss, fp32 masters after it). The output is loaded the way Megatron-LM's loader
does it: a real mcore ``GPTModel`` (``load_state_dict``), Megatron-Core's own optimizer over
``_get_param_groups`` (``load_state_dict``), then ``OptimizerParamScheduler.load_state_dict``
at the job's args (which asserts them equal to the checkpoint's); then one training step on
the same batch, with the same lr, betas, eps, weight decay and gradient clipping.
"""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import peer

os.environ.setdefault("DS_ACCELERATOR", "cpu")
peer("deepspeed")
peer("megatron.core")

from tests.harness import deepspeed_engine as H  # noqa: E402
from tests.harness import deepspeed_pipe as P  # noqa: E402
from tests.harness import mcore as M  # noqa: E402
from tests.harness.deepspeed_pipe_tp import split_dim  # noqa: E402
from tests.test_deepspeed_pipe import canonical  # noqa: E402

LR, WD = 1e-2, 0.01
"""DeepSpeed's (deepspeed_engine.config's AdamW lr; the pipeline groups' weight decay)."""
SCHEDULE = dict(max_lr=LR, min_lr=0.0, lr_warmup_steps=0, lr_decay_steps=1000,
                lr_decay_style="constant", start_wd=WD, end_wd=WD, wd_incr_steps=1000,
                wd_incr_style="constant")
"""The resuming job's OptimizerParamScheduler (steps in samples), DeepSpeed's constant rate."""
FLAG = ["--megatron-lr-schedule", ",".join(f"{k}={v}" for k, v in SCHEDULE.items())]
GPT = dict(M.GPT, num_attention_heads=4, vocab_size=H.PIPE_ARGS["padded_vocab_size"], divisible_by=8)
"""The harness's GPTModelPipe as an mcore GPTModel (tanh GELU set on the model)."""
RUNS = (("fp32", 1, "fp32_const"), ("bf16", 0, "bf16_const"))
"""fp32 at ZeRO-1 (FP32Optimizer form), bf16 with DeepSpeed's BF16_Optimizer (Float16 form)."""
LOCAL_NORMS = {"self_attention.linear_qkv.layer_norm_": "input_layernorm.",
               "mlp.linear_fc1.layer_norm_": "pre_mlp_layernorm."}
"""Canonical (Transformer-Engine-style) norm names -> the local spec's module names."""
BF16_STEP = 5e-2
"""bf16 runs: the largest relative difference of the fp32 masters after the next step. Both
frameworks compute in bf16 by different kernels, and Adam's ``m / (sqrt(v) + eps)`` turns
the gradients' rounding differences on small-gradient elements into differences of up to an
``lr``-size step (measured: 8e-3 at TP1, 3.5e-2 at TP2, in the first layer's query_key_value
weight); the state they start from is checked bit for bit."""


def mcore_name(name: str) -> str:
    """A PipelineModule parameter name (TP1, PP1) under mcore's local-spec name."""
    key = canonical(name)
    for te, local in LOCAL_NORMS.items():
        key = key.replace(te, local)
    return key


def shard(name: str, tensor: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """TP rank ``rank``'s part of a DeepSpeed (TP1) tensor, as mcore splits it."""
    dim = split_dim(name)
    return tensor if dim is None else tensor.chunk(tp, dim)[rank]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds_to_megatron")
    P.save(root, runs=RUNS, pp=1)
    return root


# ----------------------------------------------------------------------- the Megatron job


def _model(tp: int, bf16: bool):
    model = M._model(GPT, tp, 1, True, True)
    for layer in model.decoder.layers:  # --openai-gelu, as the DeepSpeed model
        layer.mlp.activation_func = functools.partial(torch.nn.functional.gelu, approximate="tanh")
    return model.to(torch.bfloat16) if bf16 else model


def _cpu_zeros():
    """CPU shim (test only), as tests.harness.mcore's for ``torch.tensor``: the gradient clipping's
    ``torch.zeros(..., device='cuda')`` stays on the CPU."""
    zeros = torch.zeros

    def cpu_zeros(*a, device=None, **k):
        return zeros(*a, device=None if str(device).startswith("cuda") else device, **k)

    torch.zeros = cpu_zeros


def _job(model, bf16: bool):
    """Megatron-Core's optimizer and scheduler as get_megatron_optimizer and Megatron-LM's
    get_optimizer_param_scheduler build them from the job's args (no TE/apex: torch AdamW)."""
    from megatron.core.optimizer import (OptimizerConfig, _get_megatron_optimizer_based_on_param_groups,
                                         _get_param_groups)
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    M._cpu_tensors_for_cuda()
    config = OptimizerConfig(optimizer="adam", lr=LR, min_lr=0.0, weight_decay=WD, clip_grad=1.0,
                             adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8, bf16=bf16,
                             params_dtype=torch.bfloat16 if bf16 else torch.float32)
    opt = _get_megatron_optimizer_based_on_param_groups(config, [model],
                                                        _get_param_groups([model], config, None))
    s = SCHEDULE
    scheduler = OptimizerParamScheduler(
        opt, init_lr=0.0, max_lr=s["max_lr"], min_lr=s["min_lr"], lr_warmup_steps=s["lr_warmup_steps"],
        lr_decay_steps=s["lr_decay_steps"], lr_decay_style=s["lr_decay_style"], start_wd=s["start_wd"],
        end_wd=s["end_wd"], wd_incr_steps=s["wd_incr_steps"], wd_incr_style=s["wd_incr_style"],
        use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=False)
    return opt, scheduler


def _train_step(model, opt) -> float:
    """DeepSpeed's next step: its global batch at once (the mean of its equal micro batches)."""
    tokens = H.pipe_tokens(H.NEXT_STEP, P.GLOBAL)
    seq = tokens.shape[1] - 1
    pos = torch.arange(seq).expand(P.GLOBAL, seq)
    mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), 1)
    model.train()
    opt.zero_grad()
    loss = model(tokens[:, :-1], pos, mask, labels=tokens[:, 1:]).float().mean()
    loss.backward()
    opt.step()
    return loss.item()


def _load(root: str, rank: int, model, opt) -> dict:
    """The checkpoint's state for this rank as Megatron-LM reads it: the legacy rank file,
    or torch_dist's ``dist_checkpointing.load`` of the model's and the optimizer's sharded
    state dicts (``common.pt`` merged in)."""
    it = Path(root) / f"iter_{int((Path(root) / 'latest_checkpointed_iteration.txt').read_text()):07d}"
    if not (it / "common.pt").exists():
        return torch.load(it / f"mp_rank_{rank:02d}" / "model_optim_rng.pt", weights_only=False)
    from megatron.core import dist_checkpointing

    torch.cuda.synchronize = lambda *a, **k: None
    model_sd = model.sharded_state_dict()
    return dist_checkpointing.load({"model": model_sd, "optimizer": opt.sharded_state_dict(
        model_sd, is_loading=True)}, str(it))


def _resume_worker(rank, tp, jobs, port):
    """Per ``(checkpoint, bf16, out)``: Megatron-LM's load, then one step; what it loaded
    (moments, step, masters by local name; the groups after the scheduler), the loss, the
    fp32 parameters after the step, or the error Megatron raised."""
    M._init(rank, tp, tp, 1, port)
    _cpu_zeros()
    for root, bf16, out in jobs:
        model = _model(tp, bf16)
        opt, scheduler = _job(model, bf16)
        state = _load(root, rank, model, opt)
        assert state["args"].tensor_model_parallel_size == tp and "iteration" in state
        model.load_state_dict(state["model"], strict=True)
        try:
            opt.load_state_dict(state["optimizer"])
        except (KeyError, ValueError) as exc:
            torch.save({"error": f"{type(exc).__name__}: {exc}"}, f"{out}.rank{rank}.pt")
            continue
        scheduler.load_state_dict(state["opt_param_scheduler"])
        loaded = M._local_optimizer_state(model, opt)
        groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
        loss = _train_step(model, opt)
        after = {n: getattr(p, "main_param", p).detach().float().clone() for n, p in model.named_parameters()}
        torch.save({"loaded": loaded, "groups": groups, "loss": loss, "after": after}, f"{out}.rank{rank}.pt")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def resume(tp: int, jobs: list[tuple[Path, bool, Path]]) -> list[list[dict]]:
    """Run the Megatron job at TP ``tp`` (PP1) on each ``(checkpoint, bf16, out)``; per job,
    each rank's record."""
    M._spawn(_resume_worker, tp, tp, [(str(c), b, str(o)) for c, b, o in jobs])
    return [[torch.load(f"{o}.rank{r}.pt") for r in range(tp)] for _, _, o in jobs]


# ---------------------------------------------------------------------------- checks


def state_mismatches(ranks: list[dict], truth: dict, tp: int, bf16: bool) -> list[str]:
    """Every fp32 master and Adam moment Megatron loaded that is not DeepSpeed's, bit for bit
    (TP shards of it); the step is DeepSpeed's."""
    bad = []
    state = truth["state"]
    for name, master in state["params"].items():
        local = mcore_name(name)
        for rank, record in enumerate(ranks):
            got = record["loaded"][local]
            want = {"exp_avg": state["exp_avg"][name], "exp_avg_sq": state["exp_avg_sq"][name]}
            if bf16:
                want["fp32_param"] = master
            for kind, value in want.items():
                if not torch.equal(got[kind], shard(name, value, tp, rank)):
                    bad.append(f"{kind} {local} rank {rank}")
            if float(got["step"]) != truth["global_steps"]:
                bad.append(f"step {local} rank {rank}")
    return bad


def step_difference(ranks: list[dict], truth: dict, tp: int) -> tuple[float, float]:
    """(relative difference of the loss, largest relative difference of the fp32 parameters
    after the step) between Megatron's step and DeepSpeed's."""
    loss = abs(ranks[0]["loss"] - truth["loss"]) / abs(truth["loss"])
    worst = 0.0
    for name, after in truth["state_after"]["params"].items():
        for rank, record in enumerate(ranks):
            want = shard(name, after, tp, rank)
            got = record["after"][mcore_name(name)]
            if name.endswith("query_key_value.bias"):  # without the key bias rows ([q_h; k_h; v_h])
                got, want = (without_key_bias(t) for t in (got, want))
            diff = (got - want).abs().max() / want.abs().max()
            worst = max(worst, diff.item())
    return loss, worst


def without_key_bias(bias: torch.Tensor) -> torch.Tensor:
    """The query and value rows of a ``query_key_value`` bias. The key bias adds the same
    ``q . b_k`` to every score of a query, which the softmax removes: its gradient is
    rounding noise (1e-9), which Adam's ``m / (sqrt(v) + eps)`` turns into steps of
    ``lr``-size in both frameworks alike, so no two implementations agree on it."""
    d = H.PIPE_ARGS["hidden_size"] // H.PIPE_ARGS["num_attention_heads"]
    return bias.view(-1, 3, d)[:, ::2]


def _truth(runs, name):
    return torch.load(runs / f"{name}.rank0.truth.pt", weights_only=False)


def _convert(run_cli, src, dst, *extra):
    res = run_cli("convert", src, dst, "--to", "megatron", *extra)
    assert res.code == 0, res.err
    return res


def _mutate(src: Path, dst: Path, edit) -> Path:
    """A copy of the converted run root with ``edit(state)`` applied to every rank file."""
    shutil.copytree(src, dst)
    for path in dst.glob("iter_*/mp_rank_*/model_optim_rng.pt"):
        state = torch.load(path, weights_only=False)  # our own test output
        edit(state)
        torch.save(state, path)
    return dst


def _swap_moments(state):
    for entry in state["optimizer"]["state"].values():
        entry["exp_avg"], entry["exp_avg_sq"] = entry["exp_avg_sq"], entry["exp_avg"]


def _decay_everything(state):
    for group in state["optimizer"]["param_groups"]:
        group["wd_mult"] = 1.0


def test_fp32_zero1_resumes_in_megatron_core_at_tp2_exactly(runs, run_cli, tmp_path):
    """fp32 ZeRO-1 -> Megatron TP2 FP32Optimizer: every master and moment bit-equal; the next
    step's loss and parameters equal DeepSpeed's continued run. A copy with the moments
    swapped fails both checks (parameters after the step), and one whose no-decay group says wd_mult 1 is refused by
    Megatron's own group matching."""
    res = _convert(run_cli, runs / "fp32", tmp_path / "meg", "--tp", "2", *FLAG)
    assert "FP32Optimizer with torch AdamW" in res.out and "num_steps=8" in res.out, res.out
    swapped = _mutate(tmp_path / "meg", tmp_path / "swapped", _swap_moments)
    decayed = _mutate(tmp_path / "meg", tmp_path / "decayed", _decay_everything)
    good, bad, refused = resume(2, [(tmp_path / "meg", False, tmp_path / "good"),
                                    (swapped, False, tmp_path / "bad"),
                                    (decayed, False, tmp_path / "refused")])
    truth = _truth(runs, "fp32")
    assert state_mismatches(good, truth, 2, bf16=False) == []
    for record in good:  # the job's schedule applied to the checkpoint's groups
        assert [(g["wd_mult"], g["weight_decay"], g["lr"], g["betas"], g["eps"]) for g in record["groups"]] \
            == [(1.0, WD, LR, (0.9, 0.999), 1e-8), (0.0, 0.0, LR, (0.9, 0.999), 1e-8)]
    loss, params = step_difference(good, truth, 2)
    assert loss < 1e-5 and params < 1e-5, (loss, params)
    print(f"fp32 TP2: loss rel diff {loss:.2e}, parameters after the step {params:.2e}")
    assert state_mismatches(bad, truth, 2, bf16=False)
    assert not step_difference(bad, truth, 2)[1] < 1e-3  # (the loss comes before the step)
    assert all("Could not find parameter group" in r["error"] for r in refused), refused


def test_bf16_resumes_as_float16_optimizer_with_deepspeeds_masters(runs, run_cli, tmp_path):
    """bf16 (DeepSpeed's BF16_Optimizer) -> Megatron TP1 Float16OptimizerWithFloat16Params:
    the fp32 masters and moments bit-equal; the next step close to DeepSpeed's (see
    :data:`BF16_STEP`)."""
    res = _convert(run_cli, runs / "bf16", tmp_path / "meg", *FLAG)
    assert "Float16Optimizer" in res.out, res.out
    (ranks,) = resume(1, [(tmp_path / "meg", True, tmp_path / "out")])
    truth = _truth(runs, "bf16")
    assert state_mismatches(ranks, truth, 1, bf16=True) == []
    loss, params = step_difference(ranks, truth, 1)
    print(f"bf16 TP1: loss rel diff {loss:.2e}, fp32 masters after the step {params:.2e}")
    assert loss < 1e-3 and params < BF16_STEP, (loss, params)


def test_without_the_schedule_it_is_refused_naming_the_flag(runs, run_cli, tmp_path):
    res = run_cli("convert", runs / "fp32", tmp_path / "meg", "--to", "megatron")
    assert res.code == 2 and "--megatron-lr-schedule max_lr=" in res.err, res.err
    assert len(res.err.strip().splitlines()) == 1 and not (tmp_path / "meg").exists()
    res = run_cli("convert", runs / "fp32", tmp_path / "meg", "--to", "megatron",
                  "--megatron-lr-schedule", "max_lr=0.01")
    assert res.code == 2 and "lacks min_lr" in res.err and not (tmp_path / "meg").exists()
    res = run_cli("convert", runs / "fp32", tmp_path / "hf", "--to", "hf", *FLAG)
    assert res.code == 2 and "--megatron-lr-schedule does not apply to hf output" in res.err, res.err
    _convert(run_cli, runs / "fp32", tmp_path / "weights", "--drop-optimizer")
    res = run_cli("convert", tmp_path / "weights", tmp_path / "meg", "--to", "megatron", *FLAG)
    assert res.code == 2 and "applies only to a DeepSpeed source" in res.err, res.err


@pytest.mark.parametrize("case", ["biases decayed", "no weight decay in the job"])
def test_a_weight_decay_split_megatron_would_change_is_refused(runs, run_cli, tmp_path, case):
    """DeepSpeed decaying biases and norms (Megatron never does), or a job without weight
    decay resuming a run that decayed: refused with the parameter named, DST absent."""
    src, flag = runs / "fp32", list(FLAG)
    if case == "biases decayed":
        src = tmp_path / "src"
        shutil.copytree(runs / "fp32", src)
        for path in src.glob("global_step*/*optim_states.pt"):
            sd = torch.load(path, weights_only=False)  # our own test fixture
            sd["optimizer_state_dict"]["base_optimizer_state"]["param_groups"][1]["weight_decay"] = WD
            torch.save(sd, path)
        want = "DeepSpeed applies weight decay to 2.input_layernorm.weight (param group 1)"
    else:
        flag[1] = flag[1].replace(f"start_wd={WD},end_wd={WD}", "start_wd=0.0,end_wd=0.0")
        want = "DeepSpeed applies weight decay to tied_modules.embed.word_embeddings.weight"
    res = run_cli("convert", src, tmp_path / "meg", "--to", "megatron", *flag)
    assert res.code == 2 and want in res.err, res.err
    assert len(res.err.strip().splitlines()) == 1 and not (tmp_path / "meg").exists()


def test_to_megatron_dist_resumes_in_megatron_core_exactly(runs, run_cli, tmp_path):
    """The same through torch_dist (dist_checkpointing.load, as Megatron-LM): fp32 and bf16
    at TP2, every master and moment bit-equal, the fp32 step as DeepSpeed's."""
    for name in ("fp32", "bf16"):
        res = run_cli("convert", runs / name, tmp_path / name, "--to", "megatron-dist", "--tp", "2", *FLAG)
        assert res.code == 0 and "num_steps=8" in res.out, res.err
    fp32, bf16 = resume(2, [(tmp_path / "fp32", False, tmp_path / "fp32-out"),
                            (tmp_path / "bf16", True, tmp_path / "bf16-out")])
    assert state_mismatches(fp32, _truth(runs, "fp32"), 2, bf16=False) == []
    assert state_mismatches(bf16, _truth(runs, "bf16"), 2, bf16=True) == []
    loss, params = step_difference(fp32, _truth(runs, "fp32"), 2)
    print(f"torch_dist fp32 TP2: loss rel diff {loss:.2e}, parameters after the step {params:.2e}")
    assert loss < 1e-5 and params < 1e-5, (loss, params)
    loss, params = step_difference(bf16, _truth(runs, "bf16"), 2)
    print(f"torch_dist bf16 TP2: loss rel diff {loss:.2e}, fp32 masters after the step {params:.2e}")
    assert loss < 1e-3 and params < BF16_STEP, (loss, params)
