"""``ckptool reshard`` of Megatron-DeepSpeed pipeline checkpoints to another PP (and TP, DP),
checked against real DeepSpeed: a ``PipelineEngine`` trained and saved at TP1/PP2
(``tests/harness/deepspeed_pipe.py``), resharded from the CLI, loaded by plain
``engine.load_checkpoint`` at PP1, PP4 and PP1×DP2. TP2 targets are read back here and
loaded by DeepSpeed into a tensor-parallel model in ``tests/test_deepspeed_pipe_tp.py``.

What the engine holds after the load is compared with what the saving engine held, by
parameter name, bit for bit; the next ``train_batch`` (same global batch) gives the loss of
the run that went on without resharding. The one state no source keeps, the last stage's
dead copy of the tied position embeddings, is written as a replica of the live ones.

DeepSpeed 0.19.8 cannot ``load_checkpoint`` a bf16 pipeline's optimizer state, its own
included (``BF16_Optimizer.load_state_dict`` indexes the model states' optimizer dict by DP
rank: ``KeyError: 0``), so the bf16 run is checked by its files: the round trip and the
global view read back.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.conftest import peer

os.environ.setdefault("DS_ACCELERATOR", "cpu")
peer("deepspeed")

from tests.harness import deepspeed_engine as H  # noqa: E402
from tests.harness import deepspeed_pipe as P  # noqa: E402
from tests.harness.deepspeed_pipe import DEAD, KINDS, TAG  # noqa: E402



@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds_pipe_reshard")
    P.save(root)
    return root


def test_stage_rule_is_deepspeeds():
    """``partition_balanced`` gives DeepSpeed's own bounds (its tie-break included)."""
    from deepspeed.runtime.utils import partition_balanced as theirs

    from converters.deepspeed.pipe import partition_balanced

    for layers in range(1, 13):
        weights = [0, 0, *[1] * layers, 0, 0]
        for pp in range(1, 8):
            assert partition_balanced(weights, pp) == [int(b) for b in theirs(weights, pp)], (layers, pp)
    assert partition_balanced([3, 1, 4, 1, 5, 9, 2, 6], 3) == [int(b) for b in theirs([3, 1, 4, 1, 5, 9, 2, 6], 3)]


def test_pp1_pp4_and_dp2_load_in_deepspeed_with_the_exact_state(runs, run_cli, tmp_path):
    src = runs / "pipe"
    targets = {"pp1": ("--to-pp", "1"), "pp4": ("--to-pp", "4"), "dp2": ("--to-pp", "1", "--to-dp", "2")}
    for out, args in targets.items():
        res = run_cli("reshard", src, tmp_path / out, *args)
        assert res.code == 0, res.err
    assert f"(TP1/PP2/DP1/ZeRO-1) -> {tmp_path / 'dp2'} (TP1/PP1/DP2/ZeRO-1), deepspeed" in res.out
    P.load(1, [(tmp_path / "pp1", 1, 1, "fp32", tmp_path / "got_pp1")])
    P.load(4, [(tmp_path / "pp4", 4, 1, "fp32", tmp_path / "got_pp4")])
    P.load(2, [(tmp_path / "dp2", 1, 1, "fp32", tmp_path / "got_dp2")])
    truths = P.truths(runs, "pipe")
    source, loss = P.by_name(truths), truths[0]["loss"]
    for out, world, stages, expected in (("pp1", 1, [0], 3 * 52), ("pp4", 4, [0, 1, 2, 3], 3 * 54),
                                         ("dp2", 2, [0, 0], 2 * 3 * 52)):
        got = P.results(tmp_path / f"got_{out}", world)  # PP4's last stage: the tied module again
        assert [g["stage"] for g in got] == stages
        checked = 0
        for g in got:
            assert g["global_steps"] == H.STEPS
            for kind in KINDS:
                for name, value in g["state"][kind].items():
                    assert torch.equal(value, source[kind, name]), (out, g["stage"], kind, name)
                    checked += 1
            assert abs(g["loss"] - loss) / abs(loss) < 1e-5, (out, g["loss"], loss)
        assert checked == expected


def _walk(obj, path=()):
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _walk(value, (*path, key))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _walk(value, (*path, i))


def _tensors(path) -> dict:
    """Every tensor of a torch.save file by its path in the tree, RNG states left out (an
    exact RNG stream cannot survive a topology change: each rank takes a source rank's)."""
    return {p: t for p, t in _walk(torch.load(path, weights_only=False)) if "rng_state" not in p}


def _dead_slice(src_dir, mp: int):
    """Where the last stage's dead position-embedding copy lies in its group-0 partition."""
    ms = torch.load(src_dir / f"mp_rank_{mp:02d}_model_states.pt", weights_only=False)
    groups = ms["param_shapes"] or None
    if groups is None:  # BF16_Optimizer: the slice mappings
        osd = ms["optimizer"]
        start = osd["param_slice_mappings"][0][DEAD].start
        return start, start + osd["param_slice_mappings"][0][DEAD].numel
    offset = 0
    for name, shape in groups[0].items():
        if name == DEAD:
            return offset, offset + shape.numel()
        offset += shape.numel()
    raise AssertionError("no dead copy")


@pytest.mark.parametrize("name", ["pipe", "pipe_bf16"])
@pytest.mark.parametrize("route", [("--to-pp", "1"), ("--to-pp", "4"),
                                   ("--to-tp", "2", "--to-pp", "1", "--true-vocab-size", "203")])
def test_round_trip_is_bit_exact_file_by_file(runs, run_cli, tmp_path, name, route):
    """PP2 -> ``route`` -> TP1/PP2: every tensor of every file equals the source's, but for
    the last stage's dead position-embedding copy, which is then the live one's state. (Back
    from TP2, the padded vocabulary is ambiguous unless the true size is given.)"""
    src = runs / name
    assert run_cli("reshard", src, tmp_path / "there", *route).code == 0
    res = run_cli("reshard", tmp_path / "there", tmp_path / "back", "--to-tp", "1", "--to-pp", "2")
    assert res.code == 0, res.err
    a, b = src / TAG, tmp_path / "back" / TAG
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    lo, hi = _dead_slice(a, 1)
    for f in names:
        x, y = _tensors(a / f), _tensors(b / f)
        assert x.keys() == y.keys(), f
        stage0 = _tensors(b / f.replace("mp_rank_01", "mp_rank_00")) if "mp_rank_01" in f else None
        for path, value in x.items():
            other = y[path]
            assert (value.dtype, value.shape) == (other.dtype, other.shape), (f, path)
            if stage0 is not None and _group0(path):  # the last stage's group 0 holds the dead copy
                assert torch.equal(value[:lo], other[:lo]) and torch.equal(value[hi:], other[hi:]), (f, path)
                assert torch.equal(other[lo:hi], stage0[path][lo:hi]), (f, path)  # the live copy
                continue
            assert torch.equal(value, other), (f, path)


def _group0(path: tuple) -> bool:
    """A flat vector of param group 0 in an optimizer tree (moments or fp32 partition)."""
    return path[-2:] in ((0, "exp_avg"), (0, "exp_avg_sq"), ("single_partition_of_fp32_groups", 0))


def _global(path) -> dict:
    """The canonical global view of a checkpoint, every tensor read through ckptool."""
    from ckptool.checkpoints.open import open_checkpoint
    from ckptool.core.engine import TargetTensor, fill_tensor
    from ckptool.core.regions import Region, Shard

    opened = open_checkpoint(str(path))

    def read_box(piece, dtype, box, out):
        opened.reader.read_box_into(opened.store, piece, dtype, box, out)

    return {k: fill_tensor(TargetTensor(k, Shard.of(Region.whole(k, i.shape)), i.dtype), opened.index,
                           read_box) for k, i in opened.index.tensors.items()}


@pytest.mark.parametrize("name", ["pipe", "pipe_bf16"])
def test_every_target_reads_back_as_the_source(runs, run_cli, tmp_path, name):
    """PP1, PP3 (uneven: 2+1+1 layers), PP4 and TP2: the same global tensors, weights and
    optimizer state, bit for bit; ``verify --deep`` checks every replica (the last stage's
    tied copies, TP-replicated norms)."""
    src = runs / name
    source = _global(src)
    assert any(k.startswith("optimizer.state.fp32_param.") for k in source)
    for i, route in enumerate([("--to-pp", "1"), ("--to-pp", "3"), ("--to-pp", "4"),
                               ("--to-tp", "2"), ("--to-tp", "2", "--to-pp", "4")]):
        out = tmp_path / f"out{i}"
        res = run_cli("reshard", src, out, *route)
        assert res.code == 0, res.err
        res = run_cli("verify", out, "--deep")
        assert res.code == 0, res.out + res.err
        got = _global(out)
        assert got.keys() == source.keys(), route
        assert all(torch.equal(got[k], source[k]) for k in source), route


def test_dead_copy_is_the_live_state(runs, run_cli, tmp_path):
    """PP2 -> PP4: the last stage's tied position embeddings (weights and Adam state) are
    the first stage's."""
    src = runs / "pipe"
    assert run_cli("reshard", src, tmp_path / "pp4", "--to-pp", "4").code == 0
    d = tmp_path / "pp4" / TAG
    first = torch.load(d / "zero_pp_rank_0_mp_rank_00_optim_states.pt", weights_only=False)
    last = torch.load(d / "zero_pp_rank_0_mp_rank_03_optim_states.pt", weights_only=False)
    lo, hi = _dead_slice(d, 3)
    assert (lo, hi) == _dead_slice(d, 0)  # word embeddings, then position embeddings, in both
    for get in (lambda o: o["single_partition_of_fp32_groups"][0],
                lambda o: o["base_optimizer_state"]["state"][0]["exp_avg"],
                lambda o: o["base_optimizer_state"]["state"][0]["exp_avg_sq"]):
        a, b = get(first["optimizer_state_dict"]), get(last["optimizer_state_dict"])
        assert torch.equal(a[:hi], b[:hi])


@pytest.mark.parametrize("args,message", [
    (("--to-pp", "5"), "stage 4 of PP5 would hold no parameter of param group 1 (DeepSpeed's "
                       "partition_method='type:transformer' gives it specs 7-7)"),
    (("--to-zero", "2"), "DeepSpeed runs pipelines at ZeRO-1 (or its BF16_Optimizer); the stage stays 1"),
    (("--to-tp", "3"), "attention heads (4) must be divisible by TP (3)"),
    (("--to-pp", "1", "--drop-optimizer"), "--drop-optimizer cannot apply"),
])
def test_impossible_targets_are_refused_before_writing(runs, run_cli, tmp_path, args, message):
    dst = tmp_path / "out"
    res = run_cli("reshard", runs / "pipe", dst, *args)
    assert res.code == 2, res.err
    assert message in res.err and len(res.err.strip().splitlines()) == 1
    assert not dst.exists() and not list(tmp_path.iterdir())


def test_a_source_off_deepspeeds_partition_is_refused(runs, run_cli, tmp_path):
    """The stage rule is checked against the source's own stages before anything is
    written: a PP2 checkpoint whose stages hold specs DeepSpeed would not give them."""
    import shutil

    copy = tmp_path / "moved"
    shutil.copytree(runs / "pipe", copy)
    for mp in (0, 1):  # each stage's 1-D parameters in another order
        path = copy / TAG / f"mp_rank_{mp:02d}_model_states.pt"
        state = torch.load(path, weights_only=False)
        state["param_shapes"][1] = type(state["param_shapes"][1])(reversed(state["param_shapes"][1].items()))
        torch.save(state, path)
    res = run_cli("reshard", copy, tmp_path / "out", "--to-pp", "1")
    assert res.code == 2, res.err
    assert "stage 0's parameters are not those DeepSpeed's partition_method='type:transformer' " \
           "gives it at PP2 (specs 0-3)" in res.err
    assert not (tmp_path / "out").exists()


def test_round_robin_gradients_pipeline_follows_the_new_dp_size(tmp_path):
    """ZeRO-1 with ``round_robin_gradients`` flattens each stage's groups in an order that
    depends on DP. A PP2xDP2 run resharded to PP2xDP1 and PP1xDP2: DeepSpeed loads each and
    its next step gives the same loss and the same updated weights as the run that went on
    (the weights after the step come from the fp32 masters, so a wrong order would show;
    DeepSpeed 0.19.8's safe_get_full_fp32_param misreads this mode, so the module is compared)."""
    import ckptool

    P.save(tmp_path, runs=[("rr", 1, "rr")], pp=2, dp=2)
    truths = [torch.load(tmp_path / f"rr.rank{r}.truth.pt", weights_only=False) for r in range(4)]
    after = {}
    for truth in truths:  # ranks in stage order: a tied module's live copy is the first stage's
        for name, value in truth["module_after"].items():
            after.setdefault(name, value)
    # DP1 undoes the source's order; PP1 regroups the stages, each reordered for DP2 again
    for out, pp, dp in (("pp2dp1", 2, 1), ("pp1dp2", 1, 2)):
        ckptool.reshard(str(tmp_path / "rr"), str(tmp_path / out), to={"pp": pp, "dp": dp})
        P.load(pp * dp, [(tmp_path / out, pp, 1, "rr", tmp_path / f"got_{out}")])
        for got in P.results(tmp_path / f"got_{out}", pp * dp):
            assert abs(got["loss"] - truths[0]["loss"]) / abs(truths[0]["loss"]) < 1e-5, out
            for name, value in got["module_after"].items():
                if name in after and not (name == DEAD and got["stage"] > 0):
                    assert H.rel({name: value}, {name: after[name]}) < 1e-5, (out, name)
