"""The commands a restart script runs on every job start import no torch for committed
checkpoints (``ckptool latest``, ``verify`` without ``--deep``, ``inspect``), and give the
same verdicts and output as with torch loaded. Timings live in ``benchmarks/startup.py``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.harness.damage import edit_manifest

_RUN = """
import sys
sys.argv = ["ckptool", *{argv!r}]
from ckptool.cli import main
code = 0
try:
    main()
except SystemExit as exc:
    code = exc.code or 0
print("TORCH", "torch" in sys.modules, code, file=sys.stderr)
"""


def _run(*argv: str, preload_torch: bool = False) -> tuple[str, bool, int]:
    script = ("import torch\n" if preload_torch else "") + _RUN.format(argv=[str(a) for a in argv])
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    last = [line for line in proc.stderr.splitlines() if line.startswith("TORCH ")][-1].split()
    return proc.stdout, last[1] == "True", int(last[2])


@pytest.fixture(scope="module")
def run_root(tmp_path_factory):
    from training import AsyncCheckpointer

    root = tmp_path_factory.mktemp("startup") / "run"
    ckpt = AsyncCheckpointer(str(root), keep_last=3)
    state = {"model": {f"w{i}": torch.randn(8, 8) for i in range(5)},
             "bf16": torch.randn(4, 4).to(torch.bfloat16), "step": 0}
    for step in (1, 2, 3):
        state["step"] = step
        ckpt.save(step, state)
    ckpt.wait()
    ckpt.close()
    return root


@pytest.mark.parametrize("command", ["latest", "verify", "inspect"])
def test_light_commands_import_no_torch_and_say_the_same(run_root, command):
    target = run_root if command != "verify" else sorted(run_root.glob("step_*"))[-1]
    light, imported, code = _run(command, target, "--json")
    assert code == 0 and not imported, (command, code)
    full, imported, code = _run(command, target, "--json", preload_torch=True)
    assert code == 0 and imported
    drop = {"seconds"}
    assert {k: v for k, v in json.loads(light).items() if k not in drop} == \
        {k: v for k, v in json.loads(full).items() if k not in drop}


def test_a_command_in_process_leaves_the_collector_as_it_was(run_root, capsys):
    """A command freezes what it builds (its index is never collected again) and thaws it when
    it ends: ``main`` runs inside other processes (tests, a training job's tooling), whose
    objects must not stay out of the collector's reach."""
    import gc

    from ckptool.cli import main

    gc.collect()
    assert gc.get_freeze_count() == 0 and gc.isenabled()
    with pytest.raises(SystemExit) as done:
        main(["verify", str(sorted(run_root.glob("step_*"))[-1])])
    assert done.value.code == 0
    main(["inspect", str(run_root)])
    assert gc.get_freeze_count() == 0 and gc.isenabled()


def test_light_verify_still_finds_a_flipped_byte(run_root, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(sorted(run_root.glob("step_*"))[-1], bad)
    data = next(bad.glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(raw)
    out, _, code = _run("verify", bad)
    assert code == 1 and "FAILED" in out


def test_a_layout_where_a_dtype_belongs_is_refused_without_torch_too(run_root, tmp_path):
    """The light unpickler reads torch's names as names: a pickle naming ``torch.strided`` (a
    layout, the global torch itself never pickles for one) as a tensor's dtype is "no dtype"
    (one line, exit 1), as with torch, never a traceback."""
    import pickle
    import shutil

    from torch.distributed.checkpoint import FileSystemReader

    bad = tmp_path / "bad"
    shutil.copytree(sorted(run_root.glob("step_*"))[-1], bad)
    data = pickle.dumps(FileSystemReader(str(bad)).read_metadata())
    assert b"\x8c\x07float32" in data  # the dtype global's name, same length as the layout's
    (bad / ".metadata").write_bytes(data.replace(b"\x8c\x07float32", b"\x8c\x07strided"))
    from ckptool.core.manifest import MANIFEST, hash_files
    from ckptool.core.storage import Store

    size, digest = hash_files(Store.open(str(bad)), [".metadata"])[".metadata"]

    def recommit(manifest):  # the hashes match again
        for entry in manifest["files"]:
            if entry["path"] == ".metadata":
                entry.update(size=size, xxh3_128=digest)
    edit_manifest(bad / MANIFEST, recommit)
    for preload in (False, True):
        script = ("import torch\n" if preload else "") + _RUN.format(argv=["verify", str(bad)])
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert "TORCH" in proc.stderr and proc.stderr.split("TORCH")[-1].split()[1] == "1"
        assert "tensor has no dtype" in proc.stdout, proc.stdout


def _nan_checkpoints(tmp_path):
    """A checkpoint of the hook and one of torch's own DCP writer, each with NaN and Inf in
    fp32, bf16 and fp16 tensors beside a clean one and an integer tensor (chunks start at
    any byte of their files: the scan reads them aligned)."""
    import torch.distributed.checkpoint as dcp

    from training import AsyncCheckpointer

    gen = torch.Generator().manual_seed(0)
    state = {"a": torch.randn(300, 7, generator=gen), "b": torch.randn(5000, generator=gen).bfloat16(),
             "h": torch.randn(999, generator=gen).half(), "n": torch.arange(77),
             "clean": torch.randn(64, 3, generator=gen), "step": 3}
    state["a"][17, 3] = float("nan")
    state["a"][299, 6] = -float("inf")
    state["b"][4999] = float("nan")
    state["b"][0] = float("inf")
    state["b"][1234] = -float("nan")
    state["h"][500] = float("inf")
    ckpt = AsyncCheckpointer(str(tmp_path / "run"), keep_last=1)
    ckpt.save(3, state)
    ckpt.wait()
    ckpt.close()
    dcp.save(state, checkpoint_id=str(tmp_path / "foreign"))
    return sorted((tmp_path / "run").glob("step_*"))[-1], tmp_path / "foreign"


def test_deep_verify_counts_nan_and_inf_without_torch_as_torch_does(tmp_path):
    """``verify --deep`` scans the stored bytes as it hashes them, without torch: the
    findings equal those of the same command with torch loaded, and of torch's counts.
    (Telling a foreign checkpoint's format asks every reader, some of which import torch.)"""
    ours, foreign = _nan_checkpoints(tmp_path)
    for path in (ours, foreign):
        light, imported, code = _run("verify", "--deep", path, "--json")
        assert code == 1 and (path == foreign or not imported), (path, code)
        full, imported, code = _run("verify", "--deep", path, "--json", preload_torch=True)
        assert code == 1 and imported
        report = json.loads(light)
        assert report == json.loads(full)
        found = {p["key"]: p["message"] for p in report["problems"]}
        assert found == {"a": "tensor holds 1 NaN and 1 Inf values (of 2100)",
                         "b": "tensor holds 2 NaN and 1 Inf values (of 5000)",
                         "h": "tensor holds 0 NaN and 1 Inf values (of 999)"}, (path, found)
        assert report["pieces_read"] == 5


def test_deep_verify_reads_pieces_it_cannot_scan_in_place_through_torch(tmp_path):
    """Chunks of DCP's safetensors serialization are not plain bytes at a known offset of a
    torch.save record: the scan cannot read them as it hashes, so ``verify --deep`` loads torch
    after the pass and reads them as tensors. The findings equal those of a process that had
    torch from the start."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    path = tmp_path / "st"
    state = {"a": torch.randn(40, 3), "b": torch.randn(100).bfloat16(), "n": torch.arange(5)}
    state["a"][7, 1] = float("nan")
    state["b"][99] = -float("inf")
    dcp.save(state, storage_writer=FileSystemWriter(
        str(path), serialization_format=SerializationFormat.SAFETENSORS))
    light, imported, code = _run("verify", "--deep", path, "--json")
    assert code == 1 and imported
    full, _, code = _run("verify", "--deep", path, "--json", preload_torch=True)
    assert code == 1 and json.loads(light) == json.loads(full)
    report = json.loads(light)
    assert {p["key"]: p["message"] for p in report["problems"]} == {
        "a": "tensor holds 1 NaN and 0 Inf values (of 120)",
        "b": "tensor holds 0 NaN and 1 Inf values (of 100)"}
    assert report["pieces_read"] == 3
