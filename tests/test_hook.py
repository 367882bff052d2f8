"""AsyncCheckpointer: a 4-process gloo job saves DTensor state; plain DCP loads it on 2."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tests.conftest import spawn_gloo


def _globals():
    g = torch.Generator().manual_seed(5)
    return {"w": torch.randn(10, 6, generator=g), "v": torch.randn(7, 4, generator=g),
            "b": torch.randn(6, generator=g)}


def _save(rank, world, root):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from training import AsyncCheckpointer

    mesh = init_device_mesh("cpu", (2, world // 2))
    t = _globals()
    ckpt = AsyncCheckpointer(root, keep_last=2, topology={"tp": world // 2, "pp": 1, "dp": 2})
    for step in (10, 20, 30):
        scale = float(step)
        state = {"model": {"w": distribute_tensor(t["w"] * scale, mesh, [Replicate(), Shard(0)]),
                           "v": distribute_tensor(t["v"] * scale, mesh, [Shard(0), Shard(1)]),
                           "b": t["b"] * scale},
                 "step": step, "sched": {"lr": [1e-3 * step]}}
        ckpt.save(step, state)
    ckpt.wait()


def _load(rank, world, root, out):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from training import AsyncCheckpointer

    mesh = init_device_mesh("cpu", (world,))
    t = _globals()
    state = {"model": {"w": distribute_tensor(torch.zeros_like(t["w"]), mesh, [Shard(1)]),
                       "v": distribute_tensor(torch.zeros_like(t["v"]), mesh, [Replicate()]),
                       "b": torch.zeros_like(t["b"])},
             "step": 0, "sched": {"lr": []}}
    step = AsyncCheckpointer(root).load_latest(state)
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state["model"].items()}
    if rank == 0:
        torch.save({"step": step, "model": full, "state_step": state["step"], "sched": state["sched"]}, out)
    dist.barrier()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("hook") / "run"
    spawn_gloo(_save, 4, str(root))
    return root


def test_four_rank_async_saves_commit_and_retain(saved, run_cli):
    names = sorted(p.name for p in saved.iterdir())
    assert names == ["step_00000020", "step_00000030"]  # keep_last=2, no .tmp- left behind
    newest = saved / "step_00000030"
    assert sorted(p.name for p in newest.iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp", "ckptool.json"]
    res = run_cli("verify", newest, "--deep")
    assert res.code == 0 and "committed" in res.out, res.out + res.err
    manifest = json.loads((newest / "ckptool.json").read_text())
    assert manifest["iteration"] == 30 and manifest["topology"]["dp"] == 2
    assert run_cli("latest", saved).out.strip() == str(newest)


def test_two_rank_job_loads_other_placements_exactly(saved, tmp_path):
    out = tmp_path / "loaded.pt"
    spawn_gloo(_load, 2, str(saved), str(out))
    got = torch.load(out)
    t = _globals()
    assert got["step"] == 30 and got["state_step"] == 30 and got["sched"] == {"lr": [0.03]}
    for k in ("w", "v", "b"):
        assert torch.equal(got["model"][k], t[k] * 30.0), k


def test_plain_dcp_load_reads_the_hook_output(saved):
    t = _globals()
    state = {"model": {k: torch.zeros_like(v) for k, v in t.items()}}
    dcp.load(state, checkpoint_id=str(saved / "step_00000020"))
    for k in t:
        assert torch.equal(state["model"][k], t[k] * 20.0), k


class _FullDisk(Exception):
    pass


def test_failed_write_raises_on_wait_and_commits_nothing(tmp_path, monkeypatch):
    from ckptool.core import dcpwrite
    from training import AsyncCheckpointer

    ckpt = AsyncCheckpointer(str(tmp_path / "run"), keep_last=3)
    ckpt.save(1, {"w": torch.ones(4)})
    ckpt.wait()
    original = dcpwrite.DcpFileWriter.add_chunk

    def failing(self, *a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dcpwrite.DcpFileWriter, "add_chunk", failing)
    ckpt.save(2, {"w": torch.ones(4) * 2})
    with pytest.raises(OSError, match="not committed: rank 0: OSError.*No space left on device"):
        ckpt.wait()
    monkeypatch.setattr(dcpwrite.DcpFileWriter, "add_chunk", original)
    import ckptool

    assert ckptool.latest(str(tmp_path / "run")).path.endswith("step_00000001")
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["step_00000001"]  # no partial left
    state = {"w": torch.zeros(4)}
    assert AsyncCheckpointer(str(tmp_path / "run")).load_latest(state) == 1
    assert torch.equal(state["w"], torch.ones(4))


def test_keep_last_never_deletes_what_the_hook_did_not_write(tmp_path, run_cli):
    """A user's offline outputs beside the hook's (a conversion of an old step, a reshard kept
    in the run root) are committed ckptool checkpoints too: retention neither counts nor
    deletes them."""
    from training import AsyncCheckpointer

    root = tmp_path / "run"
    ckpt = AsyncCheckpointer(str(root), keep_last=2)
    ckpt.save(1, {"w": torch.ones(4)})
    ckpt.wait()
    assert run_cli("reshard", root / "step_00000001", root / "step_1_dp2", "--to-dp", "2").code == 0
    assert run_cli("reshard", root / "step_00000001", root / "old-dp3", "--to-dp", "3").code == 0
    for step in (2, 3, 4):
        ckpt.save(step, {"w": torch.ones(4) * step})
        ckpt.wait()
    assert sorted(p.name for p in root.iterdir()) == ["old-dp3", "step_00000003", "step_00000004",
                                                      "step_1_dp2"]


def test_a_rollback_resumes_and_retains_the_new_trajectory(tmp_path, run_cli):
    """After a loss spike the run goes back to step 30 and saves 35 and 45. The saves of the
    trajectory it gave up (40, 50) are skipped by ``latest`` and ``load_latest`` (they resumed
    step 50) and neither counted nor deleted by ``keep_last`` (which deleted 30 and 35)."""
    from training import AsyncCheckpointer

    root = tmp_path / "run"
    ckpt = AsyncCheckpointer(str(root), keep_last=3)
    for step in (10, 20, 30, 40, 50):
        ckpt.save(step, {"w": torch.ones(4) * step})
        ckpt.wait()
    state = {"w": torch.zeros(4)}
    assert ckpt.load_latest(state) == 50
    from training.async_checkpointer import load

    assert load(str(root / "step_00000030"), state) == 30  # the rollback
    for step in (35, 45):
        ckpt.save(step, {"w": torch.ones(4) * step})
        ckpt.wait()
    assert sorted(p.name for p in root.iterdir()) == [
        "step_00000030", "step_00000035", "step_00000040", "step_00000045", "step_00000050"]
    state = {"w": torch.zeros(4)}
    assert ckpt.load_latest(state) == 45 and torch.equal(state["w"], torch.ones(4) * 45)
    r = run_cli("latest", root)
    assert r.out.strip() == str(root / "step_00000045"), r.out + r.err
    assert "step_00000050: abandoned" in r.err and "step_00000040: abandoned" not in r.err  # 45 came first
    shutil.rmtree(root / "step_00000045")  # the new trajectory's newest lost: its previous, not 40
    assert run_cli("latest", root).out.strip() == str(root / "step_00000035")
    ckpt.save(55, {"w": torch.ones(4) * 55})  # and on: the new trajectory outgrows the old one
    ckpt.wait()
    assert run_cli("latest", root).out.strip() == str(root / "step_00000055")


def test_megatron_scheduler_of_a_hook_checkpoint_is_one_entry_for_the_megatron_writers(tmp_path):
    """The hook stores ``state["opt_param_scheduler"]`` one DCP object per field; the Megatron
    writers' ``adopt_dcp_common`` gives them back as the one dict Megatron-LM loads. Names
    that nest under a value (a hostile or mangled source) are one clear refusal."""
    import ckptool
    from ckptool.checkpoints.open import open_checkpoint
    from ckptool.core.errors import UnreadableInput
    from converters.megatron.common import adopt_dcp_common
    from training import AsyncCheckpointer

    sched = {"max_lr": 0.01, "num_steps": 8, "decay_style": "cosine", "nested": {"a": 1}}
    for name, value in (("good", sched), ("bad", {"a": 1, "a.b": 2})):
        ckpt = AsyncCheckpointer(str(tmp_path / name))
        ckpt.save(3, {"w": torch.ones(4), "opt_param_scheduler": value})
        ckpt.wait()
        opened = open_checkpoint(ckptool.latest(str(tmp_path / name)).path)
        if name == "good":
            adopt_dcp_common(opened)
            assert opened.index.objects["opt_param_scheduler"].value == sched
        else:
            with pytest.raises(UnreadableInput, match="nest under a value"):
                adopt_dcp_common(opened)


class _Planted:
    """Pickles as a call of ``os.mkdir(path)``: what a hostile scheduler field would hold."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        import os

        return os.mkdir, (self.path,)


def test_a_scheduler_field_that_pickles_a_call_is_refused_by_convert(tmp_path, run_cli):
    """The scheduler's fields are pickles the Megatron writers re-read to build ``common.pt``:
    one that names a global outside the allowlist is refused (exit 2, one line naming the
    entry and --trust-pickle), never run, and nothing is written."""
    from training import AsyncCheckpointer

    marker = tmp_path / "pwned"
    ckpt = AsyncCheckpointer(str(tmp_path / "run"))
    ckpt.save(3, {"w": torch.ones(4), "opt_param_scheduler": {"max_lr": 0.01,
                                                               "num_steps": _Planted(str(marker))}})
    ckpt.wait()
    ckpt.close()
    assert not marker.exists()
    res = run_cli("latest", tmp_path / "run")  # verify finds the pickle: latest skips it
    assert res.code == 1 and "posix.mkdir" in res.err, res.err
    src = sorted((tmp_path / "run").glob("step_*"))[-1]
    for target in ("megatron", "megatron-dist"):
        dst = tmp_path / f"out-{target}"
        res = run_cli("convert", src, dst, "--to", target)
        lines = res.err.strip().splitlines()
        assert res.code == 2 and len(lines) == 1, res.err
        assert "opt_param_scheduler" in lines[0] and "posix.mkdir" in lines[0] and "--trust-pickle" in lines[0]
        assert not marker.exists() and not dst.exists()


def test_load_latest_fills_a_tensor_that_is_not_contiguous(tmp_path):
    """A channels_last conv weight: the fill went into a copy (a view of such a tensor is one),
    load_latest returned the step and the parameter stayed as it was."""
    from training import AsyncCheckpointer

    conv = torch.nn.Conv2d(3, 8, 3).to(memory_format=torch.channels_last)
    ckpt = AsyncCheckpointer(str(tmp_path / "run"))
    ckpt.save(1, {"model": conv.state_dict(), "t": torch.arange(6.0).reshape(2, 3)})
    ckpt.wait()
    fresh = torch.nn.Conv2d(3, 8, 3).to(memory_format=torch.channels_last)
    state = {"model": fresh.state_dict(), "t": torch.zeros(3, 2).t()}
    assert not fresh.weight.is_contiguous() and not state["t"].is_contiguous()
    assert AsyncCheckpointer(str(tmp_path / "run")).load_latest(state) == 1
    assert torch.equal(fresh.weight, conv.weight) and torch.equal(state["t"], torch.arange(6.0).reshape(2, 3))


def test_load_latest_refuses_when_saves_exist_and_none_loads(tmp_path):
    """Saves that all fail (here: a set, which the loader's allowlist refuses) made load_latest
    return None, and `load_latest(state) or 0` restarted training from step 0 without a word.
    A save killed before its commit is still no save: None."""
    import shutil

    from ckptool.core.errors import NoCheckpoint
    from training import AsyncCheckpointer

    root = tmp_path / "run"
    ckpt = AsyncCheckpointer(str(root))
    ckpt.save(100, {"w": torch.ones(3), "seen": {3, 5}})
    ckpt.wait()
    with pytest.raises(NoCheckpoint, match="step_00000100.*allowlist"):
        AsyncCheckpointer(str(root)).load_latest({"w": torch.zeros(3), "seen": set()})
    shutil.move(root / "step_00000100", root / "step_00000100.tmp-1a2b3c")
    (root / "step_00000100.tmp-1a2b3c" / "ckptool.json").unlink()
    assert AsyncCheckpointer(str(root)).load_latest({"w": torch.zeros(3), "seen": set()}) is None


def test_a_load_that_does_not_match_writes_nothing(tmp_path):
    """A state with a tensor the checkpoint lacks: the tensors before it were already
    overwritten when the error came."""
    from ckptool.core.errors import BadCheckpoint
    from training import AsyncCheckpointer

    ckpt = AsyncCheckpointer(str(tmp_path / "run"))
    ckpt.save(1, {"a": torch.ones(2), "b": torch.ones(2)})
    ckpt.wait()
    state = {"a": torch.zeros(2), "b": torch.zeros(3)}
    with pytest.raises(BadCheckpoint):
        AsyncCheckpointer(str(tmp_path / "run")).load_latest(state)
    assert torch.equal(state["a"], torch.zeros(2))


@pytest.mark.parametrize("step", [1.0, "3", -1, True, None])
def test_a_step_that_is_not_one_is_refused_before_anything(step, tmp_path):
    """Checked on every rank before any collective: a float step raised on rank 0 alone and
    the other ranks waited in the broadcast for 30 minutes."""
    from training import AsyncCheckpointer

    ckpt = AsyncCheckpointer(str(tmp_path / "run"))
    with pytest.raises(ValueError, match="step must be"):
        ckpt.save(step, {"w": torch.ones(2)})
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def test_keep_last_prunes_steps_past_eight_digits_and_is_an_int(tmp_path):
    import numpy as np

    from training import AsyncCheckpointer

    with pytest.raises(ValueError, match="keep_last"):
        AsyncCheckpointer(str(tmp_path / "x"), keep_last=1.5)
    ckpt = AsyncCheckpointer(str(tmp_path / "run"), keep_last=1)
    for step in (10 ** 8, np.int64(10 ** 8 + 1)):
        ckpt.save(step, {"w": torch.ones(2)})
        ckpt.wait()
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["step_100000001"]


def test_two_state_keys_that_join_to_one_are_refused(tmp_path):
    """``{"a.b": x}`` beside ``{"a": {"b": y}}``: one was saved over the other; the checkpoint
    committed and then failed verify."""
    from training import AsyncCheckpointer

    ckpt = AsyncCheckpointer(str(tmp_path / "run"))
    with pytest.raises(ValueError, match="both 'a.b'"):
        ckpt.save(1, {"a.b": torch.ones(2), "a": {"b": torch.zeros(2)}})
    with pytest.raises(ValueError, match="both 'opt.1'"):
        ckpt.save(1, {"opt": {1: torch.ones(2), "1": torch.zeros(2)}})


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.complex64, torch.uint16])
def test_a_tensor_of_a_dtype_ckptool_does_not_write_is_refused_at_save(dtype, tmp_path):
    """save() returned and the background write failed with a bare KeyError naming no key."""
    from training import AsyncCheckpointer

    ckpt = AsyncCheckpointer(str(tmp_path / "run"))
    with pytest.raises(ValueError, match="'odd'.*does not write yet"):
        ckpt.save(1, {"w": torch.ones(2), "odd": torch.ones(4).to(dtype)})
    ckpt.save(1, {"w": torch.ones(2)})
    ckpt.wait()


def test_a_prune_that_fails_after_the_commit_is_a_warning(tmp_path, monkeypatch, caplog):
    """keep_last's removal of an older step failed (a busy parallel-filesystem path, here made
    to fail) after the new step was renamed into place: wait() said "not committed" while
    latest named the step."""
    import fsspec.implementations.local as local

    from ckptool.checkpoints.latest import latest
    from training import AsyncCheckpointer

    root = tmp_path / "run"
    ckpt = AsyncCheckpointer(str(root), keep_last=1)
    ckpt.save(1, {"w": torch.ones(3)})
    ckpt.wait()
    rm = local.LocalFileSystem.rm

    def busy(self, path, *args, **kwargs):
        if str(path).endswith("step_00000001"):
            raise OSError(16, "Device or resource busy", path)
        return rm(self, path, *args, **kwargs)

    monkeypatch.setattr(local.LocalFileSystem, "rm", busy)
    ckpt.save(2, {"w": torch.ones(3) * 2})
    with caplog.at_level("WARNING"):
        ckpt.wait()
    assert ckpt.last_committed.endswith("step_00000002") and "removing older checkpoints failed" in caplog.text
    assert latest(str(root)).path.endswith("step_00000002")


def test_a_save_in_flight_at_exit_is_finished(tmp_path):
    """A script that ends right after its last save(), without wait() or close(): the writer
    thread is a daemon and exit killed it, exit 0, the last save lost without a word."""
    import subprocess
    import sys
    from pathlib import Path

    root = tmp_path / "run"
    code = ("import torch\nfrom training import AsyncCheckpointer\n"
            f"AsyncCheckpointer({str(root)!r}).save(1000, {{'w': torch.arange(4e6).reshape(2000, 2000)}})\n")
    repo = Path(__file__).resolve().parents[1]
    p = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert (root / "step_00001000" / "ckptool.json").exists(), sorted(p.name for p in root.iterdir())
    from training import AsyncCheckpointer

    state = {"w": torch.zeros(2000, 2000)}
    assert AsyncCheckpointer(str(root)).load_latest(state) == 1000
    assert torch.equal(state["w"], torch.arange(4e6).reshape(2000, 2000))


def test_a_tensor_without_elements_is_saved_and_loads(tmp_path):
    """``torch.empty(0, 16)`` (a LoRA matrix of rank 0): nothing was stored for it, the
    checkpoint verified, and both load_latest and torch's dcp.load failed on the missing key."""
    from training import AsyncCheckpointer

    root = tmp_path / "run"
    ckpt = AsyncCheckpointer(str(root))
    ckpt.save(1, {"w": torch.ones(2), "lora_b": torch.empty(0, 16)})
    ckpt.wait()
    state = {"w": torch.zeros(2), "lora_b": torch.empty(0, 16)}
    assert AsyncCheckpointer(str(root)).load_latest(state) == 1 and torch.equal(state["w"], torch.ones(2))
    plain = {"w": torch.zeros(2), "lora_b": torch.empty(0, 16)}
    dcp.load(plain, checkpoint_id=str(root / "step_00000001"))
    assert torch.equal(plain["w"], torch.ones(2)) and plain["lora_b"].shape == (0, 16)


def test_int_keys_of_the_state_load_under_their_own_keys(tmp_path):
    """An optimizer-style ``{0: {...}}`` (LBFGS state): load failed with a bare KeyError '0', or
    wrote the value under '0' and left the int key as it was."""
    from training import AsyncCheckpointer

    ckpt = AsyncCheckpointer(str(tmp_path / "run"))
    ckpt.save(1, {"w": torch.ones(2), "opt": {0: {"n_iter": 7}, 1: 3}})
    ckpt.wait()
    state = {"w": torch.zeros(2), "opt": {0: {"n_iter": 0}, 1: 0}}
    assert AsyncCheckpointer(str(tmp_path / "run")).load_latest(state) == 1
    assert state["opt"] == {0: {"n_iter": 7}, 1: 3}


def _load_one_rank_fails(rank, world, root, out):
    from ckptool.core.errors import CkptoolError
    from training import AsyncCheckpointer

    t = _globals()
    state = {"model": {k: torch.zeros_like(v) for k, v in t.items()}, "step": 0, "sched": {"lr": []}}
    if rank == 1:
        state["model"]["extra"] = torch.zeros(3)  # a key the checkpoint does not hold: rank 1 fails
    try:
        got = AsyncCheckpointer(root).load_latest(state)
    except CkptoolError as exc:
        got = f"{type(exc).__name__}: {exc}"
    dist.barrier()  # a rank that returned while another raised would wait here for ever
    torch.save(got, f"{out}.{rank}")


def test_a_load_that_fails_on_one_rank_fails_on_every_rank(saved, tmp_path):
    """Rank 1's state wants a tensor the checkpoint does not hold; rank 0's loads. Both raise
    (rank 0 naming rank 1 and why), so no rank goes on training beside one that failed."""
    out = tmp_path / "got"
    spawn_gloo(_load_one_rank_fails, 2, str(saved), str(out))
    got = [torch.load(f"{out}.{r}") for r in range(2)]
    assert got[1].startswith("BadCheckpoint: source has no tensor 'model.extra'"), got
    assert got[0].startswith("BadCheckpoint: rank 1 could not load the checkpoint: source has no "
                             "tensor 'model.extra'"), got


def test_staging_buffers_of_entries_a_save_no_longer_holds_are_freed(tmp_path):
    """Staging buffers are kept from save to save; one whose entry is gone (a key dropped, a
    tensor resized) is freed, not held for the rest of the run."""
    import gc
    import weakref

    from training import AsyncCheckpointer
    from training.async_checkpointer import load

    ckpt = AsyncCheckpointer(str(tmp_path / "run"))
    ckpt.save(1, {"a": torch.ones(64, 64), "b": torch.ones(8)})
    ckpt.wait()
    staged = {key[0]: weakref.ref(plan[0]) for key, plan in ckpt._buffers.items()}
    assert set(staged) == {"a", "b"}
    ckpt.save(2, {"a": torch.full((32, 64), 2.0)})  # b dropped, a resized
    ckpt.wait()
    gc.collect()
    assert staged["a"]() is None and staged["b"]() is None
    ckpt.save(3, {"a": torch.full((32, 64), 3.0)})
    ckpt.close()
    state = {"a": torch.zeros(32, 64)}
    assert load(ckpt.last_committed, state) == 3 and torch.equal(state["a"], torch.full((32, 64), 3.0))
