"""Megatron-Core torch_dist checkpoints written by real megatron-core: read as the same
canonical tensors as the legacy checkpoint of the same model."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("megatron.core")

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
