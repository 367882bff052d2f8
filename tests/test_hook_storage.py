"""The hook on fsspec storage that fails for real: a filesystem with a byte quota raises
ENOSPC in the middle of a write, as a full parallel filesystem does."""

from __future__ import annotations

import errno

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFile, MemoryFileSystem


class QuotaFileSystem(MemoryFileSystem):
    """An in-memory filesystem (its own namespace) that holds at most ``quota`` bytes."""

    protocol = "quota"
    store: dict = {}
    pseudo_dirs = [""]
    quota = 1 << 62

    def used(self) -> int:
        return sum(len(f.getbuffer()) for f in self.store.values() if isinstance(f, MemoryFile))

    def _open(self, path, mode="rb", **kwargs):
        f = super()._open(path, mode, **kwargs)
        if "w" in mode or "a" in mode:
            fs, write = self, f.write

            def checked(data):
                if fs.used() + len(data) > fs.quota:
                    raise OSError(errno.ENOSPC, "No space left on device", path)
                return write(data)

            f.write = checked
        return f


@pytest.fixture
def quota_fs():
    fsspec.register_implementation("quota", QuotaFileSystem, clobber=True)
    QuotaFileSystem.store.clear()
    QuotaFileSystem.pseudo_dirs[:] = [""]
    QuotaFileSystem.quota = 1 << 62
    yield QuotaFileSystem
    QuotaFileSystem.store.clear()


def _state(scale: float) -> dict:
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(256, 256, generator=g) * scale, "b": torch.randn(256, generator=g),
            "step": int(scale)}


def test_a_full_disk_fails_the_save_and_commits_nothing(quota_fs, run_cli):
    from training import AsyncCheckpointer

    ckpt = AsyncCheckpointer("quota://run", keep_last=2)
    ckpt.save(1, _state(1.0))
    ckpt.wait()
    assert run_cli("latest", "quota://run").out.strip().endswith("step_00000001")
    quota_fs.quota = quota_fs().used() + 100_000  # room for less than half a checkpoint
    ckpt.save(2, _state(2.0))  # returns at once: the failure is in the background
    with pytest.raises(OSError, match="No space left on device"):
        ckpt.wait()
    # Nothing of step 2 is committed; the newest good checkpoint is still there and loads.
    r = run_cli("latest", "quota://run")
    assert r.code == 0 and r.out.strip().endswith("step_00000001"), (r.out, r.err)
    assert not any("step_00000002" in p and p.endswith("ckptool.json")
                   for p in quota_fs.store)
    state = {"w": torch.zeros(256, 256), "b": torch.zeros(256), "step": 0}
    assert AsyncCheckpointer("quota://run").load_latest(state) == 1
    assert torch.equal(state["w"], _state(1.0)["w"]) and state["step"] == 1
    # With space again, the next save commits.
    quota_fs.quota = 1 << 62
    ckpt.save(3, _state(3.0))
    ckpt.wait()
    assert run_cli("latest", "quota://run").out.strip().endswith("step_00000003")
    assert run_cli("verify", "--deep", "quota://run/step_00000003").code == 0


def test_a_failed_save_raises_on_the_next_save_too(quota_fs):
    from training import AsyncCheckpointer

    quota_fs.quota = 50_000
    ckpt = AsyncCheckpointer("quota://run2")
    ckpt.save(1, _state(1.0))
    with pytest.raises(OSError, match="No space left on device"):
        ckpt.save(2, _state(2.0))  # the second save waits for the first and raises its error


def test_process_writer_saves_loads_and_reports_errors(tmp_path, run_cli):
    """writer="process": a persistent writer process writes from shared-memory staging."""
    from training import AsyncCheckpointer

    ckpt = AsyncCheckpointer(tmp_path / "run", keep_last=2, writer="process")
    try:
        for step in (1, 2, 3):
            ckpt.save(step, _state(float(step)))
        ckpt.wait()
        assert ckpt._writer._proc.is_alive()  # one persistent process for every save
    finally:
        ckpt.close()
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["step_00000002", "step_00000003"]
    assert run_cli("verify", "--deep", tmp_path / "run" / "step_00000003").code == 0
    state = {"w": torch.zeros(256, 256), "b": torch.zeros(256), "step": 0}
    assert AsyncCheckpointer(tmp_path / "run").load_latest(state) == 3
    assert torch.equal(state["w"], _state(3.0)["w"])
    # A failure in the writer process surfaces on wait(), and nothing is committed.
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    bad = AsyncCheckpointer(blocker / "run", writer="process")
    try:
        bad.save(1, _state(1.0))
        with pytest.raises(OSError, match="not committed"):
            bad.wait()
    finally:
        bad.close()
