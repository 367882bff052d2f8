"""The DCP reader against checkpoints written by plain torch.distributed.checkpoint."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptool.checkpoints.open import open_checkpoint
from ckptool.core.safe_pickle import Unsafe
from tests.conftest import assembled, spawn_gloo

SHAPES = {"col": (10, 6), "row": (8, 9), "grid": (7, 5), "rep": (4,), "scalar": ()}


def global_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    out = {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}
    out["half"] = torch.randn(6, 4, generator=g).to(torch.bfloat16)
    return out


def _save_dtensors(rank, world, path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh1 = init_device_mesh("cpu", (world,))
    mesh2 = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    t = global_tensors()
    state = {
        "model": {
            "col": distribute_tensor(t["col"], mesh1, [Shard(0)]),  # 10 rows over 4: uneven
            "row": distribute_tensor(t["row"], mesh1, [Shard(1)]),  # 9 cols over 4: uneven
            "grid": distribute_tensor(t["grid"], mesh2, [Shard(0), Shard(1)]),
            "rep": distribute_tensor(t["rep"], mesh1, [Replicate()]),
            "half": distribute_tensor(t["half"], mesh2, [Replicate(), Shard(0)]),
        },
        "scalar": t["scalar"],
        "extra": {"step": 42, "note": "hello", "sched": {"lr": [1e-3, 5e-4]}},
        f"rank_rng_{rank}": {"seed": rank},
    }
    dcp.save(state, checkpoint_id=path)


@pytest.fixture(scope="module")
def dtensor_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("dcp") / "ckpt"
    spawn_gloo(_save_dtensors, 4, str(path))
    return path


def test_reads_every_global_tensor_of_a_4_rank_dtensor_save(dtensor_ckpt):
    opened = open_checkpoint(str(dtensor_ckpt))
    t = global_tensors()
    assert opened.format == "dcp" and not opened.index.written_by_ckptool
    expected = {f"model.{k}": t[k] for k in ("col", "row", "grid", "rep", "half")}
    expected["scalar"] = t["scalar"]
    assert set(opened.index.tensors) == set(expected)
    for key, want in expected.items():
        got = assembled(opened, key)
        assert got.dtype == want.dtype and torch.equal(got, want), key
    # the uneven Shard(0) of 10 rows over 4 ranks: 3, 3, 3, 1
    rows = sorted(p.region.lengths[0] for p in opened.index.tensors["model.col"].pieces)
    assert rows == [1, 3, 3, 3]
    assert len(opened.index.tensors["model.grid"].pieces) == 4


def test_reads_non_tensor_entries(dtensor_ckpt):
    opened = open_checkpoint(str(dtensor_ckpt))
    objects = {k: opened.reader.read_object(opened.store, o) for k, o in opened.index.objects.items()}
    assert objects["extra.step"] == 42
    assert objects["extra.note"] == "hello"
    assert objects["extra.sched.lr"] == [1e-3, 5e-4]
    assert {objects[f"rank_rng_{r}.seed"] for r in range(4)} == {0, 1, 2, 3}


def test_verify_deep_passes_on_plain_dcp_and_reports_unsealed(dtensor_ckpt, run_cli):
    res = run_cli("verify", dtensor_ckpt, "--deep")
    assert res.code == 0, res.err
    assert "foreign, unsealed" in res.out


class Custom:  # a class outside the allowlist
    def __init__(self):
        self.value = 3


def test_objects_of_unknown_classes_are_refused_not_imported(tmp_path):
    path = tmp_path / "c"
    dcp.save({"w": torch.ones(3), "custom": Custom()}, checkpoint_id=str(path))
    opened = open_checkpoint(str(path))
    value = opened.reader.read_object(opened.store, opened.index.objects["custom"])
    assert isinstance(value, Unsafe) and value.qualified_name == f"{Custom.__module__}.Custom"
    (found,) = opened.reader.unsafe_pickles()
    assert (found.key, found.name) == ("custom", f"{Custom.__module__}.Custom")


def test_reads_safetensors_serialization(tmp_path):
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    path = tmp_path / "st"
    state = {"a": torch.arange(12.0).reshape(3, 4), "b": torch.arange(5, dtype=torch.int64)}
    dcp.save(state, storage_writer=FileSystemWriter(
        str(path), serialization_format=SerializationFormat.SAFETENSORS))
    opened = open_checkpoint(str(path))
    for key, want in state.items():
        assert torch.equal(assembled(opened, key), want)


def test_index_sizes_match_metadata(dtensor_ckpt):
    opened = open_checkpoint(str(dtensor_ckpt))
    for info in opened.index.tensors.values():
        assert sum(p.region.numel for p in info.pieces) >= math.prod(info.shape)


def test_reshard_regroups_a_4_rank_dcp_for_2_ranks(dtensor_ckpt, tmp_path, run_cli):
    """Each target rank gets one file; plain torch DCP loads the result exactly."""
    dst = tmp_path / "dp2"
    res = run_cli("reshard", dtensor_ckpt, dst, "--dp", 4, "--to-dp", 2)
    assert res.code == 0, res.err
    assert sorted(p.name for p in dst.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp",
                                                     "ckptool.json"]
    t = global_tensors()
    state = {"model": {k: torch.zeros_like(t[k]) for k in ("col", "row", "grid", "rep", "half")},
             "scalar": torch.zeros(()), "extra": {"step": 0, "note": "", "sched": {"lr": []}}}
    dcp.load(state, checkpoint_id=str(dst))
    for k in ("col", "row", "grid", "rep", "half"):
        assert torch.equal(state["model"][k], t[k]), k
    assert torch.equal(state["scalar"], t["scalar"])
    assert state["extra"] == {"step": 42, "note": "hello", "sched": {"lr": [1e-3, 5e-4]}}
    report = run_cli("verify", dst, "--deep")
    assert report.code == 0 and "committed" in report.out
    # the 10-row tensor: rows 0-4 in rank 0's file, 5-9 in rank 1's
    opened = open_checkpoint(str(dst))
    pieces = sorted((p.region.offsets, p.location.file) for p in opened.index.tensors["model.col"].pieces)
    assert pieces == [((0, 0), "__0_0.distcp"), ((5, 0), "__1_0.distcp")]


def test_storage_paths_with_a_dot_segment_read_as_the_files_they_name(tmp_path, run_cli):
    """A ``.metadata`` whose storage entries say ``./__0_0.distcp`` (torch opens it: it joins the
    path) names the file ``__0_0.distcp``: verify reported that file as missing, and the one
    there as not named."""
    import pickle

    src = tmp_path / "dcp"
    state = global_tensors()
    dcp.save(state, checkpoint_id=str(src))
    meta = pickle.loads((src / ".metadata").read_bytes())
    for info in meta.storage_data.values():
        info.relative_path = "./" + info.relative_path
    (src / ".metadata").write_bytes(pickle.dumps(meta))
    loaded = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(loaded, checkpoint_id=str(src))  # what torch does with it
    res = run_cli("verify", src, "--deep")
    assert res.code == 0 and "missing" not in res.out + res.err, (res.out, res.err)
    out = tmp_path / "out"
    assert run_cli("convert", src, out, "--to", "dcp").code == 0
    again = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(again, checkpoint_id=str(out))
    for key, value in state.items():
        assert torch.equal(again[key], value) and torch.equal(loaded[key], value), key


def test_a_plain_dcp_save_without_a_model_says_what_gives_one(tmp_path, run_cli):
    """A plain DCP save of a model's state dict records no model: converting it to Hugging Face
    or Megatron is refused, and the hint no longer sends the user to --model-config, which a
    DCP source refuses in turn."""
    src = tmp_path / "dcp"
    dcp.save({"model.embed_tokens.weight": torch.randn(8, 4)}, checkpoint_id=str(src))
    for to in ("hf", "megatron"):
        r = run_cli("convert", src, tmp_path / to, "--to", to)
        assert r.code == 2 and "does not say what model it holds" in r.err, r.err
        assert "cannot take --model-config" in r.err and "Pass --model-config" not in r.err, r.err
    r = run_cli("convert", src, tmp_path / "hf", "--to", "hf", "--model-config", tmp_path / "c.json")
    assert r.code == 2 and "--model-config does not apply to dcp input" in r.err, r.err
