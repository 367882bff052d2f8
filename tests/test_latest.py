"""`ckptool latest` skips newer corrupt or uncommitted checkpoints."""

from __future__ import annotations

import json
import shutil

from tests.test_verify import _flip_byte


def test_latest_returns_newest_valid(tmp_path, make_ckpt, run_cli):
    make_ckpt(tmp_path / "step_000100", iteration=100)
    good = make_ckpt(tmp_path / "step_000200", iteration=200)
    res = run_cli("latest", tmp_path)
    assert res.code == 0 and res.out.strip() == str(good) and res.err == ""


def test_latest_skips_corrupt_and_uncommitted(tmp_path, make_ckpt, run_cli):
    good = make_ckpt(tmp_path / "step_000100", iteration=100)
    corrupt = make_ckpt(tmp_path / "step_000200", iteration=200)
    _flip_byte(corrupt)
    uncommitted = make_ckpt(tmp_path / "step_000300", iteration=300)
    (uncommitted / "ckptool.json").unlink()
    # a writer killed before its rename leaves a temporary directory
    shutil.copytree(good, tmp_path / "step_000400.tmp-1a2b3c")
    res = run_cli("latest", tmp_path)
    assert res.code == 0, res.err
    assert res.out.strip() == str(good)
    lines = res.err.strip().splitlines()
    assert lines[0].startswith(f"skipped {tmp_path / 'step_000400.tmp-1a2b3c'}: not committed")
    assert lines[1].startswith(f"skipped {uncommitted}: not committed")
    assert lines[2].startswith(f"skipped {corrupt}: checksum mismatch")
    data = json.loads(run_cli("latest", tmp_path, "--json").out)
    assert data["path"] == str(good) and data["iteration"] == 100
    assert [s["path"] for s in data["skipped"]] == [
        str(tmp_path / "step_000400.tmp-1a2b3c"), str(uncommitted), str(corrupt)]


def test_no_verify_still_skips_uncommitted_but_not_corrupt(tmp_path, make_ckpt, run_cli):
    make_ckpt(tmp_path / "step_000100", iteration=100)
    corrupt = make_ckpt(tmp_path / "step_000200", iteration=200)
    _flip_byte(corrupt)
    res = run_cli("latest", tmp_path, "--no-verify")
    assert res.code == 0 and res.out.strip() == str(corrupt)


def test_latest_exits_1_when_nothing_valid(tmp_path, make_ckpt, run_cli):
    only = make_ckpt(tmp_path / "step_000100", iteration=100)
    _flip_byte(only)
    res = run_cli("latest", tmp_path)
    assert res.code == 1 and res.out == ""
    assert "ckptool: error: no valid checkpoint found" in res.err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run_cli("latest", empty).code == 1
    assert run_cli("latest", tmp_path / "missing").code == 1


def test_order_is_by_iteration_not_name(tmp_path, make_ckpt, run_cli):
    make_ckpt(tmp_path / "step_9", iteration=9)
    newest = make_ckpt(tmp_path / "step_10", iteration=10)
    assert run_cli("latest", tmp_path).out.strip() == str(newest)


def test_a_failure_with_json_is_one_json_document_on_stdout(tmp_path, run_cli):
    """A script that parses stdout of ``--json`` gets a document on failure too (it got nothing):
    ``ok`` false, the error line, and the exit code; the line stays on stderr."""
    import json as _json

    for argv, code in ((["latest", "--json", tmp_path / "none"], 1),
                       (["reshard", "--json", tmp_path, tmp_path / "out", "--to-dpp", "2"], 2)):
        r = run_cli(*argv)
        doc = _json.loads(r.out)
        assert r.code == code and doc["ok"] is False and doc["exit_code"] == code, r.out
        assert doc["error"] and doc["error"].split(" (")[0] in r.err, (doc, r.err)
    r = run_cli("latest", tmp_path / "none")
    assert r.code == 1 and r.out == ""  # without --json, stdout stays empty



def test_the_console_entry_keeps_output_and_exit_codes(tmp_path, make_ckpt):
    """``python -m ckptool`` (the console entry) ends a command that wrote nothing without the
    interpreter's teardown: what it printed into a pipe (block-buffered) still arrives whole,
    with the command's exit code, and a command that writes ends the ordinary way."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(repo)}

    def run(*argv):
        return subprocess.run([sys.executable, "-m", "ckptool", *map(str, argv)], capture_output=True,
                              text=True, env=env, cwd=repo, timeout=120)

    good = make_ckpt(tmp_path / "run" / "step_000100", iteration=100)
    bad = make_ckpt(tmp_path / "bad" / "step_000100", iteration=100)
    _flip_byte(bad)
    r = run("verify", "--json", "--deep", good)
    assert r.returncode == 0 and json.loads(r.stdout)["ok"] is True, (r.stdout, r.stderr)
    r = run("verify", "--json", bad)
    doc = json.loads(r.stdout)
    assert r.returncode == 1 and doc["ok"] is False and doc["problems"], (r.stdout, r.stderr)
    r = run("latest", tmp_path / "run")
    assert r.returncode == 0 and r.stdout.strip() == str(good), (r.stdout, r.stderr)
    r = run("latest", "--json", tmp_path / "none")
    assert r.returncode == 1 and json.loads(r.stdout)["exit_code"] == 1, (r.stdout, r.stderr)
    r = run("inspect", "--json", good)
    assert r.returncode == 0 and json.loads(r.stdout)["iteration"] == 100, (r.stdout, r.stderr)
    r = run("reshard", "-q", good, tmp_path / "out" / "step_000100", "--to-dp", "1")
    assert r.returncode == 0 and (tmp_path / "out" / "step_000100" / "ckptool.json").exists(), r.stderr
    r = run("verify", "--bogus", good)
    assert r.returncode == 2 and "bogus" in r.stderr, r.stderr


def test_same_step_outputs_and_numbered_names_never_outrank_the_training_save(tmp_path, make_ckpt, run_cli):
    """What users keep in a run root beside the saves: a reshard of step 8 (its manifest says
    8; its name sorted after the save's, so it was returned), a foreign model whose name holds
    a number (``llama-13b-base`` was read as step 13). ``latest`` returns the training save."""
    import torch.distributed.checkpoint as dcp

    from tests.conftest import sample_state

    root = tmp_path / "run"
    make_ckpt(root / "step_00000004", iteration=4)
    save = make_ckpt(root / "step_00000008", iteration=8)
    assert run_cli("reshard", save, root / "step_00000008-dp2", "--to-dp", "2").code == 0
    dcp.save(sample_state(1), checkpoint_id=str(root / "llama-13b-base"))
    r = run_cli("latest", "--json", root)
    doc = json.loads(r.out)
    assert r.code == 0 and doc["path"] == str(save) and doc["iteration"] == 8, r.out


def test_no_verify_still_checks_every_file_is_there_and_whole(tmp_path, make_ckpt, run_cli):
    """``--no-verify`` skips hashing, not the manifest's sizes: a newer save with a file deleted
    or truncated is skipped with the reason (it was returned)."""
    from tests.harness.damage import truncate

    root = tmp_path / "run"
    good = make_ckpt(root / "step_00000004", iteration=4)
    bad = make_ckpt(root / "step_00000008", iteration=8)
    truncate(bad / "__0_0.distcp", 100)
    r = run_cli("latest", "--no-verify", root)
    assert r.code == 0 and r.out.strip() == str(good) and "bytes, the manifest says" in r.err, r.err
    (bad / ".metadata").unlink()
    r = run_cli("latest", "--no-verify", root)
    assert r.code == 0 and r.out.strip() == str(good) and ".metadata is missing" in r.err, r.err


def test_a_temporary_output_named_directly_is_not_committed(tmp_path, make_ckpt, run_cli):
    """A crash between the manifest's write and the rename leaves ``NAME.tmp-*`` with a whole
    manifest. Named directly, verify, latest, reshard and the hook's load refuse it (exit 1):
    verify said "OK, committed"."""
    from ckptool.core.errors import BadCheckpoint
    from training.async_checkpointer import load

    tmp = tmp_path / "run" / "step_00000008.tmp-0123abcd"
    shutil.copytree(make_ckpt(tmp_path / "step_00000008", iteration=8), tmp)
    r = run_cli("verify", tmp)
    assert r.code == 1 and "not committed" in r.out, r.out
    assert run_cli("latest", tmp).code == 1
    r = run_cli("reshard", tmp, tmp_path / "out", "--to-dp", "2")
    assert r.code == 1 and "not committed" in r.err and not (tmp_path / "out").exists(), r.err
    import pytest
    import torch

    with pytest.raises(BadCheckpoint, match="not committed"):
        load(str(tmp), {"w": torch.zeros(1)})


def test_a_save_that_records_no_step_has_the_step_of_its_name(tmp_path, run_cli):
    """A plain torch DCP save records no iteration: ``latest`` and the hook's ``load`` give the
    step of its directory name (``load_latest(state) or 0`` restarted the step count at 0)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from training.async_checkpointer import load

    dcp.save({"w": torch.arange(4.0)}, checkpoint_id=str(tmp_path / "run" / "step_00000100"))
    doc = json.loads(run_cli("latest", "--json", tmp_path / "run").out)
    assert doc["iteration"] == 100, doc
    state = {"w": torch.zeros(4)}
    assert load(str(tmp_path / "run" / "step_00000100"), state) == 100
    assert torch.equal(state["w"], torch.arange(4.0))


def test_a_megatron_root_stays_one_checkpoint_beside_a_committed_export(tmp_path, make_ckpt, run_cli):
    """A Megatron run root (its tracker names the iteration Megatron's --load takes) with a
    ckptool output kept in it: ``latest`` still returns the root. It returned the export, or
    ``ROOT/iter_*``, from which Megatron's --load finds no tracker and starts from random."""
    from tests.harness import mcore as H

    root = tmp_path / "mg"
    H.save_real(H.GPT, 1, root)
    assert run_cli("latest", root).out.strip() == str(root)
    make_ckpt(root / "export-10", iteration=10)  # a conversion of the root's iteration, kept in it
    r = run_cli("latest", root)
    assert r.code == 0 and r.out.strip() == str(root), r.out + r.err


def test_a_megatron_root_whose_tracked_iteration_is_bad_names_an_older_good_one(tmp_path, run_cli):
    """``latest`` prints a Megatron root (what --load takes), so when the iteration its tracker
    names is damaged it exits 1; the error now names the older iteration that passes and what to
    do (it said only "no valid checkpoint found")."""
    from tests.harness import mcore as H
    from tests.harness.damage import truncate

    root = tmp_path / "mg"
    H.save_real(H.GPT, 1, root)
    shutil.copytree(root / "iter_0000010", root / "iter_0000005")
    truncate(root / "iter_0000010" / "mp_rank_00" / "model_optim_rng.pt", 1000)
    r = run_cli("latest", root)
    assert r.code == 1 and "iter_0000005 passes" in r.err and "latest_checkpointed_iteration.txt" in r.err, r.err


def test_what_latest_passes_by_is_listed_and_a_file_is_a_usage_error(tmp_path, make_ckpt, run_cli):
    """A save named like one that no format reads (emptied, half copied) is listed among the
    skipped with why (it was passed by in silence), also in the --json document of a failure
    (which had no list: with -q nothing said why); a file given as ROOT or CKPT is exit 2 (it
    was "no checkpoint", exit 1, and "found an empty directory")."""
    root = tmp_path / "run"
    good = make_ckpt(root / "step_00000004", iteration=4)
    (root / "step_00000020").mkdir()
    (root / "step_00000020" / "__0_0.distcp").write_bytes(b"x" * 10)
    r = run_cli("latest", root)
    assert r.code == 0 and r.out.strip() == str(good) and "step_00000020: not a checkpoint" in r.err, r.err
    shutil.rmtree(good)
    r = run_cli("latest", "--json", "-q", root)
    doc = json.loads(r.out)
    assert r.code == 1 and [s["path"] for s in doc["skipped"]] == [str(root / "step_00000020")], r.out
    f = root / "step_00000020" / "__0_0.distcp"
    for cmd in ("latest", "verify", "inspect"):
        r = run_cli(cmd, f)
        assert r.code == 2 and "is a file" in r.err, (cmd, r.err)


def test_a_manifest_with_another_hash_says_so(tmp_path, make_ckpt, run_cli):
    ck = make_ckpt(tmp_path / "step_00000004", iteration=4)
    doc = json.loads((ck / "ckptool.json").read_text())
    doc["hash"] = "sha256"
    (ck / "ckptool.json").write_text(json.dumps(doc))
    r = run_cli("verify", ck)
    assert r.code == 1 and "unknown hash 'sha256'" in r.out, r.out


def test_torchtitan_step_names_order_by_their_step(tmp_path, run_cli):
    """torchtitan saves ``step-500``, ``step-1000``: ordered by step (``step-900`` was taken as
    the newest once only ``step_N`` names counted)."""
    import torch
    import torch.distributed.checkpoint as dcp

    for step in (500, 900, 1000):
        dcp.save({"w": torch.ones(2) * step}, checkpoint_id=str(tmp_path / "tt" / f"step-{step}"))
    doc = json.loads(run_cli("latest", "--json", tmp_path / "tt").out)
    assert doc["path"] == str(tmp_path / "tt" / "step-1000") and doc["iteration"] == 1000, doc


def test_a_run_root_given_to_verify_or_inspect_skips_abandoned_saves(tmp_path, run_cli):
    """``verify ROOT`` and ``inspect ROOT`` check the checkpoint ``latest ROOT`` names: after a
    rollback, not the newest step of the given-up trajectory (they took step 50)."""
    import torch

    from training import AsyncCheckpointer
    from training.async_checkpointer import load

    root = tmp_path / "run"
    ckpt = AsyncCheckpointer(str(root), keep_last=None)
    for step in (30, 40, 50):
        ckpt.save(step, {"w": torch.ones(2) * step})
        ckpt.wait()
    load(str(root / "step_00000030"), {"w": torch.zeros(2)})
    ckpt.save(35, {"w": torch.ones(2) * 35})
    ckpt.wait()
    assert json.loads(run_cli("inspect", "--json", root).out)["iteration"] == 35
    assert str(root / "step_00000035") in run_cli("verify", root).out


def test_closed_stdout_is_no_traceback(tmp_path, make_ckpt):
    """``ckptool latest ROOT >&-`` (stdout closed: Python's sys.stdout is None) ends without a
    traceback, as it did before the console entry's quick exit."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    make_ckpt(tmp_path / "run" / "step_00000004", iteration=4)
    repo = Path(__file__).resolve().parents[1]
    r = subprocess.run(f"{sys.executable} -m ckptool latest {tmp_path / 'run'} >&-", shell=True, cwd=repo,
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(repo)}, timeout=120)
    assert "Traceback" not in r.stderr and r.returncode in (0, 120), (r.returncode, r.stderr)


def test_a_megatron_root_yields_to_later_saves_and_its_own_name_is_no_step(tmp_path, make_ckpt, run_cli):
    """A Megatron root (tracker at iteration 10) into which the hook then saved step 20: the
    later save is the newest (the root won, and a resume would have gone back to 10). A root
    named like a number (a Slurm job id) does not take that number as its step."""
    from tests.harness import mcore as H

    root = tmp_path / "123456"
    H.save_real(H.GPT, 1, root)
    doc = json.loads(run_cli("latest", "--json", root).out)
    assert doc["path"] == str(root) and doc["iteration"] != 123456, doc
    later = make_ckpt(root / "step_00000020", iteration=20)
    assert run_cli("latest", root).out.strip() == str(later)


def test_a_save_symlinked_out_of_the_run_root_is_listed_as_skipped_and_never_pruned(tmp_path, make_ckpt, run_cli):
    """``step_20 -> /elsewhere/step_20``: no read goes through it (a run root's paths stay inside
    it), and it used to be passed by without a word, so a restart resumed from step 10 with
    nothing saying why. The hook's ``keep_last`` neither counts nor deletes it."""
    import os

    import torch

    from training import AsyncCheckpointer

    root = tmp_path / "run"
    ckpt = AsyncCheckpointer(str(root), keep_last=1)
    ckpt.save(10, {"w": torch.ones(2)})
    ckpt.wait()
    elsewhere = make_ckpt(tmp_path / "elsewhere" / "step_00000020", iteration=20)
    os.symlink(elsewhere, root / "step_00000020")
    res = run_cli("latest", root)
    assert res.code == 0 and res.out.strip() == str(root / "step_00000010"), (res.out, res.err)
    assert f"skipped {root / 'step_00000020'}: is a symlink to {elsewhere}, outside the run root" in res.err
    doc = json.loads(run_cli("latest", root, "--json").out)
    assert [s["path"] for s in doc["skipped"]] == [str(root / "step_00000020")], doc
    ckpt.save(11, {"w": torch.ones(2)})
    ckpt.wait()
    assert (elsewhere / "ckptool.json").exists() and (root / "step_00000020").is_symlink()
    assert not (root / "step_00000010").exists()
    assert run_cli("verify", elsewhere, "--deep").code == 0


_SAVER = """
import sys, time
import torch
from training import AsyncCheckpointer
ckpt, step, end = AsyncCheckpointer(sys.argv[1], keep_last=1), 0, time.time() + float(sys.argv[2])
while time.time() < end:
    step += 1
    ckpt.save(step, {"w": torch.full((256, 256), float(step))})
    time.sleep(0.02)  # a save every ~30 ms: far faster than any job, and a prune in most calls
ckpt.wait()
"""


def test_latest_beside_a_job_that_saves_and_prunes_always_finds_one(tmp_path):
    """A job saving with keep_last=1 as fast as it can, and `latest` called meanwhile: it judged
    step N while the job committed N+1 and removed N, and said "no valid checkpoint" about a
    tenth of the time although one existed at every moment. It lists again when the root
    changed under it."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    from ckptool.checkpoints.latest import latest
    from ckptool.core.errors import NoCheckpoint

    root = tmp_path / "run"
    repo = Path(__file__).resolve().parents[1]
    job = subprocess.Popen([sys.executable, "-c", _SAVER, str(root), "8"], cwd=repo)
    try:
        while not any(p.name.startswith("step_") and "." not in p.name
                      for p in (root.iterdir() if root.exists() else [])):
            time.sleep(0.05)
        found = missed = 0
        end = time.time() + 5
        while time.time() < end:
            try:
                latest(str(root))
                found += 1
            except NoCheckpoint:
                missed += 1
    finally:
        job.wait(timeout=120)
    assert found > 50 and missed == 0, (found, missed)
