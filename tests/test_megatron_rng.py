"""Legacy Megatron outputs of sources without RNG state (HF, DCP, the save hook) hold, per
rank, the RNG state a fresh Megatron-LM start with the job's ``--seed`` sets, so Megatron-LM's
``load_checkpoint`` with default flags loads them: for the legacy format it always reads
``rng_state`` unless ``--no-load-rng``/``--finetune``, and exits when it is missing.

:func:`_megatron_lm_loads_rng` is Megatron-LM 0.16.1's RNG block of ``load_checkpoint``
(``megatron/training/checkpointing.py``) on CPU: the CUDA generator is a stand-in that checks
what ``CUDAGeneratorImpl::set_state`` checks (a uint8 tensor of 16 bytes, or 8 without the
offset).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from converters.megatron.legacy import RNG_TRACKERS, fresh_rng_state
from tests.test_hf import make_llama


class _CudaStandIn:
    """torch.cuda's generator calls as Megatron-LM's loader makes them, checking the bytes."""

    def __init__(self):
        self.states: dict = {}

    def set_rng_state(self, state: torch.Tensor) -> None:
        assert state.dtype == torch.uint8 and state.numel() in (8, 16), (state.dtype, state.shape)
        self.states["default"] = state

    def set_states(self, states: dict) -> None:  # CudaRNGStatesTracker.set_states
        for value in states.values():
            self.set_rng_state(value)
        self.states.update(states)


def _megatron_lm_loads_rng(state_dict: dict, no_load_rng: bool = False, finetune: bool = False) -> _CudaStandIn:
    """Megatron-LM 0.16.1 ``load_checkpoint``'s RNG block for the legacy format (release
    False, ``data_parallel_random_init`` False). Raises SystemExit where Megatron exits."""
    cuda = _CudaStandIn()
    if not finetune and not no_load_rng:
        try:
            if "rng_state" in state_dict:
                rng_state = state_dict["rng_state"][0]
                random.setstate(rng_state["random_rng_state"])
                np.random.set_state(rng_state["np_rng_state"])
                torch.set_rng_state(rng_state["torch_rng_state"])
                cuda.set_rng_state(rng_state["cuda_rng_state"])
                if not rng_state["rng_tracker_states"]:
                    raise KeyError
                cuda.set_states(dict(rng_state["rng_tracker_states"]))
            else:
                random.setstate(state_dict["random_rng_state"])
        except KeyError:
            raise SystemExit("Unable to load rng state from checkpoint") from None
    return cuda


def test_fresh_rng_state_is_a_fresh_megatron_start():
    """The state of each generator is the one seeding it at the stage's seed gives."""
    seed, tp, pp, ep, etp = 1234, 1, 2, 3, 1
    got = fresh_rng_state(seed, tp, pp, ep, etp)[0]
    stage = seed + 100 * pp
    random.seed(stage)
    np.random.seed(stage)
    torch.manual_seed(stage)
    assert got["random_rng_state"] == random.getstate()
    want = np.random.get_state()
    assert got["np_rng_state"][0] == want[0] and np.array_equal(got["np_rng_state"][1], want[1])
    assert got["np_rng_state"][2:] == want[2:]
    assert torch.equal(got["torch_rng_state"], torch.get_rng_state())
    seeds = {k: tuple(v.view(torch.int64).tolist()) for k, v in got["rng_tracker_states"].items()}
    assert seeds == {"data-parallel-rng": (stage, 0), "model-parallel-rng": (stage + 2718 + tp, 0),
                     "expert-parallel-rng": (stage + 1024 + 100 * ep + etp, 0)}
    assert tuple(got["cuda_rng_state"].view(torch.int64).tolist()) == (stage, 0)
    assert set(got["rng_tracker_states"]) == set(RNG_TRACKERS)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from ckptool.cli import main

    root = tmp_path_factory.mktemp("rng")
    make_llama(root / "hf")
    try:
        main(["convert", str(root / "hf"), str(root / "meg"), "--to", "megatron", "--tp", "2", "--pp", "2"])
    except SystemExit as exc:
        assert exc.code in (0, None)
    return root / "meg"


def test_legacy_output_without_source_rng_loads_with_megatron_lm_default_flags(converted):
    files = sorted(converted.glob("iter_*/mp_rank_*/model_optim_rng.pt"))
    assert len(files) == 4
    seeds = set()
    for path in files:
        state = torch.load(path, weights_only=False)
        cuda = _megatron_lm_loads_rng(state)  # default flags: no SystemExit
        seeds.add(tuple(cuda.states["model-parallel-rng"].view(torch.int64).tolist()))
    assert len(seeds) == 4  # (tp, pp) ranks draw different model-parallel streams
    bare = {k: v for k, v in torch.load(files[0], weights_only=False).items() if k != "rng_state"}
    with pytest.raises(SystemExit):  # the control: what Megatron-LM did with the old output
        _megatron_lm_loads_rng(bare)


def test_legacy_output_note_names_the_seed(converted, tmp_path, run_cli):
    res = run_cli("convert", converted.parent / "hf", tmp_path / "meg", "--to", "megatron")
    assert res.code == 0, res.err
    assert "--seed 1234" in res.out and "--no-load-rng" in res.out  # "...without --no-load-rng"
    res = run_cli("verify", tmp_path / "meg")
    assert res.code == 0, res.out + res.err
