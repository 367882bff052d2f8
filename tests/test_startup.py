"""The commands a restart script runs on every job start import no torch for committed
checkpoints (``ckptool latest``, ``verify`` without ``--deep``, ``inspect``), and give the
same verdicts and output as with torch loaded. Timings live in ``benchmarks/startup.py``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

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

    manifest = json.loads((bad / MANIFEST).read_text())  # recommitted: the hashes match again
    size, digest = hash_files(Store.open(str(bad)), [".metadata"])[".metadata"]
    for entry in manifest["files"]:
        if entry["path"] == ".metadata":
            entry.update(size=size, xxh3_128=digest)
    (bad / MANIFEST).write_text(json.dumps(manifest))
    for preload in (False, True):
        script = ("import torch\n" if preload else "") + _RUN.format(argv=["verify", str(bad)])
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert "TORCH" in proc.stderr and proc.stderr.split("TORCH")[-1].split()[1] == "1"
        assert "tensor has no dtype" in proc.stdout, proc.stdout
