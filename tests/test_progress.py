"""Long metadata steps say how far they are on stderr (after a second; here after none), and
only when a command turned it on: --quiet keeps stderr clean, the library is silent."""

from __future__ import annotations

import io
import subprocess
import sys

import torch

from ckptool.core import progress

_RUN = """
import sys
from ckptool.core import progress
progress._DELAY = progress._LOG_EVERY = 0.0
sys.argv = ["ckptool", *{argv!r}]
from ckptool.cli import main
try:
    main()
except SystemExit:
    pass
"""


def _cli(*argv) -> str:
    proc = subprocess.run([sys.executable, "-c", _RUN.format(argv=[str(a) for a in argv])],
                          capture_output=True, text=True, timeout=120)
    return proc.stderr


def test_a_step_logs_lines_with_its_fraction_once_enabled(monkeypatch):
    monkeypatch.setattr(progress, "_DELAY", 0.0)
    monkeypatch.setattr(progress, "_LOG_EVERY", 0.0)
    progress.disable()  # an in-process CLI call of another test may have left it on
    with progress.step("silent", 10, "chunks") as s:  # not enabled: nothing, anywhere
        s.advance(5)
    out = io.StringIO()
    progress.enable(out)
    try:
        with progress.step("reading .metadata", 2_000_000, "B") as s:
            s.advance(1_000_000)
        with progress.step("planning the target files") as s:  # no count: a heartbeat
            import time
            time.sleep(0.05)
    finally:
        progress.disable()
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("ckptool: reading .metadata: 50% (1.0 MB of 2.0 MB, "), lines
    assert any(line.startswith("ckptool: planning the target files (") for line in lines), lines


def test_inspect_and_dry_run_report_their_steps_and_quiet_silences_them(tmp_path):
    import torch.distributed.checkpoint as dcp

    src = tmp_path / "dcp"
    dcp.save({f"w{i}": torch.randn(4, 4) for i in range(8)}, checkpoint_id=str(src))
    err = _cli("inspect", src)
    assert "ckptool: reading .metadata: " in err and "ckptool: indexing tensors: " in err, err
    err = _cli("reshard", src, tmp_path / "out", "--to-dp", "2", "--dry-run")
    assert "ckptool: planning the target files (" in err, err
    assert _cli("inspect", src, "--quiet") == ""


def test_reshard_and_verify_at_a_terminal_show_a_bar_and_finish(tmp_path, make_ckpt):
    """stderr a terminal: tqdm's bar of unknown total has no truth value, and `if bar:` raised
    TypeError: every interactive `ckptool reshard` exited 2 and wrote nothing."""
    import os
    import pty
    import subprocess
    import sys
    from pathlib import Path

    src = make_ckpt(tmp_path / "src")
    repo = Path(__file__).resolve().parents[1]
    for args in (["reshard", str(src), str(tmp_path / "out"), "--to-dp", "2"],
                 ["convert", str(src), str(tmp_path / "conv"), "--to", "dcp", "--dp", "2"],
                 ["verify", "--deep", str(src)]):
        leader, follower = pty.openpty()
        proc = subprocess.run([sys.executable, "-m", "ckptool", *args], cwd=repo, stdout=subprocess.PIPE,
                              stderr=follower, env={**os.environ, "PYTHONPATH": str(repo)}, timeout=120)
        os.close(follower)
        err = b""
        try:
            while chunk := os.read(leader, 65536):
                err += chunk
        except OSError:  # the terminal's other end is closed
            pass
        os.close(leader)
        assert proc.returncode == 0, (args, err.decode(errors="replace")[-2000:])
        assert b"Traceback" not in err
    assert (tmp_path / "out" / "ckptool.json").exists()
