"""The save hook inside a Megatron-DeepSpeed-style 3D job: a real DeepSpeed ``PipelineEngine``
over the GPTModelPipe-shaped model made tensor-parallel (``tests/harness/deepspeed_pipe_tp.py``)
trains at TP2 x PP2 x DP1 on 4 gloo ranks and saves through ``AsyncCheckpointer`` with
``training.deepspeed.sharded_state(engine, args=...)``, then takes one more step (the run that
went on). Fresh processes then build the engine at TP1 x PP2 x DP2 and at TP2 x PP1 x DP2,
``load_latest`` into their description, ``restore`` and take the same step.

Checked by parameter name, TP shards concatenated by the harness's own rule (not ckptool's):
the fp32 masters and Adam moments the new engine holds (DeepSpeed's ``safe_get_full_*``, which
gathers each DP partition) equal the saved engine's bit for bit, the module weights too, and
the first resumed loss is the uninterrupted run's. Cases: fp32 ZeRO-1, bf16 ZeRO-1, and bf16
with DeepSpeed's BF16_Optimizer (stage 0), which Megatron-DeepSpeed's bf16 runs use.

``ckptool convert STEP --to deepspeed`` of the hook checkpoints writes pipeline layer files,
model states and ZeRO-1 files that plain DeepSpeed ``engine.load_checkpoint`` reads at
TP2 x PP1 x DP2 and TP1 x PP2 x DP2, with the same state bit for bit and the same next loss;
BF16_Optimizer's files (which DeepSpeed 0.19.8 cannot load for any pipeline) read back as
the hook's tensors.
"""

from __future__ import annotations

import argparse
import os

import pytest
import torch

from tests.conftest import peer

os.environ.setdefault("DS_ACCELERATOR", "cpu")
peer("deepspeed")

from tests.harness import deepspeed_engine as H  # noqa: E402
from tests.harness import deepspeed_pipe as P  # noqa: E402
from tests.harness import deepspeed_pipe_tp as T  # noqa: E402
from tests.harness.deepspeed_pipe import DEAD, KINDS  # noqa: E402

WORLD = 4
CASES = (("fp32", 1, "fp32"), ("bf16", 1, "bf16"), ("bf16opt", 0, "bf16"), ("fp16", 1, "fp16"))
"""(name, ZeRO stage, precision); bf16 at stage 0 runs DeepSpeed's BF16_Optimizer; fp16 has a
dynamic loss scale that has overflowed and dropped before the save."""
TARGETS = ((1, 2), (2, 1))
"""(TP, PP) of the resumed jobs, DP = 4 / (TP * PP) = 2."""
NATIVE = ("fp32", "bf16", "fp16")
"""The cases converted to DeepSpeed's own files and loaded by DeepSpeed (ZeRO-1). DeepSpeed
0.19.8 cannot load a bf16 pipeline's BF16_Optimizer state, its own included (see
``tests/test_deepspeed_pipe_reshard.py``): that case is checked by its files."""


def _args(tp: int, pp: int) -> argparse.Namespace:
    return argparse.Namespace(**H.PIPE_ARGS, tensor_model_parallel_size=tp,
                              pipeline_model_parallel_size=pp, world_size=WORLD,
                              data_parallel_size=WORLD // (tp * pp), iteration=H.STEPS)


def _record(eng) -> dict:
    return {"state": H.full_state(eng), "stage": eng.stage_id, "tp": T._TP["rank"],
            "dp": eng.grid.data_parallel_id, "global_steps": eng.global_steps,
            "module": {n: p.detach().clone() for n, p in eng.module.named_parameters()},
            "lr": eng.optimizer.optimizer.param_groups[0]["lr"], "adam_steps": T.adam_steps(eng), "hyper": T.hyper(eng),
            "scaler": H.scaler_state(eng)}


def _save_worker(rank: int, world: int, root: str, port: int) -> None:
    from training import AsyncCheckpointer
    from training.deepspeed import sharded_state

    H._init(rank, world, port)
    for name, stage, precision in CASES:
        eng = T.engine(2, 2, 1, stage, precision)
        for step in range(H.STEPS):
            P.train_batch(eng, step)
        # the tokenizer's vocabulary, which Megatron-DeepSpeed's args do not carry: recorded in
        # the manifest, so `convert` to another TP needs no --true-vocab-size
        ckpt = AsyncCheckpointer(f"{root}/{name}", topology={"tp": 2, "pp": 2, "dp": 1, "zero": stage},
                                 true_vocab_size=H.PIPE_ARGS["padded_vocab_size"])
        ckpt.save(H.STEPS, sharded_state(eng, args=vars(_args(2, 2))))
        ckpt.wait()
        args = _args(2, 2)
        args.bf16, args.fp16 = precision == "bf16", precision == "fp16"
        eng.save_checkpoint(f"{root}/ds_{name}", client_state={"args": args, "checkpoint_version": 3.0,
                                                               "iteration": H.STEPS})
        record = _record(eng)
        record["loss"] = P.train_batch(eng, H.NEXT_STEP)
        torch.save(record, f"{root}/{name}.rank{rank}.truth.pt")


def _load_worker(rank: int, world: int, root: str, port: int) -> None:
    from training import AsyncCheckpointer
    from training.deepspeed import restore, sharded_state

    H._init(rank, world, port)
    for name, stage, precision in CASES:
        for tp, pp in TARGETS:
            eng = T.engine(tp, pp, world // (tp * pp), stage, precision)
            state = sharded_state(eng, args=_args(tp, pp))
            step = AsyncCheckpointer(f"{root}/{name}").load_latest(state)
            restore(eng, state)
            record = _record(eng)
            record["step"] = step
            record["loss"] = P.train_batch(eng, H.NEXT_STEP)
            torch.save(record, f"{root}/{name}.tp{tp}pp{pp}.rank{rank}.pt")


@pytest.fixture(scope="module")
def hook(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds_pipe_hook")
    P._spawn(_save_worker, WORLD, str(root))
    P._spawn(_load_worker, WORLD, str(root))
    return root


def _by_name(records: list[dict]) -> dict:
    """(kind, parameter name) -> the whole tensor (TP shards joined), over every stage; a
    tied module's from the first stage (the last stage's dead copy of the position
    embeddings is never described, so it is left out)."""
    out: dict = {}
    stages: dict[tuple[int, int], dict[int, dict]] = {}
    for r in records:
        stages.setdefault((r["stage"], r["dp"]), {})[r["tp"]] = r
    for (stage, _), ranks in sorted(stages.items()):
        tps = [ranks[t] for t in sorted(ranks)]
        for kind in (*KINDS, "module"):
            tensors = tps[0]["state"][kind] if kind != "module" else tps[0]["module"]
            for name in tensors:
                if stage > 0 and name == DEAD:
                    continue
                shards = [(t["state"][kind] if kind != "module" else t["module"])[name] for t in tps]
                out.setdefault((kind, name), T.whole(shards, name))
    return out


def _load(root, pattern: str) -> list[dict]:
    return [torch.load(root / pattern.format(r), weights_only=False) for r in range(WORLD)]


@pytest.mark.parametrize("tp,pp", TARGETS, ids=[f"tp{t}pp{p}dp2" for t, p in TARGETS])
@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_tp2_pp2_hook_checkpoint_resumes_at_another_topology(hook, name, tp, pp):
    truth = _load(hook, f"{name}.rank{{}}.truth.pt")
    got = _load(hook, f"{name}.tp{tp}pp{pp}.rank{{}}.pt")
    source, loaded = _by_name(truth), _by_name(got)
    assert sorted(loaded) == sorted(source)
    assert len(source) == 4 * 52  # masters, two moments and weights of 52 parameters
    for key, value in source.items():
        assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), key
    loss = truth[0]["loss"]
    assert {r["loss"] for r in truth} == {loss}  # every rank of a pipeline reports it
    taken = H.STEPS - (truth[0]["scaler"] or {}).get("skipped_steps", 0)  # fp16 skips overflows
    for r in got:
        assert r["step"] == H.STEPS and r["global_steps"] == H.STEPS
        assert r["adam_steps"] == truth[0]["adam_steps"] == [float(taken)] * 2
        assert r["lr"] == truth[0]["lr"]
        assert r["scaler"] == truth[0]["scaler"]  # fp16: the loss scaler as saved
        assert abs(r["loss"] - loss) / abs(loss) < 1e-5, (r["stage"], r["tp"], r["loss"], loss)
    if name == "fp16":  # not a fresh engine's scaler, so the check above can fail; a step taken
        assert truth[0]["scaler"]["cur_scale"] < 2.0 ** 16 and 1 <= taken < H.STEPS


@pytest.fixture(scope="module")
def native(hook):
    """Each ZeRO-1 hook checkpoint converted to DeepSpeed files at each target, loaded by
    plain ``engine.load_checkpoint`` (``tests/harness/deepspeed_pipe_tp.py``)."""
    import ckptool
    from ckptool.cli import main

    jobs = []
    for name in NATIVE:
        precision = {c[0]: c[2] for c in CASES}[name]
        for tp, pp in TARGETS:
            dst = hook / f"{name}.ds.tp{tp}pp{pp}"
            try:
                main(["convert", ckptool.latest(str(hook / name)).path, str(dst), "--to", "deepspeed",
                      "--to-tp", str(tp), "--to-pp", str(pp), "--to-dp", str(WORLD // (tp * pp))])
            except SystemExit as exc:
                assert exc.code in (0, None), f"convert exited {exc.code}"
            jobs.append((dst, tp, pp, hook / f"{name}.native.tp{tp}pp{pp}", precision))
    T.load(WORLD, jobs)
    return hook


@pytest.mark.parametrize("tp,pp", TARGETS, ids=[f"tp{t}pp{p}dp2" for t, p in TARGETS])
@pytest.mark.parametrize("name", NATIVE)
def test_converted_hook_checkpoint_loads_in_deepspeed(native, name, tp, pp):
    truth = _load(native, f"{name}.rank{{}}.truth.pt")
    got = _load(native, f"{name}.native.tp{tp}pp{pp}.rank{{}}.pt")
    source, loaded = _by_name(truth), _by_name(got)
    assert sorted(loaded) == sorted(source) and len(source) == 4 * 52
    for key, value in source.items():
        assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), key
    loss = truth[0]["loss"]
    for r in got:
        assert r["global_steps"] == H.STEPS and r["adam_steps"] == truth[0]["adam_steps"]
        assert r["hyper"] == truth[0]["hyper"] and r["hyper"][0]["weight_decay"] == 0.01
        assert r["scaler"] == truth[0]["scaler"]  # fp16: DeepSpeed's loader restored the scaler
        assert abs(r["loss"] - loss) / abs(loss) < 1e-5, (r["stage"], r["tp"], r["loss"], loss)


@pytest.mark.parametrize("tp,pp", TARGETS, ids=[f"tp{t}pp{p}dp2" for t, p in TARGETS])
def test_bf16_optimizer_hook_checkpoint_converts_to_files_holding_its_tensors(hook, tp, pp, run_cli,
                                                                               tmp_path):
    import ckptool
    from ckptool.checkpoints.open import open_checkpoint
    from tests.conftest import full_tensor

    src = ckptool.latest(str(hook / "bf16opt")).path
    res = run_cli("convert", src, tmp_path / "ds", "--to", "deepspeed", "--to-tp", tp, "--to-pp", pp,
                  "--to-dp", WORLD // (tp * pp), "--true-vocab-size", H.PIPE_ARGS["padded_vocab_size"])
    assert res.code == 0, res.err
    tag = tmp_path / "ds" / f"global_step{H.STEPS}"
    assert len(list(tag.glob("bf16_zero_pp_rank_*_mp_rank_*_optim_states.pt"))) == WORLD
    ours, theirs = open_checkpoint(src), open_checkpoint(str(tmp_path / "ds"))
    keys = {k for k in ours.index.tensors if not k.startswith("optimizer.state.step.")}
    assert keys == set(theirs.index.tensors) and len(keys) == 4 * 52
    for key in sorted(keys):
        assert torch.equal(full_tensor(theirs, key), full_tensor(ours, key)), key


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_pipeline_hook_keys_are_the_offline_readers(hook, name, run_cli):
    """The hook's global tensors are those ckptool reads from DeepSpeed's own checkpoint of
    the same engine (shapes and dtypes), plus the per-parameter step; it verifies deeply."""
    import ckptool
    from ckptool.checkpoints.open import open_checkpoint

    newest = ckptool.latest(str(hook / name)).path
    ours = open_checkpoint(newest).index.tensors
    theirs = open_checkpoint(str(hook / f"ds_{name}")).index.tensors
    steps = {k for k in ours if k.startswith("optimizer.state.step.")}
    assert {k: (tuple(v.shape), v.dtype) for k, v in ours.items() if k not in steps} == \
        {k: (tuple(v.shape), v.dtype) for k, v in theirs.items()}
    assert steps == {k.replace(".exp_avg.", ".step.") for k in theirs if ".exp_avg." in k}
    res = run_cli("verify", newest, "--deep")
    assert res.code == 0, res.out + res.err


def test_pipeline_engine_without_args_is_refused():
    from ckptool.core.errors import UsageError
    from training.deepspeed import sharded_state

    class Engine:  # what sharded_state looks at first: a grid and a PipelineModule's specs
        grid = object()
        module = type("M", (), {"_layer_specs": []})()

    with pytest.raises(UsageError, match="Megatron args"):
        sharded_state(Engine())
