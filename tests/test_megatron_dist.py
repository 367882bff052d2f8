"""Megatron-Core torch_dist checkpoints written by real megatron-core: read as the same
canonical tensors as the legacy checkpoint of the same model."""

from __future__ import annotations

import json

import pytest

from ckptool.core import optimizer as canon  # noqa: E402
from tests.conftest import full_tensor, peer
import torch

peer("megatron.core")

from ckptool.checkpoints.open import open_checkpoint  # noqa: E402
from tests.harness import mcore as H  # noqa: E402


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    base = tmp_path_factory.mktemp("dist")
    H.save_real(H.LLAMA, 2, base / "legacy")
    H.save_dist(H.LLAMA, 2, base / "dist")
    return base / "legacy", base / "dist"


@pytest.fixture(scope="module")
def reference_logits(both):
    legacy, _ = both
    return torch.load(legacy.parent / f"{legacy.name}.logits.pt")


def test_torch_dist_reads_as_the_same_canonical_tensors(both):
    legacy, dist = (open_checkpoint(str(p)) for p in both)
    assert dist.format == "megatron-dist" and legacy.format == "megatron"
    assert set(dist.index.tensors) == set(legacy.index.tensors)
    for key in legacy.index.tensors:
        assert torch.equal(full_tensor(dist, key), full_tensor(legacy, key)), key
    assert dist.index.iteration == 10 and dist.index.topology.tp == 2


def test_inspect_and_deep_verify_torch_dist(both, run_cli):
    _, dist = both
    data = json.loads(run_cli("inspect", dist, "--json").out)
    assert data["format"] == "megatron-dist" and data["tensor_count"] == 27
    assert data["topology"]["tp"] == 2
    res = run_cli("verify", dist, "--deep")
    assert res.code == 0, res.out + res.err
    # fc1 of a stacked layer is [gate; up]: four pieces per layer at TP2
    fc1 = next(t for t in data["largest"] if t["key"].endswith("linear_fc1.weight"))
    assert fc1["shape"] == [96, 32] and fc1["pieces"] == 4


def test_convert_torch_dist_to_legacy_megatron_at_new_tp_pp(both, reference_logits, tmp_path, run_cli):
    _, dist = both
    dst = tmp_path / "legacy-tp1pp2"
    res = run_cli("convert", dist, dst, "--to", "megatron", "--tp", 1, "--pp", 2,
                  "--true-vocab-size", 1000)
    assert res.code == 0, res.err
    assert "converted:" in res.out and "(TP2/PP1/DP1) ->" in res.out
    assert "note: the source has no RNG state: each rank gets the one a fresh Megatron-LM start" in res.out
    got = H.load_logits(H.LLAMA, 1, 2, dst)  # the output holds rng_state: no --no-load-rng
    assert (got - reference_logits).abs().max().item() < 1e-5


def test_convert_rejects_unknown_format(both, tmp_path, run_cli):
    _, dist = both
    res = run_cli("convert", dist, tmp_path / "x", "--to", "onnx")
    assert res.code == 2 and "'onnx' is not a format; use one of dcp, megatron-dist" in res.err


def test_convert_legacy_to_torch_dist_loads_in_megatron_core(both, reference_logits, tmp_path, run_cli):
    legacy, _ = both
    dst = tmp_path / "dist-tp1"
    res = run_cli("convert", legacy, dst, "--to", "megatron-dist", "--tp", 1, "--true-vocab-size", 1000)
    assert res.code == 0, res.err
    got = H.load_dist_logits(H.LLAMA, 1, dst)
    assert (got - reference_logits).abs().max().item() < 1e-5
    assert run_cli("verify", dst, "--deep").code == 0


def test_reshard_torch_dist_tp2_to_tp4(both, reference_logits, tmp_path, run_cli):
    _, dist = both
    dst = tmp_path / "dist-tp4"
    res = run_cli("reshard", dist, dst, "--to-tp", 4, "--true-vocab-size", 1000)
    assert res.code == 0, res.err
    files = sorted(p.name for p in (dst / "iter_0000010").iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp",
                     "common.pt", "metadata.json"]  # one file per target rank
    got = H.load_dist_logits(H.LLAMA, 4, dst)
    assert (got - reference_logits).abs().max().item() < 1e-5


def test_convert_to_megatron_with_te_names(both, tmp_path, run_cli):
    _, dist = both
    dst = tmp_path / "te"
    res = run_cli("convert", dist, dst, "--to", "megatron", "--megatron-names", "mcore-te",
                  "--true-vocab-size", 1000)
    assert res.code == 0, res.err
    rank0 = torch.load(dst / "iter_0000010" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in rank0["model"]
    # whatever the names, the canonical tensors are the same bits
    out, src = open_checkpoint(str(dst)), open_checkpoint(str(dist))
    for key in src.index.tensors:
        assert torch.equal(full_tensor(out, key), full_tensor(src, key)), key


def test_legacy_names_refuse_gqa_before_writing(both, tmp_path, run_cli):
    _, dist = both
    dst = tmp_path / "legacy"
    res = run_cli("convert", dist, dst, "--to", "megatron", "--megatron-names", "legacy",
                  "--true-vocab-size", 1000)
    assert res.code == 2 and "cannot express grouped-query attention" in res.err
    assert not dst.exists()


# ------------------------------------------------- the non-distributed optimizer's state

from converters.megatron import optimizer as optim  # noqa: E402
from converters.schemas.megatron import to_canonical  # noqa: E402

KINDS = ("exp_avg", "exp_avg_sq")


@pytest.fixture(scope="module")
def trained_dist(tmp_path_factory):
    """Megatron-Core's own FP32Optimizer: 2 steps at TP2, then dist_checkpointing.save of the
    model's and the optimizer's sharded state dicts; the uninterrupted third step."""
    root = tmp_path_factory.mktemp("optim-dist") / "src"
    return root, H.train_and_save_dist(H.LLAMA, 2, root)


@pytest.fixture(scope="module")
def trained_legacy(tmp_path_factory):
    """The same training, saved in the legacy layout (torch AdamW over Megatron's groups)."""
    root = tmp_path_factory.mktemp("optim-legacy") / "src"
    return root, H.train_and_save(H.LLAMA, 2, root)


def _common_optimizer(root):
    return H.load_common(root)["optimizer"]


def _same_common_optimizer(a, b):
    """common.pt's optimizer entries are equal (tensors by value, bit for bit)."""
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            _same_common_optimizer(a[k], b[k])
        elif isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def _loaded_equals_source(loaded: dict, source, kinds=KINDS):
    """What mcore loaded at TP1 (local names = whole tensors) is the source's canonical
    optimizer state, bit for bit; and every parameter has it."""
    for name, state in loaded.items():
        canonical, _ = to_canonical("mcore-local", name, range(H.LLAMA["num_layers"]), False)
        for kind in kinds:
            assert torch.equal(state[kind], full_tensor(source, canon.state_key(kind, canonical))), (name, kind)
        assert float(state["step"]) == 2.0


def _resumed_like_uninterrupted(resumed, after, tol=1e-5):
    assert abs(resumed["loss"] - after["loss"]) / abs(after["loss"]) < tol
    assert (resumed["logits"] - after["logits"]).abs().max().item() < 1e-4


def test_torch_dist_optimizer_reads_as_the_legacy_canonical_state(trained_dist):
    src, _ = trained_dist
    opened = open_checkpoint(str(src))
    index = opened.index
    params = [k for k in index.tensors if not k.startswith("optimizer.")]
    assert len(params) == 27 and index.unmapped is None
    assert {k for k in index.tensors if k.startswith("optimizer.")} == \
        {canon.state_key(kind, p) for p in params for kind in KINDS}
    layout = index.layout(optim.Layout)  # the same record as the legacy reader's
    assert layout.fp16 is False and layout.step == 2.0 and layout.extra == {}
    assert [g["wd_mult"] for g in layout.hyper] == [1.0, 0.0]
    assert "common.optimizer" not in index.objects


def test_reshard_torch_dist_with_optimizer_resumes_exactly_at_tp1(trained_dist, tmp_path, run_cli):
    """Megatron-LM's resume path (dist_checkpointing.load of the model's and the optimizer's
    sharded state dicts, load_state_dict) at the new TP: the moments are the source's bit for
    bit, and the next step is the uninterrupted run's."""
    src, after = trained_dist
    dst = tmp_path / "tp1"
    res = run_cli("reshard", src, dst, "--to-tp", 1, "--true-vocab-size", 1000)
    assert res.code == 0, res.err
    assert "left out" not in res.out
    _same_common_optimizer(_common_optimizer(dst), _common_optimizer(src))
    resumed = H.resume_one_step_dist(H.LLAMA, 1, dst)
    _resumed_like_uninterrupted(resumed, after)
    _loaded_equals_source(resumed["optimizer"][0], open_checkpoint(str(src)))


def test_torch_dist_optimizer_to_legacy_and_back(trained_dist, tmp_path, run_cli):
    src, after = trained_dist
    legacy, back = tmp_path / "legacy-tp1", tmp_path / "dist-tp2"
    res = run_cli("convert", src, legacy, "--to", "megatron", "--tp", 1, "--true-vocab-size", 1000)
    assert res.code == 0, res.err
    _resumed_like_uninterrupted(H.resume_one_step(H.LLAMA, 1, legacy), after)
    assert run_cli("convert", legacy, back, "--to", "megatron-dist", "--tp", 2).code == 0
    _same_common_optimizer(_common_optimizer(back), _common_optimizer(src))
    a, b = open_checkpoint(str(src)), open_checkpoint(str(back))
    assert set(a.index.tensors) == set(b.index.tensors)
    for key in a.index.tensors:
        assert torch.equal(full_tensor(a, key), full_tensor(b, key)), key


def test_legacy_to_torch_dist_to_legacy_is_bit_exact_for_the_optimizer(trained_legacy, tmp_path,
                                                                       run_cli):
    src, _ = trained_legacy
    mid, back = tmp_path / "dist-tp1", tmp_path / "legacy-tp2"
    assert run_cli("convert", src, mid, "--to", "megatron-dist", "--tp", 1,
                   "--true-vocab-size", 1000).code == 0
    assert run_cli("convert", mid, back, "--to", "megatron", "--tp", 2).code == 0
    for f in sorted(src.rglob("model_optim_rng.pt")):
        a = torch.load(f, weights_only=False)["optimizer"]
        b = torch.load(back / f.relative_to(src), weights_only=False)["optimizer"]
        assert a["param_groups"] == b["param_groups"]
        assert a["state"].keys() == b["state"].keys()
        for i, state in a["state"].items():
            assert state.keys() == b["state"][i].keys()
            for kind, value in state.items():
                assert value.dtype == b["state"][i][kind].dtype
                assert torch.equal(value, b["state"][i][kind]), (f, i, kind)


def test_legacy_optimizer_to_torch_dist_resumes_in_megatron_core(trained_legacy, tmp_path, run_cli):
    src, after = trained_legacy
    dst = tmp_path / "dist-tp1"
    res = run_cli("convert", src, dst, "--to", "megatron-dist", "--tp", 1, "--true-vocab-size", 1000)
    assert res.code == 0, res.err
    common = _common_optimizer(dst)
    assert set(common) == {"state", "param_groups"} and float(common["state"]["common_step"]) == 2.0
    resumed = H.resume_one_step_dist(H.LLAMA, 1, dst)
    _resumed_like_uninterrupted(resumed, after)
    _loaded_equals_source(resumed["optimizer"][0], open_checkpoint(str(src)))


@pytest.mark.slow  # ~60 s: its own bf16 training at TP2 and a resume at TP1
def test_bf16_fp32_masters_reshard_and_resume(tmp_path, run_cli):
    """Float16OptimizerWithFloat16Params (bf16 model, fp32 masters): fp32_param travels too."""
    src = tmp_path / "src"
    after = H.train_and_save_dist(H.LLAMA, 2, src, bf16=True)
    opened = open_checkpoint(str(src))
    assert opened.index.layout(optim.Layout).fp16 is True
    dst = tmp_path / "tp1"
    assert run_cli("reshard", src, dst, "--to-tp", 1, "--true-vocab-size", 1000).code == 0
    _same_common_optimizer(_common_optimizer(dst), _common_optimizer(src))
    resumed = H.resume_one_step_dist(H.LLAMA, 1, dst, bf16=True)
    _loaded_equals_source(resumed["optimizer"][0], opened, canon.KINDS)
    # bf16 matmuls at TP1 round differently from TP2's: the loss agrees to bf16 precision
    assert abs(resumed["loss"] - after["loss"]) / abs(after["loss"]) < 1e-3


def test_distributed_optimizer_state_is_refused_with_the_reason(trained_dist, tmp_path, run_cli):
    import shutil

    src, _ = trained_dist
    distopt = tmp_path / "distopt"
    shutil.copytree(src, distopt)
    common_pt = distopt / "iter_0000002" / "common.pt"
    common = torch.load(common_pt, weights_only=False)
    common["optimizer"] = {"param_state_sharding_type": "fully_sharded_model_space",
                           "optimizer": common["optimizer"]}
    torch.save(common, common_pt)
    dst = tmp_path / "out"
    res = run_cli("reshard", distopt, dst, "--to-tp", 1, "--true-vocab-size", 1000)
    assert res.code == 2 and not dst.exists() and "Traceback" not in res.err
    assert ("the optimizer state cannot be carried: Megatron-Core's deprecated "
            "'fully_sharded_model_space' distributed-optimizer state (flattened ShardedTensors, "
            "which megatron-core 0.16 itself neither saves nor loads) is not read") in res.err
    assert "--drop-optimizer" in res.err
    res = run_cli("reshard", distopt, dst, "--to-tp", 1, "--true-vocab-size", 1000, "--drop-optimizer")
    assert res.code == 0, res.err
    assert "optimizer" not in torch.load(dst / "iter_0000002" / "common.pt", weights_only=False)
    assert not any(k.startswith("optimizer.") for k in open_checkpoint(str(dst)).index.tensors)


def test_writer_refuses_optimizer_state_it_cannot_lay_out():
    """Optimizer tensors with no Megatron param groups and step (another format's) are not
    written to torch_dist; a distributed optimizer's (distrib_optim.pt or torch_dist) are,
    see tests/test_megatron_dist_distopt.py."""
    from converters.megatron import distopt
    from converters.megatron.dist import MegatronDistWriter
    from ckptool.core.index import CheckpointIndex, TensorInfo

    index = CheckpointIndex("deepspeed", "/ckpt")
    index.tensors["optimizer.state.exp_avg.output_layer.weight"] = TensorInfo(
        "optimizer.state.exp_avg.output_layer.weight", (4, 2), torch.float32)
    assert MegatronDistWriter().unsupported_state(index) == (
        "the deepspeed source's optimizer state is not a Megatron optimizer's (no param groups "
        "and step to write into common.pt)")
    index.set_layout(distopt.Meta({}, {}))
    assert MegatronDistWriter().unsupported_state(index) is None
    index.unmapped = "the reader's own reason"
    assert MegatronDistWriter().unsupported_state(index) == "the reader's own reason"
