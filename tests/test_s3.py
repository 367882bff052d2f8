"""Object storage, for real: moto in server mode is an S3 endpoint on 127.0.0.1, reached
through s3fs exactly as a cluster's object store would be. The hook saves from a 2-process
gloo job, `latest`/`verify`/`inspect`/`reshard` run on s3:// URLs, and an uncommitted
prefix left by a killed writer is never returned."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist


from tests.conftest import assembled, free_port, peer, spawn_gloo  # noqa: E402
from tests.harness.damage import flip_bit  # noqa: E402

peer("s3fs")
peer("moto")

BUCKET = "ckpts"


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on 127.0.0.1; fsspec (this process and children) points at it."""
    import fsspec
    import s3fs
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "FSSPEC_S3_ENDPOINT_URL": endpoint}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    fsspec.config.conf.setdefault("s3", {})["endpoint_url"] = endpoint
    fs = s3fs.S3FileSystem(endpoint_url=endpoint)
    fs.mkdir(BUCKET)
    yield fs
    fsspec.config.conf["s3"].pop("endpoint_url", None)
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    server.stop()


def _globals():
    g = torch.Generator().manual_seed(11)
    return {"w": torch.randn(12, 8, generator=g), "b": torch.randn(8, generator=g)}


def _save(rank, world, root, steps):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from training import AsyncCheckpointer

    mesh = init_device_mesh("cpu", (world,))
    t = _globals()
    ckpt = AsyncCheckpointer(root, keep_last=5, topology={"tp": 1, "pp": 1, "dp": world})
    for step in steps:
        state = {"w": distribute_tensor(t["w"] * step, mesh, [Shard(0)]), "b": t["b"] * step,
                 "step": step}
        ckpt.save(step, state)
    ckpt.wait()
    dist.barrier()


def _tensors(url: str) -> dict[str, torch.Tensor]:
    from ckptool.checkpoints.open import open_checkpoint

    opened = open_checkpoint(url)
    return {key: assembled(opened, key) for key in opened.index.tensors}


@pytest.fixture(scope="module")
def run(s3):
    url = f"s3://{BUCKET}/run"
    spawn_gloo(_save, 2, url, (1, 2))
    return url


def test_hook_saves_to_s3_and_latest_finds_it(run, run_cli):
    r = run_cli("latest", run)
    assert r.code == 0 and r.out.strip() == f"{run}/step_00000002", r.err
    assert run_cli("verify", "--deep", f"{run}/step_00000002").code == 0
    t = _tensors(f"{run}/step_00000002")
    assert torch.equal(t["w"], _globals()["w"] * 2) and torch.equal(t["b"], _globals()["b"] * 2)
    assert run_cli("inspect", run).code == 0


def test_an_uncommitted_prefix_is_never_returned(s3, run, run_cli):
    # A killed writer: the data and DCP metadata of step 3 are there, the manifest is not.
    for f in s3.ls(f"{BUCKET}/run/step_00000002"):
        if not f.endswith("ckptool.json"):
            s3.copy(f, f.replace("step_00000002", "step_00000003"))
    r = run_cli("latest", run)
    assert r.code == 0 and r.out.strip() == f"{run}/step_00000002"
    assert "step_00000003" in r.err and "not committed" in r.err
    assert run_cli("verify", f"{run}/step_00000003").code == 1


def test_a_writer_killed_mid_save_leaves_nothing_latest_returns(s3, run, run_cli):
    code = (
        "import os, torch\n"
        "from training import AsyncCheckpointer\n"
        f"c = AsyncCheckpointer('s3://{BUCKET}/run', keep_last=None)\n"
        "c.save(9, {'w': torch.randn(4096, 1024), 'b': torch.zeros(8)})\n"
        "os._exit(1)  # killed while the background write runs\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ))
    assert proc.returncode == 1, proc.stderr
    r = run_cli("latest", run)
    assert r.code == 0 and r.out.strip() == f"{run}/step_00000002"


def test_verify_catches_a_corrupted_object(s3, run, run_cli, tmp_path):
    # Work on a copy so the other tests keep their run.
    s3.copy(f"{BUCKET}/run/step_00000001", f"{BUCKET}/corrupt/step_00000001", recursive=True)
    s3.copy(f"{BUCKET}/run/step_00000002", f"{BUCKET}/corrupt/step_00000002", recursive=True)
    victim = next(f for f in s3.ls(f"{BUCKET}/corrupt/step_00000002") if f.endswith(".distcp"))
    s3.pipe_file(victim, flip_bit(s3.cat_file(victim)))
    r = run_cli("verify", f"s3://{BUCKET}/corrupt/step_00000002")
    assert r.code == 1 and "checksum mismatch" in r.out + r.err
    r = run_cli("latest", f"s3://{BUCKET}/corrupt")
    assert r.code == 0 and r.out.strip().endswith("step_00000001")


@pytest.mark.parametrize("src_local,dst_local", [(False, False), (True, False), (False, True)])
def test_reshard_between_s3_and_local_is_exact(s3, run, run_cli, tmp_path, src_local, dst_local):
    src = f"{run}/step_00000002"
    if src_local:  # local -> S3: first bring a local copy
        local = tmp_path / "local-src"
        assert run_cli("reshard", src, local, "--to-dp", "1").code == 0
        src = str(local)
    tag = f"{int(src_local)}{int(dst_local)}"
    dst = str(tmp_path / "out") if dst_local else f"s3://{BUCKET}/resharded-{tag}"
    r = run_cli("reshard", src, dst, "--to-dp", "3")
    assert r.code == 0, r.err
    assert run_cli("verify", "--deep", dst).code == 0
    a, b = _tensors(f"{run}/step_00000002"), _tensors(dst)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_a_rewrite_killed_at_its_s3_commit_resumes_on_the_rerun(s3, run, run_cli, monkeypatch):
    """On an object store the output is written in place and the manifest commits it. A run
    killed just before that write must leave its re-run the resume key: the re-run keeps the
    finished files and commits, not "destination already exists"."""
    from ckptool.core import storage

    dst = f"s3://{BUCKET}/killed-at-commit"

    def killed(self, write_manifest):
        raise KeyboardInterrupt  # the process dies here

    with monkeypatch.context() as m:
        m.setattr(storage.MarkerOutput, "commit", killed)
        assert run_cli("reshard", f"{run}/step_00000002", dst, "--to-dp", "3").code == 130
    r = run_cli("verify", dst)  # written, not committed
    assert r.code == 1 and "not committed" in r.err, r.err
    r = run_cli("reshard", f"{run}/step_00000002", dst, "--to-dp", "3")
    assert r.code == 0 and "kept 3 finished files" in r.out, r.out + r.err
    assert run_cli("verify", "--deep", "--strict", dst).code == 0  # no journal left in it
    a, b = _tensors(f"{run}/step_00000002"), _tensors(dst)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def _save_with_an_outage(rank, world, root, out):
    """Rank 1's write fails; rank 0's clean-up of the failed save meets the store's own error
    (botocore's are not OSError), as when the endpoint goes down mid-save."""
    import botocore.exceptions
    import s3fs

    from training import AsyncCheckpointer, async_checkpointer

    if rank == 1:
        def failing(*a, **k):
            raise OSError(5, "Input/output error")
        async_checkpointer.write_rank_file = failing
    else:
        def down(self, *a, **k):
            raise botocore.exceptions.EndpointConnectionError(endpoint_url="http://127.0.0.1:1")
        s3fs.S3FileSystem.rm = down
    ckpt = AsyncCheckpointer(root)
    ckpt.save(7, {"w": torch.ones(8) * rank})
    try:
        ckpt.wait()
        got = "committed"
    except OSError as exc:
        got = str(exc)
    torch.save(got, f"{out}.{rank}")


def test_a_save_that_fails_during_an_outage_fails_on_every_rank(s3, tmp_path):
    """Rank 0 raised the store's error out of its commit and never told rank 1, which waited
    for ever; now every rank's wait() raises, naming the write that failed."""
    out = tmp_path / "got"
    spawn_gloo(_save_with_an_outage, 2, f"s3://{BUCKET}/outage", str(out))
    got = [torch.load(f"{out}.{r}") for r in range(2)]
    for text in got:
        assert "not committed" in text and "rank 1: OSError" in text, got


def test_an_odd_key_beside_the_checkpoints_does_not_hide_them(s3, run, run_cli):
    """An object store key ``root/../junk`` lists as a child ``..`` of the run root: it is no
    checkpoint and is passed by, not taken for one that leaves the root (latest exit 1 and
    load_latest raising, so keep_last stopped pruning)."""
    import boto3

    root = f"s3://{BUCKET}/odd"
    assert run_cli("reshard", f"{run}/step_00000002", f"{root}/step_00000002", "--to-dp", "1").code == 0
    boto3.client("s3", endpoint_url=os.environ["FSSPEC_S3_ENDPOINT_URL"]).put_object(
        Bucket=BUCKET, Key="odd/../junk", Body=b"x")
    s3.invalidate_cache()
    assert ".." in [p.rsplit("/", 1)[-1] for p in s3.ls(f"{BUCKET}/odd")]  # the premise
    r = run_cli("latest", root)
    assert r.code == 0 and r.out.strip() == f"{root}/step_00000002", r.out + r.err


def test_overwrite_of_an_s3_destination_keeps_it_when_the_source_is_refused(s3, run, run_cli, tmp_path):
    """On an object store --overwrite deletes DST before writing in place: a source whose
    hashes do not match was found only while writing, after the good DST was gone (exit 1,
    "nothing was written", and an empty prefix). It is checked before the delete now."""
    import shutil

    dst = f"s3://{BUCKET}/kept"
    assert run_cli("reshard", f"{run}/step_00000002", dst, "--to-dp", "2").code == 0
    local = tmp_path / "src"
    assert run_cli("reshard", f"{run}/step_00000002", local, "--to-dp", "1").code == 0
    damaged = tmp_path / "damaged"
    shutil.copytree(local, damaged)
    data = next(damaged.glob("*.distcp"))
    data.write_bytes(flip_bit(data.read_bytes()))
    r = run_cli("reshard", damaged, dst, "--to-dp", "3", "--overwrite")
    assert r.code == 1 and "does not match the source's manifest" in r.err, r.err
    assert run_cli("verify", "--deep", dst).code == 0  # the old DST, whole
    assert run_cli("reshard", local, dst, "--to-dp", "3", "--overwrite").code == 0
    a, b = _tensors(f"{run}/step_00000002"), _tensors(dst)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_a_resave_killed_before_it_commits_never_reads_as_a_fresh_run(s3):
    """A job that resumed from step 5 and saves step 5 again uncommits and empties the old
    step first (no rename on an object store). Killed before the new save commits, with
    keep_last=1, the run root was empty: load_latest returned None, a silent restart from
    step 0. The prefix keeps a trace: load_latest raises, naming the step."""
    from ckptool.core.errors import NoCheckpoint
    from training import AsyncCheckpointer

    root = f"s3://{BUCKET}/resave"
    ckpt = AsyncCheckpointer(root, keep_last=1)
    ckpt.save(5, {"w": torch.ones(4) * 5})
    ckpt.wait()
    ckpt._target_name(5)  # what save(5) does before its write starts; the job dies here
    state = {"w": torch.zeros(4)}
    with pytest.raises(NoCheckpoint, match="step_00000005"):
        AsyncCheckpointer(root).load_latest(state)
    ckpt.save(5, {"w": torch.ones(4) * 6})  # the re-run saves it again, whole
    ckpt.wait()
    assert AsyncCheckpointer(root).load_latest(state) == 5 and torch.equal(state["w"], torch.ones(4) * 6)
    assert not s3.exists(f"{BUCKET}/resave/step_00000005/.ckptool-resaving")


def test_a_missing_bucket_is_not_a_first_start_and_odd_urls_are_refused(s3, run, run_cli):
    """A restart script reads latest's exit 1 as "nothing saved yet, start fresh": a bucket
    that is not there (a typo in the URL) is unreadable storage, exit 2. A URL with "//" or a
    "." segment names other keys than it seems to (written to one prefix, listed from
    another): refused."""
    r = run_cli("latest", "s3://no-such-bucket/run")
    assert r.code == 2 and "bucket 'no-such-bucket' does not exist" in r.err, r.err
    assert run_cli("latest", f"s3://{BUCKET}/never-saved").code == 1  # a first start
    for odd in (f"s3://{BUCKET}//run", f"s3://{BUCKET}/./run"):
        r = run_cli("reshard", f"{run}/step_00000002", f"{odd}-copy", "--to-dp", "1")
        assert r.code == 2 and "path segment" in r.err, r.err
        assert run_cli("latest", odd).code == 2


def test_a_rewrite_killed_before_its_first_file_on_s3_reads_as_uncommitted(s3, run, run_cli, monkeypatch):
    """Killed before any data file (only its resume key written), an object store's output
    read as "not a checkpoint ckptool knows" (exit 2); it is an uncommitted rewrite (exit 1),
    which the same command resumes."""
    from converters.dcp import DcpWriter

    dst = f"s3://{BUCKET}/killed-early"

    def killed(self, *a, **k):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(DcpWriter, "write_file", killed)
        assert run_cli("reshard", f"{run}/step_00000002", dst, "--to-dp", "3").code == 130
    r = run_cli("verify", dst)
    assert r.code == 1 and "not committed: the output of a reshard or convert" in r.err, r.err
    assert run_cli("reshard", f"{run}/step_00000002", dst, "--to-dp", "3").code == 0
    assert run_cli("verify", "--deep", "--strict", dst).code == 0
