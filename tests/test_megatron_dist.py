"""Megatron-Core torch_dist checkpoints written by real megatron-core: read as the same
canonical tensors as the legacy checkpoint of the same model."""

from __future__ import annotations

import json

import pytest

from tests.conftest import peer
import torch

peer("megatron.core")

from ckptool.checkpoint import open_checkpoint  # noqa: E402
from ckptool.core.engine import TargetTensor, fill_tensor  # noqa: E402
from ckptool.core.regions import Region, Shard  # noqa: E402
from tests import mcore_harness as H  # noqa: E402


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


def _full(opened, key):
    info = opened.index.tensors[key]
    t = TargetTensor(key, Shard.of(Region.whole(key, info.shape)), info.dtype)
    return fill_tensor(t, opened.index,
                       lambda p, d, b, out: opened.reader.read_box_into(opened.store, p, d, b, out))


def test_torch_dist_reads_as_the_same_canonical_tensors(both):
    legacy, dist = (open_checkpoint(str(p)) for p in both)
    assert dist.format == "megatron-dist" and legacy.format == "megatron"
    assert set(dist.index.tensors) == set(legacy.index.tensors)
    for key in legacy.index.tensors:
        assert torch.equal(_full(dist, key), _full(legacy, key)), key
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
    assert "note: the source has no RNG state, so none is written" in res.out
    got = H.load_logits(H.LLAMA, 1, 2, dst, no_rng=True)
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
        assert torch.equal(_full(out, key), _full(src, key)), key


def test_legacy_names_refuse_gqa_before_writing(both, tmp_path, run_cli):
    _, dist = both
    dst = tmp_path / "legacy"
    res = run_cli("convert", dist, dst, "--to", "megatron", "--megatron-names", "legacy",
                  "--true-vocab-size", 1000)
    assert res.code == 2 and "cannot express grouped-query attention" in res.err
    assert not dst.exists()
