"""Fault matrix: each fault on a committed checkpoint is detected, exit 1, and named."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptool.checkpoints.open import open_checkpoint
from tests.conftest import sample_state
from tests.harness.damage import flip_bit, patch, truncate


def _data_file(path):
    return sorted(p for p in path.iterdir() if p.name.endswith(".distcp"))[0]


def test_committed_checkpoint_verifies(tmp_path, make_ckpt, run_cli):
    ckpt = make_ckpt(tmp_path / "step_12")
    res = run_cli("verify", ckpt, "--deep")
    assert res.code == 0, res.err
    assert res.out.startswith("OK:") and "committed" in res.out
    report = json.loads(run_cli("verify", ckpt, "--json").out)
    assert report["ok"] is True and report["committed"] is True
    assert report["problems"] == [] and report["bytes_hashed"] > 0


def _flip_byte(path):
    f = _data_file(path)
    f.write_bytes(flip_bit(f.read_bytes()))
    return f


def _truncate(path):
    f = _data_file(path)
    truncate(f, 100)
    return f


def _remove_shard(path):
    f = _data_file(path)
    f.unlink()
    return f


def _remove_metadata(path):
    f = path / ".metadata"
    f.unlink()
    return f


def _remove_manifest(path):
    f = path / "ckptool.json"
    f.unlink()
    return f


FAULTS = {
    "flipped byte": (_flip_byte, "checksum mismatch"),
    "truncated shard": (_truncate, "truncated"),
    "missing shard": (_remove_shard, "missing"),
    "missing .metadata": (_remove_metadata, "missing"),
    "missing manifest": (_remove_manifest, "not committed"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_fault_is_detected_and_names_the_file(tmp_path, make_ckpt, run_cli, fault):
    ckpt = make_ckpt(tmp_path / "step_12")
    damage, words = FAULTS[fault]
    broken = damage(ckpt)
    res = run_cli("verify", ckpt)
    assert res.code == 1, (res.out, res.err)
    assert words in res.out and str(broken) in res.out, res.out
    assert "Traceback" not in res.out + res.err
    report = json.loads(run_cli("verify", ckpt, "--json").out)
    assert report["ok"] is False
    assert any(p["file"] == str(broken) and words in p["message"] for p in report["problems"])


def test_flipped_byte_without_manifest_is_caught_by_deep(tmp_path, run_cli):
    """A foreign checkpoint has no hashes; --deep still notices a damaged archive."""
    path = tmp_path / "foreign"
    dcp.save(sample_state(), checkpoint_id=str(path))
    f = _data_file(path)
    # damage the pickle of the first tensor chunk so that it cannot be read back (objects,
    # which plain verify reads through the unpickler, are left alone)
    opened = open_checkpoint(str(path))
    first = min((p.location.offset for t in opened.index.tensors.values() for p in t.pieces
                 if p.location.file == f.name))
    patch(f, first + 60, b"\xff" * 20)
    assert run_cli("verify", path).code == 0  # structure alone looks fine
    res = run_cli("verify", path, "--deep")
    assert res.code == 1 and str(f) in res.out


def test_extra_file_is_a_warning_or_with_strict_an_error(tmp_path, make_ckpt, run_cli):
    ckpt = make_ckpt(tmp_path / "step_12")
    extra = ckpt / "stray.txt"
    extra.write_text("left by someone")
    res = run_cli("verify", ckpt)
    assert res.code == 0
    assert f"warning: unexpected file, not in the manifest ({extra})" in res.err
    strict = run_cli("verify", ckpt, "--strict")
    assert strict.code == 1 and str(extra) in strict.out


def test_deep_reports_nan_and_inf_with_key_and_count(tmp_path, make_ckpt, run_cli):
    state = sample_state()
    w = state["model"]["layers.0.bias"]
    w[0] = float("nan")
    w[3] = float("nan")
    w[5] = float("inf")
    ckpt = make_ckpt(tmp_path / "nan", state=state)
    assert run_cli("verify", ckpt).code == 0  # hashes are fine: the bytes are as written
    res = run_cli("verify", ckpt, "--deep")
    assert res.code == 1
    assert "tensor holds 2 NaN and 1 Inf values (of 16) (tensor 'model.layers.0.bias')" in res.out


def test_deep_finds_each_chunk_s_own_nan_among_many_of_one_layout(tmp_path, run_cli):
    """torch's DCP writes 60 chunks of one shape as archives of one layout, opened once
    (core.torchfile.ArchiveLayouts): the NaN and Inf of chunks deep in the file are still
    found in those chunks and no other, as each chunk's own bytes."""
    gen = torch.Generator().manual_seed(3)
    state = {f"opt.{i}.exp_avg": torch.randn(64, generator=gen) for i in range(60)}
    state["opt.37.exp_avg"][5] = float("nan")
    state["opt.41.exp_avg"][0] = -float("inf")
    state["opt.41.exp_avg"][63] = float("nan")
    dcp.save(state, checkpoint_id=str(tmp_path / "many"))
    res = run_cli("verify", tmp_path / "many", "--deep", "--json")
    assert res.code == 1
    found = {p["key"]: p["message"] for p in json.loads(res.out)["problems"]}
    assert found == {"opt.37.exp_avg": "tensor holds 1 NaN and 0 Inf values (of 64)",
                     "opt.41.exp_avg": "tensor holds 1 NaN and 1 Inf values (of 64)"}, found


def test_seal_foreign_then_detect_damage(tmp_path, run_cli):
    path = tmp_path / "foreign"
    dcp.save(sample_state(), checkpoint_id=str(path))
    res = run_cli("verify", path)
    assert res.code == 0 and "foreign, unsealed" in res.out
    sealed = run_cli("verify", path, "--seal")
    assert sealed.code == 0 and "sealed now" in sealed.out
    manifest = json.loads((path / "ckptool.json").read_text())
    assert manifest["sealed"] is True and manifest["format"] == "dcp"
    assert {f["path"] for f in manifest["files"]} == {".metadata", "__0_0.distcp"}
    _flip_byte(path)
    assert run_cli("verify", path).code == 1


def test_seal_refuses_an_uncommitted_ckptool_checkpoint(tmp_path, make_ckpt, run_cli):
    ckpt = make_ckpt(tmp_path / "step_12")
    (ckpt / "ckptool.json").unlink()
    res = run_cli("verify", ckpt, "--seal")
    assert res.code == 1 and "not committed" in res.out
    assert not (ckpt / "ckptool.json").exists()


def test_unreadable_input_is_exit_2_one_line(tmp_path, run_cli):
    res = run_cli("verify", tmp_path / "nope")
    assert res.code == 2
    assert res.err.strip() == f"ckptool: error: no such file or directory ({tmp_path / 'nope'})"
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("x")
    res = run_cli("inspect", tmp_path / "junk")
    assert res.code == 2 and len(res.err.strip().splitlines()) == 1
    assert "not a checkpoint ckptool knows: found notes.txt" in res.err


def test_malicious_metadata_is_refused_not_executed(tmp_path, make_ckpt, run_cli):
    import pickle

    ckpt = make_ckpt(tmp_path / "step_12")
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (ckpt / ".metadata").write_bytes(pickle.dumps(Evil()))
    (ckpt / "ckptool.json").unlink()
    res = run_cli("verify", ckpt)
    assert res.code == 1, (res.out, res.err)  # a finding of the report (stdout), not a crash
    assert "pickles a call of posix.system" in res.out and "--trust-pickle" in res.out
    assert not marker.exists()


def test_inspect_reports_topology_iteration_and_sizes(tmp_path, make_ckpt, run_cli):
    ckpt = make_ckpt(tmp_path / "step_12")
    data = json.loads(run_cli("inspect", ckpt, "--json").out)
    assert data["format"] == "dcp" and data["iteration"] == 12 and data["committed"] is True
    assert data["topology"]["tp"] == 1 and data["tensor_count"] == 5
    assert data["bytes_by_dtype"] == {"float32": (96 * 16 + 16 + 16 + 1) * 4, "bfloat16": 16 * 16 * 2}
    assert data["largest"][0]["key"] == "model.embedding.weight"
    assert "optimizer.lr" in data["objects"]
    human = run_cli("inspect", ckpt)
    assert human.code == 0 and "model.embedding.weight" in human.out


def test_verify_on_a_run_root_checks_the_newest(tmp_path, make_ckpt, run_cli):
    make_ckpt(tmp_path / "step_10", iteration=10)
    newest = make_ckpt(tmp_path / "step_20", iteration=20)
    report = json.loads(run_cli("verify", tmp_path, "--json").out)
    assert report["path"] == str(newest)


def test_json_output_is_one_document(tmp_path, make_ckpt, run_cli):
    ckpt = make_ckpt(tmp_path / "step_12")
    _flip_byte(ckpt)
    res = run_cli("verify", ckpt, "--json")
    assert res.code == 1
    json.loads(res.out)  # exactly one JSON document


def test_copy_of_checkpoint_still_verifies(tmp_path, make_ckpt, run_cli):
    """The manifest has relative paths: a moved checkpoint stays valid."""
    ckpt = make_ckpt(tmp_path / "a" / "step_12")
    moved = tmp_path / "b" / "step_12"
    shutil.copytree(ckpt, moved)
    assert run_cli("verify", moved, "--deep").code == 0


def test_api_returns_dataclasses(tmp_path, make_ckpt):
    import ckptool

    ckpt = make_ckpt(tmp_path / "step_12")
    report = ckptool.verify(str(ckpt), deep=True)
    assert isinstance(report, ckptool.VerifyReport) and report.ok and report.pieces_read == 5
    assert torch.Size([96, 16]) == torch.Size(ckptool.inspect(str(ckpt)).largest[0].shape)


def test_reshard_convert_and_load_refuse_an_uncommitted_ckptool_checkpoint(tmp_path, make_ckpt, run_cli):
    """A checkpoint ckptool wrote without its manifest (written last) may be partial: verify
    says "not committed" (exit 1), and reshard, convert and the hook's load refuse it with
    exit 1 before writing anything (they read it as if whole)."""
    import torch

    from ckptool.core.errors import BadCheckpoint
    from training.async_checkpointer import load

    ck = make_ckpt(tmp_path / "step_000012")
    (ck / "ckptool.json").unlink()
    assert run_cli("verify", ck).code == 1
    for argv in (["reshard", ck, tmp_path / "out", "--to-dp", "2"],
                 ["convert", ck, tmp_path / "out", "--to", "deepspeed"]):
        r = run_cli(*argv)
        assert r.code == 1 and "not committed" in r.err, (argv, r.err)
        assert not (tmp_path / "out").exists()
    state = {"w": torch.zeros(1)}
    with pytest.raises(BadCheckpoint, match="not committed"):
        load(str(ck), state)


def _edit_in_place(ckpt, edit, **dump):
    """Edit the parsed manifest and write it back as an editor would: its own checksum is
    left as it was."""
    path = ckpt / "ckptool.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data, **dump))


@pytest.mark.parametrize("field,value", [("iteration", 100), ("format", "hf"),
                                         ("topology", {"tp": 2, "pp": 1, "dp": 1})])
def test_a_manifest_edited_after_commit_is_caught(tmp_path, make_ckpt, run_cli, field, value):
    """The manifest checks itself: an edited step used to verify OK and reorder ``latest``; an
    edited format was exit 2 "file not found (config.json)"."""
    older = make_ckpt(tmp_path / "step_4", iteration=4)
    newer = make_ckpt(tmp_path / "step_8", iteration=8)
    _edit_in_place(older, lambda m: m.update({field: value}))
    res = run_cli("verify", older)
    assert res.code == 1 and "does not match its own checksum" in res.out, (res.out, res.err)
    assert str(older / "ckptool.json") in res.out and "Traceback" not in res.out + res.err
    latest = run_cli("latest", tmp_path)
    assert latest.code == 0 and latest.out.strip() == str(newer), (latest.out, latest.err)


def test_a_manifest_laid_out_again_or_from_before_the_self_checksum_verifies(tmp_path, make_ckpt, run_cli):
    """The self-checksum is over the parsed fields: re-indented or key-reordered JSON (``jq``)
    still verifies; a manifest written before the field existed is read as it is."""
    from ckptool.core.manifest import SELF

    ckpt = make_ckpt(tmp_path / "step_12")
    _edit_in_place(ckpt, lambda m: None, indent=4, sort_keys=True)
    assert run_cli("verify", ckpt).code == 0
    _edit_in_place(ckpt, lambda m: m.pop(SELF))
    assert run_cli("verify", ckpt, "--deep").code == 0


def test_a_failed_verify_says_so_on_stderr_and_in_its_json(tmp_path, make_ckpt, run_cli):
    """Every failed command gives one line on stderr, and with --json a document with "error"
    and "exit_code": a failed verify printed its findings on stdout only, and its document
    had neither field."""
    ckpt = make_ckpt(tmp_path / "step_12")
    broken = _flip_byte(ckpt)
    r = run_cli("verify", ckpt)
    lines = r.err.strip().splitlines()
    assert r.code == 1 and len(lines) == 1 and "fails verification" in lines[0] and str(broken) in lines[0]
    doc = json.loads(run_cli("verify", ckpt, "--json").out)
    assert doc["ok"] is False and doc["exit_code"] == 1 and "checksum mismatch" in doc["error"]
    assert doc["problems"]


def test_a_broken_stdout_is_one_line_and_exit_2(tmp_path, make_ckpt):
    """The reader of stdout gone (``ckptool ... | head -c 10`` when head is done): click ended
    with exit 1 ("the checkpoint is bad") and no word; failure paths printed a traceback."""
    import subprocess
    import sys
    from pathlib import Path

    ckpt = make_ckpt(tmp_path / "step_12")
    repo = Path(__file__).resolve().parents[1]
    for args in (["inspect", str(ckpt), "--json"], ["inspect", str(tmp_path / "missing"), "--json"]):
        read, write = os.pipe()
        os.close(read)
        p = subprocess.run([sys.executable, "-m", "ckptool", *args], stdout=write, stderr=subprocess.PIPE,
                           cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)}, timeout=120)
        os.close(write)
        err = p.stderr.decode()
        assert p.returncode == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("args", [["inspect", ".", "--bogus"], ["verify", ".", "--workers", "0"],
                                  ["convert", "a", "b", "--to", "bogus"]])
def test_a_usage_error_is_one_line(args, run_cli):
    """click's own errors printed its usage block (four lines) on stderr."""
    r = run_cli(*args)
    lines = r.err.strip().splitlines()
    assert r.code == 2 and len(lines) == 1 and lines[0].startswith("ckptool: error: ") and "--help" in lines[0], r.err


@pytest.mark.parametrize("flags", [["--to-tp", "1", "--tp", "2"], ["--to-dp=2", "--to-dp", "3"]])
def test_one_target_axis_given_twice_is_refused(flags, tmp_path, make_ckpt, run_cli):
    """`--to-tp 4 --tp 8` (meaning "from 8 to 4", backwards) was a silent TP8 copy, exit 0."""
    src = make_ckpt(tmp_path / "src")
    r = run_cli("reshard", src, tmp_path / "dst", *flags)
    assert r.code == 2 and "is given twice" in r.err and not (tmp_path / "dst").exists(), r.err
