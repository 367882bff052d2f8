"""Reshard beyond one process and one uninterrupted run: `torchrun -m ckptool reshard`
splits the target files across ranks and equals the single-process output byte for byte;
a reshard killed halfway and re-run keeps the finished files (hashes checked) and redoes
less than half of the work, with identical output."""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[1]


def _source(path: Path, mb_per_tensor: int = 2, n: int = 16) -> Path:
    from converters import dcp

    g = torch.Generator().manual_seed(1)
    rows = mb_per_tensor * (1 << 20) // 4 // 256
    dcp.save({f"layers.{i}.w": torch.randn(rows, 256, generator=g) for i in range(n)},
             str(path), iteration=7, topology={"tp": 1, "pp": 1, "dp": 1})
    return path


def _files(root: Path) -> dict[str, bytes]:
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != "ckptool.json":
            out[str(p.relative_to(root))] = p.read_bytes()
    return out


def _manifest_files(root: Path) -> list:
    return json.loads((root / "ckptool.json").read_text())["files"]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return _source(tmp_path_factory.mktemp("scale") / "src")


def test_torchrun_reshard_equals_single_process_byte_for_byte(source, tmp_path, run_cli):
    single = tmp_path / "single"
    assert run_cli("reshard", source, single, "--to-dp", "5").code == 0
    multi = tmp_path / "multi"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
         "127.0.0.1", "--master_port", str(free_port()), "-m", "ckptool", "reshard", str(source),
         str(multi), "--to-dp", "5"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("resharded:") == 1  # rank 0 reports, once
    assert _files(multi) == _files(single)
    assert _manifest_files(multi) == _manifest_files(single)
    assert run_cli("verify", "--deep", multi).code == 0


SLOW_FS = '''
import time, fsspec
from fsspec.implementations.local import LocalFileSystem
class SlowFS(LocalFileSystem):
    """Local files that take 0.25 s to close after writing: a slow parallel filesystem."""
    protocol = "slowfile"
    def _open(self, path, mode="rb", **kw):
        f = super()._open(path, mode, **kw)
        if "w" in mode and path.endswith(".distcp"):
            close = f.close
            def slow_close():
                time.sleep(0.25)
                close()
            f.close = slow_close
        return f
fsspec.register_implementation("slowfile", SlowFS, clobber=True)
from ckptool.cli import main
main()
'''


def _slow_reshard(src: Path, dst: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SLOW_FS, "reshard", str(src), f"slowfile://{dst}",
                             "--to-dp", "16", "--workers", "1"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def test_a_killed_reshard_resumes_and_redoes_less_than_half(source, tmp_path, run_cli):
    whole = tmp_path / "whole"
    assert run_cli("reshard", source, whole, "--to-dp", "16").code == 0
    dst = tmp_path / "resumed"
    proc = _slow_reshard(source, dst)
    deadline = time.time() + 120
    done = 0
    while time.time() < deadline and proc.poll() is None:
        journals = list(tmp_path.glob("resumed.tmp-*/.ckptool-done*"))
        done = sum(len(j.read_text().splitlines()) for j in journals)
        if done >= 9:
            os.killpg(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.02)
    proc.wait()
    assert done >= 9 and proc.returncode == -signal.SIGKILL, (done, proc.returncode)
    assert not dst.exists()
    r = run_cli("latest", tmp_path)
    assert "resumed" not in r.out  # the partial output is never a checkpoint
    # Re-run with the same arguments: the finished files are kept, the rest is redone.
    rerun = subprocess.run([sys.executable, "-c", SLOW_FS, "reshard", str(source),
                            f"slowfile://{dst}", "--to-dp", "16", "--workers", "1", "--json"],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    res = json.loads(rerun.stdout)
    redone = len(res["files"]) - res["reused_files"]
    assert res["reused_files"] >= 9 and redone < len(res["files"]) / 2, res["reused_files"]
    assert _files(dst) == _files(whole)
    assert _manifest_files(dst) == _manifest_files(whole)
    assert not list(tmp_path.glob("resumed.tmp-*"))
    assert run_cli("verify", "--deep", dst).code == 0


def _killed_after_a_file(src: Path, dst: Path) -> list[Path]:
    """A slow reshard of ``src`` to ``dst`` killed once it journals a finished file; the journals."""
    proc = _slow_reshard(src, dst)
    journals = f"{dst.name}.tmp-*/.ckptool-done*"
    while proc.poll() is None and not list(dst.parent.glob(journals)):
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return list(dst.parent.glob(journals))


def test_a_rerun_with_other_arguments_does_not_reuse(source, tmp_path, run_cli):
    dst = tmp_path / "out"
    _killed_after_a_file(source, dst)
    r = run_cli("reshard", source, dst, "--to-dp", "8", "--json")  # another target
    assert r.code == 0 and json.loads(r.out)["reused_files"] == 0


def _file_size_cap(limit: int):
    def cap():  # the kernel then refuses a write past `limit` bytes (EFBIG), as a full disk would
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return cap


def test_a_write_the_storage_refuses_keeps_the_finished_files_for_a_rerun(source, tmp_path, run_cli):
    """A full disk or quota (here: the kernel's file-size limit, EFBIG) is one line naming the
    file, what is kept and how to go on, exit 2, no DST; the re-run keeps the finished files."""
    whole = tmp_path / "whole"
    assert run_cli("reshard", source, whole, "--to-dp", "5").code == 0
    limit = max(p.stat().st_size for p in whole.glob("*.distcp")) - 1
    dst = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "ckptool", "reshard", str(source), str(dst), "--to-dp",
                        "5", "--workers", "1"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, preexec_fn=_file_size_cap(limit))
    err = r.stderr.strip()
    assert r.returncode == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "refused a write: File too large" in err and ".distcp)" in err and "re-run" in err, err
    kept, planned = map(int, re.search(r"(\d+) of (\d+) target files are finished", err).groups())
    assert planned == 5 and kept == sum(len(j.read_text().splitlines())
                                        for j in tmp_path.glob("out.tmp-*/.ckptool-done*"))
    assert not dst.exists() and len(list(tmp_path.glob("out.tmp-*"))) == 1
    rerun = run_cli("reshard", source, dst, "--to-dp", "5", "--json")
    assert rerun.code == 0 and json.loads(rerun.out)["reused_files"] == kept
    assert _files(dst) == _files(whole)
    assert _manifest_files(dst) == _manifest_files(whole)


def test_overwrite_keeps_the_old_destination_until_the_new_one_commits(source, tmp_path, run_cli):
    """--overwrite replaces DST at the commit: a run that fails (here a write the storage
    refuses) leaves the old checkpoint whole; one that succeeds leaves no trace of it."""
    dst = tmp_path / "out"
    assert run_cli("reshard", source, dst, "--to-dp", "2").code == 0
    old = _files(dst)
    limit = max(p.stat().st_size for p in dst.glob("*.distcp")) // 2
    r = subprocess.run([sys.executable, "-m", "ckptool", "reshard", str(source), str(dst), "--to-dp",
                        "3", "--overwrite"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       preexec_fn=_file_size_cap(limit))
    assert r.returncode == 2 and "refused a write" in r.stderr, r.stderr
    assert _files(dst) == old and run_cli("verify", dst).code == 0
    assert run_cli("reshard", source, dst, "--to-dp", "3", "--overwrite").code == 0
    assert len(list(dst.glob("*.distcp"))) == 3 and run_cli("verify", "--deep", dst).code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # nothing left aside


@pytest.mark.parametrize("where", ["same", "inside", "holds", "via-symlink"])
def test_a_destination_that_overlaps_the_source_is_refused(where, source, tmp_path, run_cli):
    """Writing where the source is (itself, inside it, or a directory holding it, with
    --overwrite) would delete or mix into what is being read: refused, nothing touched."""
    run = tmp_path / "run"
    src = run / "step_7"
    src.parent.mkdir()
    shutil.copytree(source, src)
    (tmp_path / "link").symlink_to(run)
    before = _files(tmp_path)
    dst = {"same": src, "inside": src / "resharded", "holds": run,
           "via-symlink": tmp_path / "link" / "step_7" / ".." / "step_7"}[where]
    for cmd in (["reshard", src, dst, "--to-dp", "2"], ["reshard", run, dst, "--to-dp", "2", "--dry-run"],
                ["convert", src, dst, "--to", "megatron"]):
        r = run_cli(*cmd, "--overwrite")
        assert r.code == 2 and len(r.err.strip().splitlines()) == 1, r.err
        assert "the destination " in r.err and "source" in r.err, r.err
    assert _files(tmp_path) == before and not list(tmp_path.rglob("*.tmp-*"))


def test_a_destination_that_cannot_be_made_is_one_line(source, tmp_path, run_cli):
    (tmp_path / "a-file").write_text("not a directory")
    r = run_cli("reshard", source, tmp_path / "a-file" / "out", "--to-dp", "2")
    assert r.code == 2 and len(r.err.strip().splitlines()) == 1, r.err
    assert "cannot create the destination" in r.err and "a-file" in r.err, r.err


def test_no_fsync_leaves_the_write_back_to_the_kernel_and_writes_the_same_bytes(source, tmp_path,
                                                                               run_cli, monkeypatch):
    """--no-fsync (as cp and DCP's sync_files=False): not one fsync, nor an early write-back,
    on the output; the same files and a manifest that verifies. By default every output file,
    the manifest and the directories are fsynced."""
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")),
                                                 real_fsync(fd))[1])
    monkeypatch.setattr(os, "posix_fadvise", lambda *a: synced.append("fadvise"))
    fast = tmp_path / "fast"
    assert run_cli("reshard", source, fast, "--to-dp", "5", "--no-fsync", "--workers", "2").code == 0
    assert synced == []
    durable = tmp_path / "durable"
    assert run_cli("reshard", source, durable, "--to-dp", "5", "--workers", "2").code == 0
    data = {p for p in synced if p != "fadvise" and ".distcp" in p}
    assert len(data) == len([f for f in _files(durable) if f.endswith(".distcp")]) > 1
    assert any(p.endswith("ckptool.json") or "ckptool.json.tmp" in p for p in synced)
    assert str(tmp_path) in synced  # the rename into place is made durable too
    assert _files(fast) == _files(durable)
    assert run_cli("verify", "--deep", fast).code == 0


@pytest.fixture(scope="module")
def megatron_source(tmp_path_factory):
    from benchmarks.reshard import make_source
    from ckptool.core.layout import ModelSpec
    from ckptool.core.topology import Topology

    spec = ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=500,
                     ffn_hidden_size=256, tied_embeddings=False, max_position_embeddings=32)
    src = tmp_path_factory.mktemp("spans") / "src"
    make_source(src, spec, Topology(tp=4, pp=2))
    return src


def test_source_runs_stream_by_in_kernel_copy_with_the_same_bytes(megatron_source, tmp_path, run_cli,
                                                                  monkeypatch):
    """Target tensors that are runs of source files (column-parallel merges, whole tensors
    moved between stages) are copied by copy_file_range; where the kernel refuses, through
    a buffer; without the path at all, filled in memory. All three give the same bytes."""
    import ckptool.core.engine as engine

    copied = []
    real_copy = os.copy_file_range
    monkeypatch.setattr(os, "copy_file_range", lambda *a: copied.append(a[2]) or real_copy(*a))
    args = ("--to-tp", "2", "--to-pp", "4", "--workers", "2")
    assert run_cli("reshard", megatron_source, tmp_path / "copied", *args).code == 0
    total = sum(f.stat().st_size for f in (tmp_path / "copied").rglob("*.pt"))
    assert sum(copied) > total / 2  # most of the bytes never passed through user memory

    import mmap

    def unmappable(*a, **k):
        raise OSError(19, "No such device")  # a filesystem that cannot map: hashed by reads
    with monkeypatch.context() as m:
        m.setattr(mmap, "mmap", unmappable)
        assert run_cli("reshard", megatron_source, tmp_path / "read-hashed", *args).code == 0
    assert _files(tmp_path / "read-hashed") == _files(tmp_path / "copied")
    assert run_cli("verify", "--deep", tmp_path / "read-hashed").code == 0

    def refuse(*a):
        raise OSError(18, "Invalid cross-device link")
    monkeypatch.setattr(os, "copy_file_range", refuse)
    assert run_cli("reshard", megatron_source, tmp_path / "buffered", *args).code == 0
    monkeypatch.setattr(os, "copy_file_range", lambda *a: 0)  # some filesystems copy nothing
    assert run_cli("reshard", megatron_source, tmp_path / "nothing", *args).code == 0
    assert _files(tmp_path / "nothing") == _files(tmp_path / "buffered")

    monkeypatch.setattr(engine, "file_spans", lambda *a: None)
    assert run_cli("reshard", megatron_source, tmp_path / "filled", *args).code == 0
    assert _files(tmp_path / "copied") == _files(tmp_path / "filled") == _files(tmp_path / "buffered")
    assert run_cli("verify", "--deep", tmp_path / "copied").code == 0


def test_a_truncated_source_is_reported_not_copied(megatron_source, tmp_path, run_cli):
    """A rank file cut short is an error with one line and no output, on the copy path too."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(megatron_source, src)
    f = sorted(src.rglob("model_optim_rng.pt"))[0]
    data = f.read_bytes()
    f.write_bytes(data[:len(data) // 2] + data[-22:])  # keep the zip's end record: a cut, not garbage
    r = run_cli("reshard", src, tmp_path / "out", "--to-tp", "2", "--to-pp", "4")
    assert r.code in (1, 2) and len(r.err.strip().splitlines()) == 1, r.err
    assert not (tmp_path / "out").exists()


def test_a_failed_fsync_is_an_error_and_nothing_is_committed(megatron_source, tmp_path, run_cli,
                                                             monkeypatch):
    """EIO from fsync means the bytes may not be on disk: the reshard fails with one line,
    DST does not appear, and the file is not journaled as done (a re-run rewrites it). A
    descriptor that cannot be synced (EINVAL) is no error."""
    import errno

    real_fsync = os.fsync

    def failing(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".pt"):
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)
    monkeypatch.setattr(os, "fsync", failing)
    r = run_cli("reshard", megatron_source, tmp_path / "out", "--to-tp", "2", "--to-pp", "4")
    assert r.code == 2 and "Input/output error" in r.err and len(r.err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()
    journaled = "".join(p.read_text() for p in tmp_path.glob("out.tmp-*/.ckptool-done*"))
    assert ".pt" not in journaled

    def unsyncable(fd):
        raise OSError(errno.EINVAL, "Invalid argument")
    monkeypatch.setattr(os, "fsync", unsyncable)
    assert run_cli("reshard", megatron_source, tmp_path / "ok", "--to-tp", "2", "--to-pp", "4").code == 0


def test_every_new_directory_is_fsynced_before_the_commit(megatron_source, tmp_path, run_cli,
                                                          monkeypatch):
    """A rank file's directory entry lives in its own new directory (iter_*/mp_rank_*): each
    of them is fsynced, not only the output's root, before the rename makes it visible."""
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")),
                                                 real_fsync(fd))[1])
    out = tmp_path / "out"
    assert run_cli("reshard", megatron_source, out, "--to-tp", "2", "--to-pp", "4").code == 0
    nested = {str(d.relative_to(out)) for d in out.rglob("*") if d.is_dir()}
    assert len(nested) > 4  # iter_0000100 and its mp_rank_* directories
    assert all(any(p.endswith("/" + d) and ".tmp-" in p for p in synced) for d in nested)
    assert any(p.endswith("/latest_checkpointed_iteration.txt") for p in synced)  # small files too


def test_a_foreign_source_saved_again_before_the_rerun_is_another_job(tmp_path, run_cli):
    """A source without a manifest (plain torch DCP here; Megatron, DeepSpeed) that its job
    saved again, in place and at the same sizes, between a killed reshard and its re-run: the
    re-run kept the target files written from the old values (7 of 10 in a Megatron run), exit
    0, verify OK. Its key now covers each source file's size and modification time."""
    import torch.distributed.checkpoint as tdcp

    def save(seed: int) -> dict:
        g = torch.Generator().manual_seed(seed)
        state = {f"layers.{i}.w": torch.randn(2048, 256, generator=g) for i in range(16)}
        tdcp.save(state, checkpoint_id=str(src))
        return state

    src = tmp_path / "src"
    save(1)
    dst = tmp_path / "out"
    assert _killed_after_a_file(src, dst)
    time.sleep(0.01)  # a later modification time, even on a coarse clock
    state = save(2)
    r = run_cli("reshard", src, dst, "--to-dp", "16", "--workers", "1", "--json")
    assert r.code == 0 and json.loads(r.out)["reused_files"] == 0, r.out
    loaded = {k: torch.zeros_like(v) for k, v in state.items()}
    tdcp.load(loaded, checkpoint_id=str(dst))
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


def _damaged_copy(source: Path, to: Path) -> Path:
    """A copy of ``source`` with one bit flipped in its largest data file: every piece still
    reads (the engine would copy it), only the hash tells."""
    from ckptool.checkpoints.open import open_checkpoint
    from tests.harness.damage import patch

    shutil.copytree(source, to)
    largest = max((p for p in to.iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)
    piece = next(p for t in open_checkpoint(str(to)).index.tensors.values() for p in t.pieces
                 if p.location.file == largest.name)
    at = piece.location.offset + piece.location.length // 2  # inside the tensor's bytes
    patch(largest, at, bytes([largest.read_bytes()[at] ^ 0x01]))
    return largest


def test_a_source_that_does_not_match_its_manifest_is_refused_not_resealed(source, tmp_path, run_cli):
    """A reshard of a checkpoint damaged on the disk would seal the damage under a fresh,
    valid manifest: the source's files are hashed against its manifest while the output is
    written, and a mismatch fails the command (exit 1) with nothing committed.
    ``--no-verify-source`` trusts the source (the output then verifies: the damage is in it)."""
    src = tmp_path / "src"
    damaged = _damaged_copy(source, src)
    for argv in (["reshard", src, tmp_path / "dst", "--to-dp", "3"],
                 ["convert", src, tmp_path / "dst", "--to", "dcp", "--dp", "3"]):
        r = run_cli(*argv)
        assert r.code == 1, (argv, r.err)
        assert damaged.name in r.err and "does not match the source's manifest" in r.err, r.err
        assert "Traceback" not in r.err and len(r.err.strip().splitlines()) == 1, r.err
        assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no DST, no DST.tmp-*
    r = run_cli("reshard", src, tmp_path / "trusted", "--to-dp", "3", "--no-verify-source")
    assert r.code == 0, r.err
    assert run_cli("verify", tmp_path / "trusted").code == 0


def test_torchrun_ranks_all_fail_when_one_rank_finds_the_source_damaged(source, tmp_path):
    """Each rank hashes its share of the source's files; the rank that finds the damage tells
    the others, so every rank exits 1 (none hangs in the commit) and nothing is committed."""
    src = tmp_path / "src"
    _damaged_copy(source, src)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
         "127.0.0.1", "--master_port", str(free_port()), "-m", "ckptool", "reshard", str(src),
         str(tmp_path / "dst"), "--to-dp", "5"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode != 0
    assert proc.stderr.count("does not match the source's manifest") == 2, proc.stderr[-4000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
