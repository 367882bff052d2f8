"""Real DeepSpeed ``PipelineEngine``s for the pipeline reshard tests: train and save at one
pipeline size, then load at another and take the same next step.

The model, its spec list (GPTModelPipe's layer indices), the config and the batches are
:mod:`tests.harness.deepspeed_engine`'s. ``save`` records, per rank, the engine's fp32 masters and Adam
moments at the save and the loss of the next ``train_batch`` on a fixed global batch (the
run that went on without resharding); ``load`` builds the engine at another PP (and DP),
calls plain ``engine.load_checkpoint`` and records the same. :func:`truths` reads the
per-rank truths back (also those of :func:`tests.harness.deepspeed_engine.save_pipe`).
"""

from __future__ import annotations

import argparse
import os
import random
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from tests.conftest import free_port, spawn  # noqa: E402
from tests.harness import deepspeed_engine as H  # noqa: E402

GLOBAL = H.PIPE_MICRO * H.PIPE_GAS
"""Samples per step: the same global batch at every topology."""
KINDS = ("params", "exp_avg", "exp_avg_sq")
"""The fp32 masters and Adam moments of a truth's ``state`` (:func:`deepspeed_engine.full_state`)."""
DEAD = "tied_modules.embed.position_embeddings.weight"
"""The last stage's copy of the tied module's position embeddings: no forward uses it, no
layer file keeps it (DeepSpeed leaves the module's copy as built); ckptool's TP reshards write
its optimizer state as a replica of the live one."""
TAG = f"global_step{H.STEPS}"
"""The tag directory of a saved run."""


def engine(pp: int, dp: int, stage: int, precision: str):
    """The harness's GPTModelPipe-shaped PipelineModule at ``pp`` stages (``type:transformer``
    partition, as Megatron-DeepSpeed), under a DeepSpeed engine with ``GLOBAL`` samples a step."""
    import deepspeed
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    torch.manual_seed(0)
    topo = PipeModelDataParallelTopology(num_pp=pp, num_mp=1, num_dp=dp)
    model = PipelineModule(layers=H.pipe_specs(), loss_fn=H._cross_entropy, topology=topo,
                           partition_method="type:transformer")
    groups = H.decay_groups(model)
    cfg = H.config(stage, dp, precision)
    cfg.update(train_batch_size=GLOBAL, train_micro_batch_size_per_gpu=H.PIPE_MICRO,
               gradient_accumulation_steps=GLOBAL // (H.PIPE_MICRO * dp))
    eng, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=cfg)
    return eng


def train_batch(eng, step: int) -> float:
    """One step on the global batch of ``step``, this DP rank's share in micro batches."""
    dp, rank = eng.grid.data_parallel_size, eng.grid.data_parallel_id
    share = GLOBAL // dp
    tokens = H.pipe_tokens(step, GLOBAL)[rank * share:(rank + 1) * share]
    batches = iter([(t[:, :-1], t[:, 1:]) for t in tokens.split(H.PIPE_MICRO)])
    return float(eng.train_batch(batches))


def _record(eng) -> dict:
    state = H.full_state(eng)
    return {"state": state, "stage": eng.stage_id, "global_steps": eng.global_steps}


def _save_worker(rank: int, world: int, root: str, pp: int, runs: list, port: int) -> None:
    H._init(rank, world, port)
    for name, stage, precision in runs:
        eng = engine(pp, world // pp, stage, precision)
        for step in range(H.STEPS):
            train_batch(eng, step)
        args = argparse.Namespace(**H.PIPE_ARGS, tensor_model_parallel_size=1,
                                  pipeline_model_parallel_size=pp, world_size=world,
                                  data_parallel_size=world // pp, iteration=H.STEPS)
        args.bf16 = precision.startswith("bf16")
        rng = [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                "torch_rng_state": torch.get_rng_state(), "rng_tracker_states": {}}]
        eng.save_checkpoint(f"{root}/{name}", client_state={
            "args": args, "checkpoint_version": 3.0, "iteration": H.STEPS, "tokens": 0,
            "rng_state": rng})
        record = _record(eng)
        record["loss"] = train_batch(eng, H.NEXT_STEP)
        record["module_after"] = H.module_state(eng)
        record["state_after"] = H.full_state(eng)
        torch.save(record, f"{root}/{name}.rank{rank}.truth.pt")


def _load_worker(rank: int, world: int, jobs: list, port: int) -> None:
    H._init(rank, world, port)
    for ckpt, pp, stage, precision, result in jobs:
        eng = engine(pp, world // pp, stage, precision)
        path, _ = eng.load_checkpoint(ckpt)
        assert path is not None, f"DeepSpeed found no checkpoint in {ckpt}"
        record = _record(eng)
        record["loss"] = train_batch(eng, H.NEXT_STEP)
        record["module_after"] = H.module_state(eng)
        torch.save(record, f"{result}.rank{rank}.pt")


def save(root: Path, runs=H.PIPE_RUNS, pp: int = 2, dp: int = 1) -> None:
    """``root/{name}`` per ``(name, stage, precision)`` of ``runs``, trained and saved at
    TP1/``pp``/``dp``, and ``{name}.rank{r}.truth.pt``: the state at the save (fp32
    masters and moments by parameter name), the next step's loss and the state after it
    (``state_after``)."""
    _spawn(_save_worker, pp * dp, str(root), pp, [tuple(r) for r in runs])


def load(world: int, jobs: list[tuple[Path, int, int, str, Path]]) -> None:
    """For each ``(checkpoint, pp, stage, precision, result)``: load at ``pp`` stages (DP is
    ``world // pp``), record the state and the next step's loss in ``{result}.rank{r}.pt``."""
    _spawn(_load_worker, world, [(str(c), pp, s, p, str(r)) for c, pp, s, p, r in jobs])


def truths(root: Path, name: str, world: int = 2) -> list[dict]:
    """Each rank's truth of the run ``root/name``: ``{name}.rank{r}.truth.pt``, as :func:`save`
    and :func:`tests.harness.deepspeed_engine.save_pipe` write them."""
    return [torch.load(root / f"{name}.rank{r}.truth.pt", weights_only=False) for r in range(world)]


def by_name(ranks: list[dict]) -> dict:
    """(kind, parameter name) -> the saving engine's tensor, from each rank's truth; a tied
    module's from the first stage (the live copy)."""
    out = {}
    for truth in ranks:
        for kind in KINDS:
            for name, value in truth["state"][kind].items():
                out.setdefault((kind, name), value)
    return out


def results(prefix: Path, world: int) -> list[dict]:
    return [torch.load(f"{prefix}.rank{r}.pt", weights_only=False) for r in range(world)]


def _spawn(fn, nprocs: int, *args) -> None:
    spawn(fn, nprocs, (nprocs, *args, free_port()), "DeepSpeed pipeline harness")
