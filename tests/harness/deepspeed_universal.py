"""DeepSpeed universal checkpoints on CPU: load with ``load_universal`` at any DP size and
stage, and DeepSpeed's own ``ds_to_universal.py`` for comparison.

Builds on :mod:`tests.harness.deepspeed_engine` (its tiny model, config, training step and truth);
only the engine's config differs: ``{"checkpoint": {"load_universal": true}}``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

from tests.conftest import spawn  # noqa: E402
from tests.harness import deepspeed_engine as H  # noqa: E402


def engine(stage: int, dp: int, precision: str = "fp32"):
    """:func:`tests.harness.deepspeed_engine.engine`, configured to load universal checkpoints."""
    import deepspeed

    torch.manual_seed(0)
    model = H.Tiny()
    groups = H.decay_groups(model)
    config = {**H.config(stage, dp, precision), "checkpoint": {"load_universal": True}}
    eng, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
    return eng


def _load_worker(rank: int, dp: int, jobs: list[tuple[int, str, str]], precision: str,
                 port: int) -> None:
    H._init(rank, dp, port)
    for stage, ckpt, result in jobs:
        eng = engine(stage, dp, precision)
        path, _ = eng.load_checkpoint(ckpt)
        assert path is not None, f"DeepSpeed loaded nothing from {ckpt}"
        if stage == 3:
            unshare_zero3_steps(eng)
        loaded, steps = H.full_state(eng), eng.global_steps
        loss = H.train_step(eng, H.NEXT_STEP, rank, dp)
        after = H.full_state(eng)["params"]
        if rank == 0:
            torch.save({"loaded": loaded, "loss": loss, "after": after,
                        "global_steps": steps}, result)


def unshare_zero3_steps(eng) -> None:
    """Test shim for a DeepSpeed 0.19.8 bug: the ZeRO-3 universal loader
    (``load_hp_checkpoint_state_from_checkpoint_dir_stage3``) sets one and the same ``step``
    tensor on every param group's state, and torch's AdamW increments it in place, so with
    two groups the second counts each step twice (its bias correction uses step 4 instead
    of 3). No file can avoid it; each group gets its own copy here, as a plain load has."""
    state = eng.optimizer.optimizer.state
    for fp32 in eng.optimizer.fp32_partitioned_groups_flat:
        if "step" in state[fp32]:
            state[fp32]["step"] = state[fp32]["step"].clone()


def load(dp: int, jobs: list[tuple[int, Path, Path]], precision: str = "fp32") -> None:
    """For each ``(stage, universal run root, result)``: load at ``dp`` with
    ``load_universal``, record the loaded state, take the next step, save the result
    (as :func:`tests.harness.deepspeed_engine.load` does)."""
    H._spawn(_load_worker, dp, [(s, str(c), str(r)) for s, c, r in jobs], precision)


def _ds_to_universal_worker(rank: int, jobs: list[tuple[str, str]]) -> None:
    from deepspeed.checkpoint import ds_to_universal

    H._quiet()
    for src, dst in jobs:
        ds_to_universal.main(argparse.Namespace(
            input_folder=src, output_folder=dst, num_extract_workers=1, num_merge_workers=1,
            keep_temp_folder=False, strict=True, inject_missing_state=True))


def ds_to_universal(jobs: list[tuple[Path, Path]]) -> None:
    """DeepSpeed's ``ds_to_universal.py`` per ``(tag dir, output tag dir)``, in one worker
    forked from the preloaded server. A plain engine saves no ``universal_checkpoint_info``,
    so ZeRO-1/2 sources need ``--inject_missing_state``; ``latest_universal`` goes beside
    the output tag dir."""
    spawn(_ds_to_universal_worker, 1, ([(str(s), str(d)) for s, d in jobs],), "ds_to_universal")
