"""Format detection for all six formats, on the directory layouts each framework writes."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp

import converters
from ckptool.core.storage import Store


def touch(path, data: bytes = b"x"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def megatron_legacy(root):
    touch(root / "latest_checkpointed_iteration.txt", b"200")
    for tp in range(2):
        for pp in range(2):
            touch(root / "iter_0000200" / f"mp_rank_{tp:02d}_{pp:03d}" / "model_optim_rng.pt")
    return root


def megatron_legacy_iter_dir(root):
    touch(root / "mp_rank_00" / "model_optim_rng.pt")
    return root


def megatron_dist(root):
    touch(root / "latest_checkpointed_iteration.txt", b"100")
    it = root / "iter_0000100"
    touch(it / "metadata.json", json.dumps({"sharded_backend": "torch_dist",
                                            "sharded_backend_version": 1}).encode())
    touch(it / ".metadata")
    touch(it / "common.pt")
    return root


def deepspeed(root):
    touch(root / "latest", b"global_step10")
    touch(root / "global_step10" / "mp_rank_00_model_states.pt")
    touch(root / "global_step10" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")
    return root


def hf_trainer_deepspeed(root):
    """HF Trainer: config.json and model.safetensors beside `latest` and global_stepN/."""
    deepspeed(root)
    touch(root / "config.json", b"{}")
    touch(root / "model.safetensors")
    return root


def deepspeed_universal(root):
    touch(root / "latest_universal", b"global_step10_universal")
    u = root / "global_step10_universal"
    touch(u / "mp_rank_00_model_states.pt")
    touch(u / "zero" / "embed.weight" / "fp32.pt")
    return root


def hf(root):
    touch(root / "config.json", b'{"architectures": ["LlamaForCausalLM"]}')
    touch(root / "model.safetensors.index.json", b"{}")
    touch(root / "model-00001-of-00002.safetensors")
    return root


def plain_dcp(root):
    dcp.save({"w": torch.ones(2)}, checkpoint_id=str(root))
    return root


LAYOUTS = {
    "megatron": [megatron_legacy, megatron_legacy_iter_dir],
    "megatron-dist": [megatron_dist],
    "deepspeed": [deepspeed, hf_trainer_deepspeed],
    "deepspeed-universal": [deepspeed_universal],
    "hf": [hf],
    "dcp": [plain_dcp],
}


@pytest.mark.parametrize("fmt,build", [(f, b) for f, bs in LAYOUTS.items() for b in bs],
                         ids=lambda x: getattr(x, "__name__", x))
def test_detects(tmp_path, fmt, build):
    root = build(tmp_path / "ckpt")
    assert converters.detect(Store.open(str(root))) == fmt


def test_unknown_directory_lists_what_was_found(tmp_path, run_cli):
    touch(tmp_path / "x" / "weights.npz")
    touch(tmp_path / "x" / "sub" / "a")
    res = run_cli("inspect", tmp_path / "x")
    assert res.code == 2
    assert res.err.strip().startswith(
        f"ckptool: error: not a checkpoint ckptool knows: found sub/, weights.npz ({tmp_path / 'x'})")
    assert "Expected one of dcp, megatron-dist, megatron, deepspeed, deepspeed-universal, hf" in res.err


@pytest.mark.parametrize("build,damaged", [
    (megatron_legacy, "iter_0000200/mp_rank_00_000/model_optim_rng.pt"),
    (deepspeed, "global_step10/mp_rank_00_model_states.pt"),
    (deepspeed_universal, "global_step10_universal/mp_rank_00_model_states.pt")])
def test_damaged_rank_file_is_a_bad_checkpoint(tmp_path, run_cli, build, damaged):
    root = build(tmp_path / "ckpt")
    res = run_cli("inspect", root)
    assert res.code == 1
    assert "not a readable torch.save archive" in res.err
    assert damaged in res.err
    assert "Traceback" not in res.err


def test_an_incomplete_hf_checkpoint_is_one_clear_line(tmp_path, run_cli):
    res = run_cli("inspect", hf(tmp_path / "ckpt"))
    assert res.code == 2 and "config.json lacks a llama field" in res.err
    assert "Traceback" not in res.err and len(res.err.strip().splitlines()) == 1


def test_each_writer_variant_serves_its_sources_and_the_format_its_own():
    """The registry's variants (DeepSpeed's pipeline and HF-model writers) are Writers of
    their format, chosen by the typed layout records of the source only."""
    from ckptool.core.index import CheckpointIndex, Writer
    from converters.deepspeed.from_hf import HfModelWriter
    from converters.deepspeed.pipe import PipeLayers, PipeLayout, PipelineWriter
    from converters.deepspeed.zero import Layout
    from converters.schemas.hf import HfModel

    for fmt, paths in converters.VARIANTS.items():
        for path in paths:
            cls = converters._load(path)
            assert issubclass(cls, Writer) and cls.name == fmt, path
    plain = CheckpointIndex("deepspeed", "/ckpt")
    assert type(converters.writer("deepspeed", plain)) is converters.writer_class("deepspeed")
    pipe = CheckpointIndex("deepspeed", "/ckpt")
    pipe.set_layout(PipeLayout(PipeLayers(0, 2, None), "global_step1", {}))
    assert type(converters.writer("deepspeed", pipe)) is PipelineWriter
    hf = CheckpointIndex("hf", "/ckpt")
    hf.set_layout(HfModel({"model_type": "llama"}, "llama"))
    assert type(converters.writer("deepspeed", hf)) is HfModelWriter
    copy = hf.copy()
    copy.drop_layout(HfModel)  # a copy's records are its own
    assert hf.layout(HfModel) is not None and copy.layout(HfModel) is None
    engine = hf.copy()
    engine.set_layout(Layout("t", 1, False, False, [], [], {}, [], {}, {}, {}, [], []))
    assert type(converters.writer("deepspeed", engine)) is converters.writer_class("deepspeed")
